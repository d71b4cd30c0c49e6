"""``headbudget bench``: engine latency per budget against the dense runtimes, written to bench.json; with
``--all-budgets``, every budget of the grid (and a few off it) against ORT dense, written to a budgets file."""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headbudget.commands.common import CliError, budget_arg, existing_dir, positive_int
from headbudget.engine.names import DEFAULT_PRECISION, PRECISION_NAMES

if TYPE_CHECKING:
    from headbudget.experiments.bench import BenchConfig


def register(subparsers: Any) -> None:
    # prog: a bad value reads "headbudget bench: error: ...", not the top-level usage line's words
    p = subparsers.add_parser("bench", prog="headbudget bench",
                              help="benchmark the head-skipping engine against dense runtimes")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=existing_dir, help="checkpoint folder")
    src.add_argument("--base", choices=["minilm"], help="pretrained MiniLM with random gates (timing only)")
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--data", type=existing_dir, help="folder with test.csv/train.csv: sample real text lengths")
    p.add_argument("--precision", choices=PRECISION_NAMES, default=DEFAULT_PRECISION,
                   help=f"the engine to time, against ONNX Runtime's dense export of the same precision (default "
                        f"{DEFAULT_PRECISION}, as serve)")
    p.add_argument("--repeats", type=positive_int, default=30)
    p.add_argument("--no-memory", action="store_true", help="skip the resident-memory comparison")
    p.add_argument("--memory-probes", type=positive_int, default=3,
                   help="fresh processes per memory figure, the median kept (default 3)")
    p.add_argument("--cache", choices=["cold", "warm", "steady"], default="cold",
                   help="what runs before each timed call: every other method (cold: budgets switching call by "
                        "call), one untimed call of the same method (warm), or a run of them (steady: one "
                        "budget's calls back to back)")
    p.add_argument("--warm-cache", action="store_true", help=argparse.SUPPRESS)  # the former name of --cache warm
    p.add_argument("--all-budgets", action="store_true",
                   help="time every budget of the 0.05 grid and the off-grid budgets round-robin against ORT's "
                        "dense export of --precision, and write one file of them (e.g. --out int8-budgets.json; "
                        "pareto.png's latency panel draws it)")
    p.add_argument("--off-grid-budgets", type=budget_arg, nargs="+", metavar="B",
                   help="with --all-budgets: budgets off the grid to time as well (default 0.37 0.62 0.88)")
    p.add_argument("--out", type=Path, required=True,
                   help="where to write bench.json (with --all-budgets: the budgets file)")
    p.set_defaults(func=run)


def _minilm_checkpoint(folder: Path) -> Path:
    """MiniLM encoder, fresh classifier, gates spread at random (seeded) so budgets keep uneven layers."""
    import torch

    from headbudget.models.checkpoint import save_checkpoint
    from headbudget.models.config import GateConfig
    from headbudget.models.pretrained import from_pretrained, minilm_path
    from headbudget.models.tokenizer import copy_tokenizer

    model = from_pretrained(minilm_path(), ("World", "Sports", "Business", "Sci/Tech"), GateConfig()).model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.gates.logit.copy_(torch.randn(model.gates.logit.shape, generator=g) * 2.0)
        model.gates.raw_beta.copy_(torch.randn(model.gates.raw_beta.shape, generator=g))
    save_checkpoint(model.eval(), folder, {"name": "minilm-random-gates"})
    copy_tokenizer(minilm_path(), folder)
    return folder


def _table(r: dict[str, Any]) -> str:
    lines = [f"cpu: {r['cpu']}  precision: {r['precision']}  seq_len: {r['seq_len']} (median tokens "
             f"{r['median_tokens']})  batch: {r['batch_size']}  threads: {r['threads']}  cache: {r['cache']}",
             f"{'budget':>7} {'heads':>6} {'ms':>8} {'p90':>8} {'vs b=1':>7} {'95% interval':>13} {'vs ORT':>7} "
             f"{'FLOP bound':>10}"]
    for row in r["rows"]:
        lo, hi = row["speedup_vs_b1_ci95"]
        lines.append(f"{row['budget']:>7.2f} {row['heads_active']:>6} {row['latency_ms']:>8.2f} {row['p90_ms']:>8.2f} "
                     f"{row['speedup_vs_b1']:>7.2f} {f'{lo:.2f}-{hi:.2f}':>13} {row['speedup_vs_ort_dense']:>7.2f} "
                     f"{row['flop_bound_speedup']:>10.2f}")
    lines.append("peers: " + "  ".join(f"{k} {v:.2f}" for k, v in r["peers"].items()))
    lines.append(f"max |engine - reference| logit: {r['max_abs_logit_diff']:.2e}   rss: {r['rss_mb']} MB")
    lines.append(f"fixed per-call overhead vs ORT dense (2 tokens, paired): {r['overhead_ms']:.3f} ms;  "
                 + json.dumps(r["overhead"]))
    if "memory" in r:
        lines.append("memory (MB over imports): " + json.dumps(r["memory"]))
    return "\n".join(lines)


