"""The request parser fuzzed, coverage-guided (atheris), with FastAPI's validation as the oracle.

    python -m lab.hostile.fuzz --model CKPT [--seconds 600 | --runs 2000] [--corpus DIR] [--out fuzz.json]

One app over the checkpoint's engine, in process; each input is a request sent twice, through the fast path
(`service/http/fastpath.py`: its query and body parsing) and with the fast path off, so that FastAPI's routing and
validation take it. Both answers must be the same (status, error code and message, labels, scores, budgets,
charges; ids and timings aside): a fast path that accepts what FastAPI would refuse, or parses it otherwise, is
a mismatch. TEI's `/predict` (its body parsing is FastAPI's, its text extraction ours) has an invariant oracle:
a 4xx with TEI's error shape or a 200 with one answer per input, never a 5xx. Coverage is of
`headbudget.service` (atheris instruments it on import). The seed corpus holds real requests and every body the
hand-written probes send (`SEEDS`).

An input's bytes: the first picks the route, the content type and the key; the second is the query string's
length; then the query string, then the body (``encode`` writes one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headbudget.commands.parser import OneLineParser

ROOT = Path(__file__).resolve().parents[2]
CONTENT_TYPES = (b"application/json", b"application/json; charset=utf-8", b"Application/JSON", b"text/plain",
                 b"application/x-www-form-urlencoded", b"")
TIERS = ("cheap", "balanced", "quality")  # fixed budgets only: a latency target chooses by the clock
UNKNOWN_KEY = "hb_not_a_key_00000000000000000000000"
ROUTES = ("/classify", "/predict")
# Fields that differ between any two answers to the same request.
_TIMING = re.compile(r"(latency|queue)_ms$|^request_id$")


class Mismatch(AssertionError):
    """The fast path answered otherwise than FastAPI's route."""


class ServerError(AssertionError):
    """A 5xx, or an answer without the JSON error shape."""


def encode(route: str, content_type: int, key: int, query: bytes, body: bytes) -> bytes:
    """One fuzz input: ``key`` indexes TIERS, then the unknown key, then no key."""
    return bytes([(ROUTES.index(route) << 6) | (key % 5) << 3 | content_type % len(CONTENT_TYPES),
                  len(query[:255])]) + query[:255] + body


def decode(data: bytes) -> tuple[str, bytes, str | None, bytes, bytes]:
    """(route, content type, key tier or unknown key or None, query string, body)."""
    first = data[0] if data else 0
    n = data[1] if len(data) > 1 else 0
    query, body = data[2:2 + n], data[2 + n:]
    k = (first >> 3) & 7
    key = TIERS[k] if k < len(TIERS) else UNKNOWN_KEY if k == len(TIERS) else None
    return ROUTES[(first >> 6) & 1], CONTENT_TYPES[(first & 7) % len(CONTENT_TYPES)], key, query, body


def _hostile_bodies() -> list[bytes]:
    """The bodies tests/service/test_hostile.py and test_api.py send by hand (where they can be imported)."""
    bodies: list[bytes] = []
    with contextlib.suppress(ImportError):
        from tests.service.test_api import BAD_BODIES
        from tests.service.test_hostile import HOSTILE
        bodies += [b for b, _, _ in HOSTILE.values() if len(b) < 200_000]
        bodies += [b for b, _, _ in BAD_BODIES]
    return bodies


SEEDS: list[tuple[str, bytes, bytes]] = [
    ("/classify", b"", b'{"text": "Stocks rallied after the central bank held rates."}'),
    ("/classify", b"budget=0.5", b'{"text": "The striker scored twice."}'),
    ("/classify", b"budget=0.9", b'{"text": "Above the cheap tier maximum."}'),
    ("/classify", b"budget=0.25&max_latency_ms=5", b'{"texts": ["a", "b b"]}'),
    ("/classify", b"", b'{"texts": ["one", "two two"], "budget": 0.1}'),
    ("/classify", b"budget=auto&max_budget=0.5", b'{"text": "x"}'),
    ("/classify", b"max_latency_ms=20", b'{"text": "x", "budget": 0.3}'),
    ("/classify", b"budget=%ff", b'{"text": "x"}'),
    ("/classify", b"budget=0.5&budget=0.5", b'{"text": "x"}'),
    ("/classify", b"", b'{"text": "x", "text": "y"}'),
    ("/predict", b"", b'{"inputs": "Stocks rallied"}'),
    ("/predict", b"", b'{"inputs": ["a", "b"], "raw_scores": true}'),
    ("/predict", b"budget=0.5", b'{"inputs": [["a"]], "truncate": true, "truncation_direction": "Left"}'),
]


