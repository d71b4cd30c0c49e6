"""How long is a revoked key still answered after the reload? `python -m lab.revocation_lag --model CKPT --out F`.

A real `headbudget serve` with two workers; four keep-alive connections send one short text after another with one
key. The key is marked ``revoked = true`` in the config file, SIGHUP goes to the supervisor, and the lag is the time
from the signal to the sending of the last request still answered 200 (``answered_after``: how many such answers
came after the signal). Repeated ``--rounds`` times, the key restored and reloaded in between.

    python -m lab.revocation_lag --model checkpoints/ag_news-quick --out revocation.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.fairness import to_toml
from headbudget.loadtest.service_bench import Server
from headbudget.service.auth import hash_key, new_key
from lab.script_output import check_out, write_doc

CONNECTIONS = 4


def config(key: str, revoked: bool) -> str:
    entry: dict[str, Any] = {"sha256": hash_key(key), "tier": "t", "name": "victim"}
    if revoked:
        entry["revoked"] = True
    return to_toml({"server": {"max_wait_ms": 1},
                    "tiers": {"t": {"default_budget": 0.1, "max_budget": 1.0, "rate_limit": 10_000_000,
                                    "burst": 1_000_000, "priority": 0}},
                    "keys": [entry]})


def one_round(srv: Server, cfg: Path, key: str, after_s: float) -> dict[str, Any]:
    stop = threading.Event()
    sent: list[tuple[float, int]] = []  # (monotonic send time, status)

    def client() -> None:
        with httpx.Client(base_url=srv.url, timeout=30, headers={"X-API-Key": key}) as c:
            while not stop.is_set():
                t = time.monotonic()
                status = c.post("/classify", json={"text": "oil prices rose"}).status_code
                sent.append((t, status))

    threads = [threading.Thread(target=client) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    cfg.write_text(config(key, revoked=True))
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGHUP)
    time.sleep(after_s)
    stop.set()
    for t in threads:
        t.join()
    late = [t for t, status in sent if status == 200 and t > t0]
    refused = [t for t, status in sent if status == 401 and t > t0]
    return {"lag_ms": round((max(late) - t0) * 1000, 1) if late else 0.0, "answered_after": len(late),
            "refused_after": len(refused), "before": sum(1 for t, s in sent if t <= t0 and s == 200)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.revocation_lag", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--after-s", type=float, default=2.0, help="how long the clients go on after the signal")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    check_out(args.out)
    key = new_key()
    with Server(args.model, 2, config_text=config(key, revoked=False), precision="int8") as srv:
        cfg = Path(srv.dir.name) / "bench.toml"
        rounds = []
        for _ in range(args.rounds):
            cfg.write_text(config(key, revoked=False))
            os.kill(srv.proc.pid, signal.SIGHUP)
            time.sleep(1.5)
            rounds.append(one_round(srv, cfg, key, args.after_s))
            print(rounds[-1], flush=True)
    write_doc({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "workers": 2,
               "connections": CONNECTIONS, "rounds": rounds}, args.out, "revocation_lag", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
