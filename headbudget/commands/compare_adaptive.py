"""`headbudget compare-adaptive`: BudgetFormer, span and AdaAttention checkpoints against the budgeted one."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from headbudget.experiments.adaptive.summary import add_arguments

    p = sub.add_parser("compare-adaptive", help="compare adaptive checkpoints with the budgeted one (accuracy at "
                       "the same mean cost, latency on real texts and at fixed lengths)")
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from headbudget.experiments.adaptive.summary import run

    return run(args)