def seed_corpus(folder: Path) -> int:
    """Write the seeds (each with every key and the JSON content type) into ``folder``; their count."""
    folder.mkdir(parents=True, exist_ok=True)
    inputs = [encode(r, 0, k, q, b) for r, q, b in SEEDS for k in range(5)]
    inputs += [encode(r, 0, 1, b"", b) for b in _hostile_bodies() for r in ROUTES]
    for i, data in enumerate(inputs):
        (folder / f"seed-{i:04d}").write_bytes(data)
    return len(inputs)


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if not _TIMING.search(k)}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _comparable(answer: tuple[int, Any]) -> tuple[int, Any]:
    """An answer less what the clock decides: a latency target's budget comes from the engine's timings so far, so
    of such an answer only its shape is compared (how many results, and everything outside them)."""
    status, payload = answer
    if status == 200 and isinstance(payload, dict) and payload.get("budget_source") == "max_latency_ms":
        return status, {**{k: v for k, v in payload.items() if k not in ("results", "charge")},
                        "results": len(payload["results"])}
    return answer


class Harness:
    """The app with its lifespan running on a loop of its own; ``answer`` sends one request through it."""

    def __init__(self, model: Path) -> None:
        from headbudget.engine.factory import load_engine
        from headbudget.engine.types import EngineOptions
        from headbudget.service.accounting.auth import hash_key
        from headbudget.service.app import create_app
        from headbudget.service.settings import parse_config

        self.keys = {t: f"hb_fuzz_{t}_key_{'0' * (28 - len(t))}" for t in TIERS}
        tiers = {"cheap": (0.25, 0.5), "balanced": (0.5, 1.0), "quality": (1.0, 1.0)}
        # limits far above what a run sends: the two passes of an input must meet the same limits
        config = {"server": {"max_wait_ms": 0.5},
                  "tiers": {t: {"default_budget": d, "max_budget": m, "rate_limit": 10 ** 9, "burst": 10 ** 9}
                            for t, (d, m) in tiers.items()},
                  "keys": [{"sha256": hash_key(k), "tier": t, "name": f"fuzz-{t}"} for t, k in self.keys.items()]}
        self.on = parse_config(config)
        self.off = self.on.model_copy(update={"server": self.on.server.model_copy(update={"fast_path": False})})
        engine = load_engine(model, EngineOptions(precision="int8"))
        self.app = create_app(self.on, lambda: engine)
        self.runtime = self.app.state.runtime
        self.loop = asyncio.new_event_loop()
        self._life = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self._life.__aenter__())

    def close(self) -> None:
        self.loop.run_until_complete(self._life.__aexit__(None, None, None))
        self.loop.close()

    async def _call(self, route: str, content_type: bytes, key: str | None, query: bytes,
                    body: bytes) -> tuple[int, dict[str, str], bytes]:
        headers = [(b"host", b"fuzz"), (b"content-length", str(len(body)).encode())]
        headers += [(b"content-type", content_type)] if content_type else []
        if key is not None:
            headers.append((b"x-api-key", self.keys.get(key, key).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 80)}
        done = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        status, out_headers, chunks = 0, {}, []

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                out_headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        await self.app(scope, receive, send)
        return status, out_headers, b"".join(chunks)

    def answer(self, route: str, content_type: bytes, key: str | None, query: bytes, body: bytes,
               fast_path: bool) -> tuple[int, Any]:
        self.runtime.config = self.on if fast_path else self.off
        status, headers, raw = self.loop.run_until_complete(self._call(route, content_type, key, query, body))
        if status >= 500:
            raise ServerError(f"{status} from {route}?{query!r} with {body[:200]!r}: {raw[:300]!r}")
        try:
            payload = json.loads(raw) if raw else None
        except ValueError as e:
            raise ServerError(f"{status}: not JSON: {raw[:200]!r}") from e
        return status, _scrub(payload)


