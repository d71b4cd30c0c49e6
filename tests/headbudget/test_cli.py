"""`headbudget --help`: what the tool is, its commands by group, and where each command's options are."""

from __future__ import annotations

import pytest

from headbudget.cli import GROUPS, build_parser, main


def test_help_says_what_headbudget_is_and_lists_every_command_once_by_group() -> None:
    parser = build_parser()
    text = parser.format_help()
    commands = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001
    grouped = [name for _, names in GROUPS for name in names]
    assert sorted(grouped) == sorted(commands)  # no command left ungrouped, no group naming a gone command
    assert text.startswith("usage: headbudget [-h] COMMAND ...\n\nheadbudget: text classification")
    assert "compute budget" in text and "one checkpoint serves every budget" in text
    headings = [text.index(f"\n{title}:\n") for title, _ in GROUPS]
    assert headings == sorted(headings) and "\nother:\n" not in text
    for title, names in GROUPS:
        block = text.split(f"\n{title}:\n")[1].split("\n\n")[0]
        assert [line.split()[0] for line in block.splitlines() if not line.startswith("    ")] == list(names)
    assert text.rstrip().endswith("Run `headbudget COMMAND --help` for a command's options.")
    assert "headbudget/commands" not in text and all(len(line) <= 100 for line in text.splitlines())


def test_each_commands_usage_starts_with_its_own_name() -> None:
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, sub in choices.items():
        assert sub.format_usage().startswith(f"usage: headbudget {name} [-h]"), sub.format_usage()


def test_no_command_is_one_line_naming_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "headbudget: error: the following arguments are required: COMMAND\n"


@pytest.mark.parametrize("text", ["0.05", "0.0999", "0.1", "0.5", "1", "1.01", "nan", "inf", "-0.2"])
def test_the_cli_takes_the_budgets_the_api_takes(text: str) -> None:
    """One range for both: a budget `headbudget predict` runs is one /classify answers, and the reverse."""
    import argparse

    from pydantic import ValidationError

    from headbudget.commands.common import budget_arg
    from headbudget.service.http.schemas import ClassifyRequest

    try:
        budget_arg(text)
        cli = True
    except argparse.ArgumentTypeError:
        cli = False
    try:
        ClassifyRequest.model_validate({"text": "x", "budget": float(text)})
        api = True
    except ValidationError:
        api = False
    assert cli == api


def _tools() -> list[str]:
    """Every module under the tool packages with a ``main(argv)``: the ``python -m`` commands."""
    import pkgutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    names = []
    for folder, prefix in (("headbudget/loadtest", "headbudget.loadtest."),
                           ("headbudget/experiments", "headbudget.experiments."), ("lab", "lab.")):
        for info in pkgutil.walk_packages([str(root / folder)], prefix):
            path = root / (info.name.replace(".", "/") + ".py")
            if path.is_file() and "\ndef main(argv" in path.read_text():
                names.append(info.name)
    return names


@pytest.mark.parametrize("module", _tools())
def test_every_tool_reports_a_bad_flag_in_one_line(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err, err
