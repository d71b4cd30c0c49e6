"""Real processes for end-to-end ops tests: the service (`headbudget serve`), redis-server and Prometheus.

Every process is started on a free loopback port with its output in a log file, and stopped (SIGTERM, then
SIGKILL) by the fixture or context manager that started it. Fixtures skip with a reason when `headbudget
serve` or a binary is missing. `live_service` is session-scoped and shared by tests/ops and tests/loadtest
(their conftest.py files import it), so the suite starts one server for both.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
KEYS = {  # test-only keys; the config below stores their SHA-256
    "cheap": "hb-test-cheap-7d1f0c2a9e",
    "balanced": "hb-test-balanced-41b8e6d3c0",
    "quality": "hb-test-quality-9a25f7e1b4",
}


def serve_missing_reason() -> str | None:
    """Why the real service cannot be started yet, or None."""
    if importlib.util.find_spec("headbudget.commands.serve") is None:
        return "`headbudget serve` does not exist yet (headbudget/commands/serve.py)"
    return None


def free_port() -> int:
    """A TCP port nobody listens on right now, on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> tuple[int, Any]:
    """One request to a loopback URL; (status, parsed JSON body or text)."""
    assert url.startswith(f"http://{HOST}:"), f"tests only talk to loopback, not {url}"
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until(check: Any, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None,
               log: Path | None = None) -> Any:
    """Poll ``check()`` until it returns a truthy value; fail with the process log if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}\n{_tail(log)}")
        with contextlib.suppress(OSError):
            value = check()
            if value:
                return value
        time.sleep(0.25)
    pytest.fail(f"{what}: not done after {timeout_s:.0f} s\n{_tail(log)}")


def _tail(log: Path | None, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log and log.is_file() else ""


@contextlib.contextmanager
def running(cmd: list[str], log: Path, env: dict[str, str] | None = None,
            stop_timeout_s: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` in its own process group for the duration of the block; stop it and its children after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            yield proc
        finally:
            stop(proc, stop_timeout_s)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent
    if proc.poll() is None:
        proc.wait(10)


def prometheus_exe() -> str:
    """The Prometheus binary, or a skip with the reason."""
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed (Debian package prometheus; `make system-deps`)")
    return exe


@contextlib.contextmanager
def running_prometheus(config: Path, folder: Path, port: int) -> Iterator[str]:
    """Prometheus with ``config`` and its data under ``folder``, on ``port`` of loopback, until it answers ready
    (its log in ``folder``); yields its URL."""
    cmd = [prometheus_exe(), f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
           f"--web.listen-address={HOST}:{port}", "--log.level=warn"]
    url, log = f"http://{HOST}:{port}", folder / "prometheus.log"
    with running(cmd, log) as proc:
        wait_until(lambda: http("GET", f"{url}/-/ready", timeout=2)[0] == 200, 60, "prometheus", proc, log)
        yield url


def service_toml(redis_url: str = "") -> str:
    """A configuration with the three tiers, the test keys, and limits high enough for a load test."""
    lines = ["[server]", "max_batch_size = 32", "max_wait_ms = 3.0", "queue_size = 512", "",
             "[state]", f'redis_url = "{redis_url}"', 'on_error = "open"', "accuracy_window = 200", ""]
    tiers = {"cheap": (0.3, 0.5, 0, "latency_target_ms = 200.0\nmin_budget = 0.1"),
             "balanced": (0.6, 0.8, 1, "latency_target_ms = 400.0\nmin_budget = 0.3"),
             "quality": (1.0, 1.0, 2, "")}
    for name, (default, top, prio, extra) in tiers.items():
        lines += [f"[tiers.{name}]", f"default_budget = {default}", f"max_budget = {top}",
                  "rate_limit = 600000.0", "burst = 1000", f"priority = {prio}", "max_queue = 256", extra, ""]
    for tier, key in KEYS.items():
        lines += ["[[keys]]", f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"', f'tier = "{tier}"',
                  f'name = "test-{tier}"', ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class LiveService:
    """A running `headbudget serve`."""

    url: str
    port: int
    workers: int
    redis_url: str
    model_dir: Path
    log: Path


def serve_command(model: Path, config: Path, port: int, workers: int) -> list[str]:
    """`headbudget serve` as an operator runs it."""
    return [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(model), "--config", str(config),
            "--host", HOST, "--port", str(port), "--workers", str(workers)]


def serve_env() -> dict[str, str]:
    """The service's environment: offline, one thread per worker, no inherited multiprocess folder."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """A throw-away redis-server on a free loopback port; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; `make system-deps`)")
    port = free_port()
    cmd = [exe, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp),
           "--protected-mode", "yes"]
    with running(cmd, tmp / "redis.log") as proc:
        wait_until(lambda: _redis_ping(port), 20, "redis-server", proc, tmp / "redis.log")
        yield f"redis://{HOST}:{port}/0"


