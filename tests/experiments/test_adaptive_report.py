"""The adaptive types' registry, as the experiments' reports and plots and the predict command read it."""

from __future__ import annotations

from headbudget.commands.predict import _USAGE_LINES
from headbudget.experiments.adaptive.report import REPORTS
from headbudget.experiments.plots import ADAPTIVE_PANELS
from headbudget.models.model_types import adaptive_types


def test_every_adaptive_type_has_a_report_a_figure_and_a_predict_line() -> None:
    assert set(REPORTS) == set(ADAPTIVE_PANELS) == set(_USAGE_LINES) == set(adaptive_types())
