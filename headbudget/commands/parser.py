"""The argument parser of every command line in the package: the CLI's subcommands and the standalone tools."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (plus exit 2) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")
