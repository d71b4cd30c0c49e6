"""The exported ONNX file against the engine, side by side in one process:
`python -m headbudget.loadtest.export_bench --model DIR --budget 0.5 --out FILE`.

Exports the budget (fp32 and int8) into a temporary folder, then times, interleaved round by round on the same
inputs (batch 1, one intra-op thread): the engine's forward pass (``forward_ids``: its one all-budget session,
feeds cached) and a plain ``onnxruntime.InferenceSession`` on the exported file called as a user would
(``session.run`` with numpy feeds). Inputs: AG News test texts at their own lengths, and length 128.
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from headbudget.commands.parser import OneLineParser
from headbudget.engine.base import pad
from headbudget.engine.factory import load_engine
from headbudget.engine.names import PRECISION_NAMES
from headbudget.engine.onnx.export import MODEL_FILE, export_onnx
from headbudget.engine.types import EngineOptions
from headbudget.experiments.bench import cpu_name
from headbudget.loadtest.service_bench import load_texts


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def compare(model: Path, budget: float, precision: str, inputs: list[tuple[np.ndarray, np.ndarray]],
            rounds: int) -> dict[str, Any]:
    """Median ms per input of the engine and of the exported file, interleaved per round; max |logit diff|."""
    engine = load_engine(model, EngineOptions(precision=precision))  # type: ignore[arg-type]
    engine.warmup()
    with tempfile.TemporaryDirectory() as tmp:
        rec = export_onnx(model, budget, Path(tmp) / "export", precision)  # type: ignore[arg-type]
        sess = _session(Path(tmp) / "export" / MODEL_FILE)
        feeds = [{"input_ids": ids, "attention_mask": mask} for ids, mask in inputs]
        plan = engine.plan(budget)
        diff = max(float(np.abs(engine.forward_ids(ids, mask, plan) - sess.run(["logits"], f)[0]).max())
                   for (ids, mask), f in zip(inputs, feeds, strict=True))
        engine_ms: list[float] = []
        export_ms: list[float] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for ids, mask in inputs:
                engine.forward_ids(ids, mask, plan)
            t1 = time.perf_counter()
            for f in feeds:
                sess.run(["logits"], f)
            t2 = time.perf_counter()
            engine_ms.append((t1 - t0) * 1e3 / len(inputs))
            export_ms.append((t2 - t1) * 1e3 / len(inputs))
    engine.close()
    e, x = statistics.median(engine_ms), statistics.median(export_ms)
    return {"precision": precision, "heads_kept": rec.heads_kept, "heads_total": rec.heads_total,
            "file_mb": round(rec.size_bytes / 1e6, 1), "engine_ms": round(e, 3), "export_ms": round(x, 3),
            "export_over_engine": round(x / e, 3), "max_abs_logit_diff": diff}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, default=Path("../shared/data/ag_news"))
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--texts", type=int, default=50)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    probe = load_engine(args.model, EngineOptions())
    enc = probe.encoder.encode(load_texts(args.data, args.texts))
    probe.close()
    real = [pad([ids], 0) for ids in enc.ids]
    fixed = [(np.full((1, 128), 1000, np.int64), np.ones((1, 128), np.int32))]
    rows = []
    for precision in PRECISION_NAMES:
        for name, inputs in (("ag_news texts", real), ("length 128", fixed)):
            row = {"inputs": name, "budget": args.budget, **compare(args.model, args.budget, precision, inputs,
                                                                     args.rounds)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = {"model": str(args.model), "cpu": cpu_name(), "date": datetime.date.today().isoformat(),
           "median_tokens": int(np.median([len(x) for x in enc.ids])), "batch_size": 1, "threads": 1, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
