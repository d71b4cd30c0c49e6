"""Progress of a training stage: a live bar on a terminal, one plain line per tenth of the steps elsewhere (a
log file or CI, where a bar's carriage returns become one line of thousands of characters)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

log = logging.getLogger("headbudget.training")

LINES_PER_STAGE = 10


class Progress:
    """``update`` after each step with the figures to show; ``close`` at the end."""

    def __init__(self, total: int, name: str, stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        self.total, self.name, self.step = total, name, 0
        self._started = time.perf_counter()
        self._every = max(1, total // LINES_PER_STAGE)
        isatty = getattr(stream, "isatty", None)
        self._bar = tqdm(total=total, desc=f"{name:>6}", mininterval=2.0, dynamic_ncols=True, file=stream) \
            if isatty is not None and isatty() else None

    def update(self, **figures: Any) -> None:
        self.step += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(**figures, refresh=False)
        elif self.step % self._every == 0 or self.step == self.total:
            shown = ", ".join(f"{k} {v}" for k, v in figures.items())
            log.info("%s: step %d/%d, %s, %.0f s", self.name, self.step, self.total, shown,
                     time.perf_counter() - self._started)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