def _redis_ping(port: int) -> bool:
    with socket.create_connection((HOST, port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


_SHARED: dict[str, LiveService] = {}  # one server per test session, whichever conftest asked first


@pytest.fixture(scope="session")
def live_service(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    """The real service on the tiny checkpoint: 2 workers sharing state in a real redis-server when one is
    installed (as in docker-compose.yml), else 1 worker with in-memory state.

    tests/ops and tests/loadtest each register this fixture from their conftest.py; the first to run starts
    the server and stops it at the end of the session, the other reuses it."""
    reason = serve_missing_reason()
    if reason:
        pytest.skip(reason)
    if "service" in _SHARED:
        yield _SHARED["service"]
        return
    with _start_service(tiny_checkpoint, tmp_path_factory.mktemp("live-service")) as service:
        _SHARED["service"] = service
        try:
            yield service
        finally:
            del _SHARED["service"]


@contextlib.contextmanager
def _start_service(tiny_checkpoint: Path, tmp: Path) -> Iterator[LiveService]:
    model = tmp / "model"
    shutil.copytree(tiny_checkpoint, model)
    write_sweep(model)
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(redis_server(tmp)) if shutil.which("redis-server") else ""
        workers = 2 if redis_url else 1
        config = tmp / "service.toml"
        config.write_text(service_toml(redis_url))
        port = free_port()
        log = tmp / "serve.log"
        cmd = serve_command(model, config, port, workers)
        proc = stack.enter_context(running(cmd, log, env=serve_env(), stop_timeout_s=40))
        url = f"http://{HOST}:{port}"
        wait_until(lambda: http("GET", f"{url}/readyz", timeout=2)[0] == 200, 240, "headbudget serve /readyz",
                   proc, log)
        yield LiveService(url=url, port=port, workers=workers, redis_url=redis_url, model_dir=model, log=log)


def write_sweep(model: Path) -> None:
    """A sweep.json for the copied checkpoint, so that the service publishes offline accuracy per budget.

    The tiny checkpoint has random weights: these accuracies are placeholders in the real file format
    (points with budget, heads and hard/soft accuracy), not measurements."""
    config = json.loads((model / "config.json").read_text())
    cfg = config.get("model", config)
    n_layers, n_heads = int(cfg.get("n_layers", 2)), int(cfg.get("n_heads", 4))
    total = n_layers * n_heads
    points = []
    for i in range(1, 20):
        b = round(0.05 * i + 0.05, 2)
        k = max(1, round(b * total))
        points.append({"budget": b, "heads_active": k, "heads_total": total, "hard_cost": k / total,
                       "soft_cost": k / total, "accuracy_soft": 0.5 + 0.4 * b, "accuracy_hard": 0.5 + 0.4 * b})
    sweep = {"dataset": "placeholder", "split": "test", "n_examples": 0, "dense_accuracy": 0.9,
             "ungated_accuracy": 0.9, "n_layers": n_layers, "n_heads": n_heads, "points": points}
    (model / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