def _budgets_table(r: dict[str, Any]) -> str:
    lines = [f"cpu: {r['cpu']}  precision: {r['precision']}  seq_len: {r['seq_len']} (median tokens "
             f"{r['median_tokens']})  threads: {r['threads']}  cache: {r['cache']}  repeats: {r['repeats']}",
             f"{'budget':>7} {'heads':>6} {'layers':>6} {'ms':>8} {'p90':>8} {'of b=1':>7} {'95% interval':>13} "
             f"{'of ORT':>7} {'MACs':>6} {'rule':>5} {'mono':>5}"]
    flags = {c["budget"]: c for c in r["checks"]["rows"]}
    for row in r["rows"]:
        lo, hi = row["share_of_b1_ci95"]
        c = flags[row["budget"]]
        lines.append(f"{row['budget']:>7.2f} {row['heads_active']:>6} {row['layers_run']:>6} "
                     f"{row['latency_ms']:>8.2f} {row['p90_ms']:>8.2f} {row['share_of_b1']:>7.3f} "
                     f"{f'{lo:.3f}-{hi:.3f}':>13} {row['share_of_ort_dense']:>7.3f} {row['mac_fraction']:>6.3f} "
                     f"{'ok' if c['within_rule'] else 'FAIL':>5} {'ok' if c['monotone'] else 'FAIL':>5}")
    lines.append("peers: " + "  ".join(f"{k} {v:.2f}" for k, v in r["peers"].items()))
    fl = r["floor"]
    lines.append(f"floor (one head, one neuron group a layer): {fl['latency_ms']:.2f} ms, {fl['share_of_b1']:.3f} of b=1 "
                 f"at {fl['mac_fraction']:.3f} of its MACs")
    checks = r["checks"]
    failing = ", ".join(f"{b:g}" for b in checks["failing_budgets"]) or "none"
    lines.append(f"checks: {checks['rule']}: {'all' if checks['all_within_rule'] else 'not all'};  "
                 f"monotone: {'all' if checks['all_monotone'] else 'not all'};  failing budgets: {failing}")
    return "\n".join(lines)


def _command_line(args: argparse.Namespace) -> str:
    """The command with every option it ran with spelled out (defaults too), so it reruns the same benchmark."""
    words = ["headbudget", "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command", "warm_cache") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list | tuple):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _bench_config(args: argparse.Namespace, model_dir: Path) -> BenchConfig:
    """The flags as the benchmark's configuration (both modes)."""
    from headbudget.experiments.bench import BenchConfig

    return BenchConfig(model_dir=model_dir, seq_len=args.seq_len, batch_size=args.batch_size, data=args.data,
                       precision=args.precision, repeats=args.repeats,
                       memory_probes=0 if args.no_memory else args.memory_probes, cache=args.cache)


def _run_all_budgets(args: argparse.Namespace) -> int:
    from headbudget.experiments.budget_bench import OFF_GRID_BUDGETS, BudgetBenchConfig, run_budget_bench

    off_grid = tuple(args.off_grid_budgets) if args.off_grid_budgets is not None else OFF_GRID_BUDGETS
    with tempfile.TemporaryDirectory(prefix="headbudget-base-") as tmp:
        model_dir = args.model or _minilm_checkpoint(Path(tmp) / "minilm")
        result = run_budget_bench(BudgetBenchConfig(bench=_bench_config(args, model_dir), off_grid=off_grid))
    result["command"] = _command_line(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(_budgets_table(result))
    if "memory" in result:
        print("memory (MB over imports): " + json.dumps(result["memory"]))
    return 0


def run(args: argparse.Namespace) -> int:
    from headbudget.experiments.bench import run_bench

    if args.out.is_dir():
        raise CliError(f"--out {args.out} is a folder; give a file name such as bench.json")
    if args.warm_cache:
        args.cache, args.warm_cache = "warm", False
    if args.all_budgets:
        return _run_all_budgets(args)
    if args.off_grid_budgets is not None:
        raise CliError("--off-grid-budgets needs --all-budgets")
    with tempfile.TemporaryDirectory(prefix="headbudget-base-") as tmp:
        model_dir = args.model or _minilm_checkpoint(Path(tmp) / "minilm")
        result = run_bench(_bench_config(args, model_dir))
    result["command"] = "headbudget bench " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("func", "command") and v not in (None, False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))
    return 0
