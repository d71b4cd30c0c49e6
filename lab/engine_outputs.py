"""The engine's outputs (labels, logits, token counts, costs, heads) at the 19 grid budgets and two off-grid ones,
fp32 and int8, for checking that a change of code changes no answer.

Write one file per code version (a git worktree of the older commit first on PYTHONPATH), then compare:
  PYTHONPATH=../old-worktree python -m lab.engine_outputs CKPT before.json
  python -m lab.engine_outputs CKPT after.json
  python -m lab.engine_outputs --compare before.json after.json     # exit 1 unless every output is equal
"""
import json
import sys
from pathlib import Path

if sys.argv[1] == "--compare":
    a, b = (json.load(open(p)) for p in sys.argv[2:4])
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    bad = [k for k in a if a[k] != b[k]]
    print(f"{len(a) - len(bad)}/{len(a)} identical" + (f"; differ: {bad[:10]}" if bad else ""))
    sys.exit(1 if bad else 0)

import tempfile

import headbudget
from headbudget.engine.factory import load_engine
from headbudget.engine.names import PRECISION_NAMES
from headbudget.engine.types import EngineOptions

print("code:", Path(headbudget.__file__).parent, file=sys.stderr)
ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
texts = ["Stocks fell sharply on Wall Street as oil prices rose.",
         "The team won the championship after a dramatic overtime goal.",
         "A new chip promises faster machine learning on phones.",
         "Leaders met in Geneva to discuss the ceasefire.",
         "short", "x " * 200]
budgets = [round(0.1 + 0.05 * i, 2) for i in range(19)] + [0.37, 0.62]
res = {}
for precision in PRECISION_NAMES:
    with tempfile.TemporaryDirectory() as cache:
        eng = load_engine(ckpt, EngineOptions(precision=precision, cache_dir=Path(cache)))
        for b in budgets:
            for batch in (texts, texts[:1]):
                r = eng.predict(batch, b)
                res[f"{precision}/{b}/{len(batch)}"] = {
                    "budget": r.budget, "heads": [r.heads_active, r.heads_total],
                    "preds": [{"label": p.label, "logits": p.logits, "n": p.n_tokens, "trunc": p.truncated,
                               "cost": repr(p.cost)} for p in r.predictions]}
        eng.close()
out.write_text(json.dumps(res))
print("wrote", out, len(res), file=sys.stderr)
