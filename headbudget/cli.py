"""The ``headbudget`` command line: subcommands live in headbudget/commands/, one module each."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from headbudget.commands.common import USER_ERRORS, CliError
from headbudget.extras import missing_extra

# Each module exposes ``register(subparsers)``; handlers import heavy libraries lazily so --help is fast.
COMMANDS = ("train", "evaluate", "decider", "predict", "bench", "export", "serve", "keys", "importance", "compare",
            "compare_adaptive")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (plus exit 2) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = OneLineParser(prog="headbudget", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"headbudget.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"headbudget.commands.{name}":
                continue  # a subcommand not built yet
            raise
        module.register(sub)
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
