"""How long is a revoked key still answered after the reload? `python -m lab.revocation_lag --model CKPT --out F`.

A real `headbudget serve` with two workers; four keep-alive connections send one short text after another with one
key. The key is marked ``revoked = true`` in the config file, SIGHUP goes to the supervisor, and the lag is the time
from the signal to the sending of the last request still answered 200 (``answered_after``: how many such answers
came after the signal). Repeated ``--rounds`` times, the key restored and reloaded in between.

``--replicas``: two servers of two workers each share a local redis-server; two connections per server send with
one key, which is revoked through the state store (the call `headbudget keys revoke` makes; no signal, no file
changed), and the lag is counted per server from the moment that call began. A fresh key per round: a revocation
in the store is final.

    python -m lab.revocation_lag --model checkpoints/ag_news-quick --out revocation.json
    python -m lab.revocation_lag --model checkpoints/ag_news-quick --replicas --out revocation-replicas.json
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from headbudget.commands.parser import OneLineParser
from headbudget.experiments.bench import code_commit, cpu_name
from headbudget.loadtest.fairness import local_redis, to_toml
from headbudget.loadtest.service_bench import Server
from headbudget.service.accounting.auth import hash_key, new_key
from headbudget.service.settings import StateConfig
from headbudget.service.state.redis_store import RedisState
from lab.script_output import check_out, write_doc

CONNECTIONS = 4


def config(key: str, revoked: bool, more_keys: tuple[str, ...] = (), redis_url: str | None = None) -> str:
    entry: dict[str, Any] = {"sha256": hash_key(key), "tier": "t", "name": "victim"}
    if revoked:
        entry["revoked"] = True
    doc: dict[str, Any] = {
        "server": {"max_wait_ms": 1},
        "tiers": {"t": {"default_budget": 0.1, "max_budget": 1.0, "rate_limit": 10_000_000, "burst": 1_000_000,
                        "priority": 0}},
        "keys": [entry, *({"sha256": hash_key(k), "tier": "t", "name": f"victim-{i}"} for i, k in enumerate(more_keys))]}
    if redis_url:
        doc["state"] = {"redis_url": redis_url}
    return to_toml(doc)


def store_round(servers: list[Server], redis_url: str, key: str, after_s: float) -> dict[str, Any]:
    """Two connections per server send with ``key``; it is revoked in the store; the lag per server."""
    stop = threading.Event()
    sent: dict[int, list[tuple[float, int]]] = {i: [] for i in range(len(servers))}

    def client(i: int) -> None:
        with httpx.Client(base_url=servers[i].url, timeout=30, headers={"X-API-Key": key}) as c:
            while not stop.is_set():
                t = time.monotonic()
                sent[i].append((t, c.post("/classify", json={"text": "oil prices rose"}).status_code))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(servers)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    asyncio.run(_revoke(redis_url, hash_key(key)))
    written_ms = (time.monotonic() - t0) * 1000
    time.sleep(after_s)
    stop.set()
    for t in threads:
        t.join()
    rows = []
    for i, log in sent.items():
        late = [t for t, status in log if status == 200 and t > t0]
        rows.append({"server": i, "lag_ms": round((max(late) - t0) * 1000, 1) if late else 0.0,
                     "answered_after": len(late), "refused_after": sum(1 for t, s in log if s == 401 and t > t0),
                     "before": sum(1 for t, s in log if t <= t0 and s == 200)})
    return {"store_write_ms": round(written_ms, 1), "servers": rows}


async def _revoke(redis_url: str, digest: str) -> None:
    store = RedisState(StateConfig(redis_url=redis_url))
    try:
        await store.revoke({digest: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    finally:
        await store.close()


def replicas(model: Path, rounds: int, after_s: float) -> list[dict[str, Any]]:
    keys = tuple(new_key() for _ in range(rounds))
    out = []
    with local_redis(True) as redis_url:
        if redis_url is None:
            raise SystemExit("revocation_lag: --replicas needs redis-server")
        text = config(new_key(), False, keys, redis_url)
        with Server(model, 2, config_text=text, precision="int8") as a, \
                Server(model, 2, config_text=text, precision="int8") as b:
            for key in keys:
                out.append(store_round([a, b], redis_url, key, after_s))
                print(out[-1], flush=True)
    return out


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
    p = OneLineParser(prog="python -m lab.revocation_lag", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--after-s", type=float, default=2.0, help="how long the clients go on after the signal")
    p.add_argument("--replicas", action="store_true", help="two servers sharing Redis, revoked through the store")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    check_out(args.out)
    if args.replicas:
        rounds = replicas(args.model, args.rounds, args.after_s)
        write_doc({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "servers": 2,
                   "workers": 2, "connections_per_server": 2, "rounds": rounds}, args.out, "revocation_lag", argv)
        return 0
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
