"""The ``headbudget`` command line. Each subcommand is a module of headbudget/commands/ with ``register``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import textwrap
from collections.abc import Sequence

from headbudget.commands.common import USER_ERRORS, CliError
from headbudget.commands.parser import OneLineParser
from headbudget.extras import missing_extra

# Each module exposes ``register(subparsers)``; handlers import heavy libraries lazily so --help is fast.
COMMANDS = ("train", "evaluate", "decider", "predict", "bench", "export", "serve", "keys", "usage", "importance",
            "compare", "compare_adaptive")
ABOUT = ("headbudget: text classification where each request picks its compute budget (a share of the model\n"
         "from 0.1 to 1, `auto`, or a latency limit), and one checkpoint serves every budget.")
HELP_WIDTH = 100
# How --help lists the commands (their names on the command line); a command in no group is listed last.
GROUPS = (
    ("train and measure a checkpoint", ("train", "eval", "bench", "compare", "decider", "importance", "compare-adaptive")),
    ("serve it over HTTP", ("serve", "keys", "usage")),
    ("use it directly", ("predict", "export")),
)


def _command_list(helps: dict[str, str]) -> str:
    """The registered commands with their one-line help, under GROUPS' headings."""
    rest = tuple(name for name in helps if not any(name in names for _, names in GROUPS))
    width = max(map(len, helps), default=0) + 2
    blocks = []
    for title, names in (*GROUPS, ("other", rest)):
        lines = [textwrap.fill(helps[name], HELP_WIDTH, initial_indent=f"  {name:<{width}}",
                               subsequent_indent=" " * (width + 2)) for name in names if name in helps]
        if lines:
            blocks.append(f"{title}:\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = OneLineParser(prog="headbudget", usage="headbudget [-h] COMMAND ...",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="Run `headbudget COMMAND --help` for a command's options.")
    # The commands are listed by group in the description, so argparse's flat list is suppressed.
    # prog: argparse would otherwise prefix each command's usage with the custom usage above
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND",
                                help=argparse.SUPPRESS, prog="headbudget")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"headbudget.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"headbudget.commands.{name}":
                continue  # a subcommand not built yet
            raise
        module.register(sub)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}  # noqa: SLF001 - argparse keeps each help only here
    parser.description = f"{ABOUT}\n\n{_command_list(helps)}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"headbudget {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except USER_ERRORS as e:
        print(f"headbudget {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"headbudget {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:
        message = missing_extra(args.command, e)  # an extra that is not installed: say which, in one line
        if message is None:
            raise
        print(f"headbudget {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
