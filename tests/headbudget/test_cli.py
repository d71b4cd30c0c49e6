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


def test_no_command_is_one_line_naming_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "headbudget: error: the following arguments are required: COMMAND\n"
