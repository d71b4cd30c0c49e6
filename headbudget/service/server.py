"""Running the app under uvicorn: one or several workers, shared metrics, SIGHUP reload, graceful shutdown."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from headbudget.service.accounting.auth import hash_key, new_key
from headbudget.service.logs import configure_logging
from headbudget.service.settings import SERVE_ENV, ServeSettings, ServiceConfig, load_config

log = logging.getLogger("headbudget.service")
APP = "headbudget.service.app:app_from_env"


class _Supervisor(Multiprocess):
    """uvicorn's worker supervisor, except that SIGHUP reloads the config in each worker instead of
    restarting them (no model reload, no dropped requests).

    The signal is passed on from its handler, at once: uvicorn's loop reads its signal queue only every 0.5 s, and
    a key revoked with a reload must be refused by every worker at once (docs/results.md, 'Revocation over two
    workers')."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
        super().__init__(config, sockets)
        signal.signal(signal.SIGHUP, self._pass_on_hup)

    def _pass_on_hup(self, sig: int, frame: object) -> None:
        for process in self.processes:
            if process.pid is not None:
                try:
                    os.kill(process.pid, signal.SIGHUP)
                except ProcessLookupError:
                    pass
        self.signal_queue.append(sig)  # logged from the loop (not from a signal handler: the logging lock)

    def handle_hup(self) -> None:
        log.info("SIGHUP: the config was reloaded in every worker")


def _curl_tier(config: ServiceConfig) -> str:
    if config.development.curl_tier:
        return config.development.curl_tier
    return "balanced" if "balanced" in config.tiers else sorted(config.tiers)[0]


def curl_command(host: str, port: int, key: str, budget: float | str) -> str:
    """A working curl command for /classify with ``key`` (``budget`` a number or "auto")."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    body = json.dumps({"text": "Stocks rallied after the central bank left interest rates unchanged."})
    query = budget if isinstance(budget, str) else f"{budget:g}"
    return (f"curl -s 'http://{shown}:{port}/classify?budget={query}' -H {shlex.quote('X-API-Key: ' + key)} "
            f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")


def _ready(url: str, stop: threading.Event) -> bool:
    """Poll /readyz until it answers 200 (True) or ``stop`` is set (False)."""
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        stop.wait(0.5)
    return False


def _announce_when_ready(url: str, command: str, stop: threading.Event, note: str = "") -> None:
    """Print the curl command once ready (stdout, not the log: the key must stay out of logs)."""
    if _ready(url, stop):
        print(f"\nheadbudget is ready. Try it (a development key, valid while this server runs):\n\n"
              f"  {command}\n{note}", flush=True)


@dataclass(frozen=True)
class Calibration:
    """A decider to make once the server answers (`headbudget decider` on ``data``, its output in ``log``), for a
    checkpoint served without one: the first answer does not wait for it, and budget=auto works once it is made."""

    model_dir: Path
    data: str
    precision: str
    log: Path


def _calibrate_when_ready(url: str, job: Calibration, stop: threading.Event) -> None:
    """Run the decider at low priority once ready, then SIGHUP this process: every worker takes the new
    decider.json on its reload (Runtime.reload)."""
    if not _ready(url, stop):
        return
    job.log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "headbudget.cli", "decider", "--model", str(job.model_dir), "--data", job.data,
           "--precision", job.precision]
    if shutil.which("nice"):  # the server's requests first
        cmd = ["nice", "-n", "10", *cmd]
    with open(job.log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if stop.wait(0.5):
                proc.terminate()
                proc.wait(10)
                return
    if proc.returncode != 0:  # the reload still comes: auto then says what is missing (400), not "not yet" (503)
        log.warning("budget=auto: calibrating a decider failed (exit %d); see %s", proc.returncode, job.log)
    os.kill(os.getpid(), signal.SIGHUP)


def _metrics_dir(workers: int) -> str | None:
    """Set up PROMETHEUS_MULTIPROC_DIR for several workers (a fresh temp folder unless one is given)."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        for stale in Path(given).glob("*.db"):
            stale.unlink()
        return None
    if workers == 1:
        return None
    folder = tempfile.mkdtemp(prefix="headbudget-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder


def serve(settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 8000, workers: int = 1,
          print_curl: bool = False, log_level: str = "info", access_log: Path | None = None,
          calibration: Calibration | None = None) -> int:
    """Serve until SIGINT/SIGTERM; in-flight requests finish before the process exits. ``calibration``: a decider
    to make in the background once the server answers."""
    configure_logging(log_level.upper(), access_log)
    config = load_config(settings.config_path)  # refuse a bad config before loading anything
    if workers > 1 and not config.state.redis_url:
        log.warning("several workers without [state] redis_url: rate limits and feedback are per worker")
    key = None
    if print_curl:
        key = new_key()
        tier = _curl_tier(config)
        settings = settings.model_copy(update={"extra_key_hashes": {**settings.extra_key_hashes,
                                                                   hash_key(key): tier}})
    os.environ[SERVE_ENV] = settings.to_env()
    own_metrics_dir = _metrics_dir(workers)
    uconfig = uvicorn.Config(APP, factory=True, host=host, port=port, workers=workers, log_config=None,
                             access_log=False, lifespan="on", log_level=log_level,
                             timeout_graceful_shutdown=int(config.server.graceful_timeout_s))
    stop = threading.Event()
    ready_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}/readyz"
    if key is not None:
        command = curl_command(host, port, key, config.tier(_curl_tier(config)).default_budget)
        note = f"  Requests are logged to {access_log}; Ctrl-C stops the server.\n" if access_log else ""
        if calibration is not None:
            note += (f"  budget=auto is being calibrated in the background (about a minute; {calibration.log}); "
                     "until then it answers 503.\n")
        threading.Thread(target=_announce_when_ready, args=(ready_url, command, stop, note), daemon=True).start()
    calibrating = None
    if calibration is not None:
        calibrating = threading.Thread(target=_calibrate_when_ready, args=(ready_url, calibration, stop), daemon=True)
        calibrating.start()
    started = time.monotonic()
    try:
        if workers == 1:
            server = uvicorn.Server(uconfig)
            server.run()
            failed = not server.started
        else:
            sock = uconfig.bind_socket()
            supervisor = _Supervisor(uconfig, sockets=[sock])
            supervisor.run()  # a worker that fails to start (bad checkpoint or config) stops them all
            failed = any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes)
    finally:
        stop.set()
        if calibrating is not None:
            calibrating.join(15)  # a decider still running is stopped with the server
        if own_metrics_dir:
            shutil.rmtree(own_metrics_dir, ignore_errors=True)
    log.info("stopped", extra={"uptime_s": round(time.monotonic() - started, 1)})
    return 1 if failed else 0