def one_input(harness: Harness) -> Callable[[bytes], None]:
    """atheris's TestOneInput over ``harness``."""

    def test(data: bytes) -> None:
        route, content_type, key, query, body = decode(data)
        fast = harness.answer(route, content_type, key, query, body, fast_path=True)
        if route == "/classify":
            slow = harness.answer(route, content_type, key, query, body, fast_path=False)
            if _comparable(fast) != _comparable(slow):
                raise Mismatch(f"{route}?{query!r} {content_type!r} key={key} body={body[:300]!r}:\n"
                               f"fast path {fast!r:.600}\nFastAPI   {slow!r:.600}")
            status, payload = fast
            if status >= 400:
                assert set(payload) == {"error"} and set(payload["error"]) == {"code", "message"}, payload
            return
        status, payload = fast
        if status == 200:  # TEI's shapes: "a" or ["a"] one input, its labels' scores; [["a"], ["b"]] a batch, a
            # list of those; with `parameters` (the Inference API's convention) a single input is a batch of one
            request = json.loads(body)
            texts = request["inputs"]
            batch = isinstance(texts, list) and all(isinstance(row, list) for row in texts)
            answers = payload if batch or request.get("parameters") is not None else [payload]
            assert len(answers) == (len(texts) if batch else 1), payload
            assert all(isinstance(a, list) and all(set(s) == {"label", "score"} for s in a) for a in answers)
        else:
            assert isinstance(payload, dict) and set(payload) >= {"error", "error_type"}, payload

    return test


def run_atheris(model: Path, corpus: Path, *, seconds: int | None, runs: int | None) -> None:
    """The fuzzing process itself (atheris takes over the process and exits at the end)."""
    import atheris

    with atheris.instrument_imports(include=["headbudget.service"]):
        import headbudget.service.app  # noqa: F401
        import headbudget.service.http.fastpath  # noqa: F401
        import headbudget.service.http.routes.tei  # noqa: F401
    harness = Harness(model)
    args = [sys.argv[0], str(corpus), "-timeout=20", "-rss_limit_mb=4096", "-max_len=4096",
            f"-artifact_prefix={corpus.parent}/", "-print_final_stats=1"]
    args += [f"-max_total_time={seconds}"] if seconds else []
    args += [f"-runs={runs}"] if runs else []
    atheris.Setup(args, one_input(harness))
    atheris.Fuzz()


FINAL = re.compile(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+)")
STATS = re.compile(r"stat::number_executed_units:\s*(\d+)")


def fuzz(model: Path, work: Path, *, seconds: int | None = None, runs: int | None = None) -> dict[str, Any]:
    """Run the fuzzer in a process of its own; its executions, coverage, crashes and mismatches."""
    corpus = work / "corpus"
    seeds = seed_corpus(corpus)
    cmd = [sys.executable, "-m", "lab.hostile.fuzz", "--model", str(model), "--corpus", str(corpus), "--atheris"]
    cmd += ["--seconds", str(seconds)] if seconds else []
    cmd += ["--runs", str(runs)] if runs else []
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=(seconds or 0) + 600 if seconds else 3600)
    took = time.monotonic() - start
    log = proc.stdout + proc.stderr
    (work / "fuzz.log").write_text(log)
    done = FINAL.findall(log)
    executed = STATS.findall(log)
    return {"target": "service.fastpath._parse + FastAPI's /classify validation (differential); TEI /predict",
            "executions": int(executed[-1]) if executed else int(done[-1][0]) if done else 0,
            "seconds": round(took, 1), "seeds": seeds,
            "crashes": int("Uncaught Python exception" in log and "Mismatch" not in log),
            "mismatches": int("Mismatch" in log),
            "coverage": int(done[-1][1]) if done else None, "features": int(done[-1][2]) if done else None,
            "exit_code": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m lab.hostile.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--seconds", type=int, help="fuzz this long")
    p.add_argument("--runs", type=int, help="or this many inputs")
    p.add_argument("--corpus", type=Path, help="corpus folder (--atheris) or work folder")
    p.add_argument("--out", type=Path, help="write the counts here as JSON")
    p.add_argument("--atheris", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.atheris:
        run_atheris(args.model, args.corpus, seconds=args.seconds, runs=args.runs)
        return 0
    work = args.corpus or Path("runs/fuzz")
    result = fuzz(args.model, work, seconds=args.seconds, runs=args.runs)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if not (result["crashes"] or result["mismatches"]) and result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
