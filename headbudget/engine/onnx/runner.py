"""ONNX Runtime's per-call path behind one seam: the C-level session where this ORT has it, the public API else.

Why private attributes at all: ``InferenceSession.run`` and its ``run_with_ort_values`` check and convert every
feed in Python on every call, while the C-level session (``sess._sess``) takes C-level OrtValues
(``OrtValue._get_c_value()``) as they are. Both are private and may change in any ORT release, so they are used
only here, only when present, and ``PRIVATE = False`` (or an ORT without them) gives the same answers through
the public API (tests/engine/test_runner.py checks both paths agree).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort

PRIVATE = True  # use the C-level fast path where this ORT has it (set False to force the public API)


class Runner:
    """Runs one session with cached feeds: ``value`` makes an input, ``run`` returns the first output."""

    def __init__(self, session: ort.InferenceSession, outputs: list[str]) -> None:
        self.session = session
        self.outputs = outputs
        self.private = PRIVATE and hasattr(session, "_sess") and hasattr(ort.OrtValue, "_get_c_value")
        self._c_run = session._sess.run_with_ort_values if self.private else None

    def value(self, array: np.ndarray) -> Any:
        """A feed over ``array``'s memory, no copy (the caller keeps ``array`` alive while it is used)."""
        v = ort.OrtValue.ortvalue_from_numpy(array)
        return v._get_c_value() if self.private else v

    def run(self, feeds: dict[str, Any], run_options: ort.RunOptions | None = None) -> np.ndarray:
        """The first output for ``feeds`` (values made by ``value``)."""
        if self._c_run is not None:
            return self._c_run(feeds, self.outputs, run_options)[0].numpy()  # type: ignore[no-any-return]
        return self.session.run_with_ort_values(self.outputs, feeds, run_options)[0].numpy()  # type: ignore[no-any-return]
