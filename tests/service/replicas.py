"""Two `headbudget serve` replicas behind a real haproxy, sharing one redis-server: the processes of the replica
tests, each in its own process group so that a test can kill one and the fixture can stop them all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.loadtest.haproxy import haproxy_config
from tests.service.conftest import HOST, free_port, service_env, stop_process, wait_until

READY_S = 180.0  # a replica's start: the ONNX export of the checkpoint on a loaded machine


def need(exe: str, package: str) -> str:
    path = shutil.which(exe, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))  # haproxy
    if path is None:
        pytest.skip(f"{exe} is not installed (Debian package {package}; `make system-deps`)")
    return path


class RedisServer:
    """A redis-server on a fixed free port that can be stopped and started again on that port. It keeps an
    append-only file synced on every write, as a store that holds billing records must, and takes DEBUG SLEEP
    from loopback (a Redis too busy to answer in time)."""

    def __init__(self, folder: Path) -> None:
        self.exe = need("redis-server", "redis-server")
        self.folder, self.port = folder, free_port()
        self.url = f"redis://{HOST}:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        log = self.folder / "redis.log"
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                [self.exe, "--bind", HOST, "--port", str(self.port), "--save", "", "--appendonly", "yes",
                 "--appendfsync", "always", "--dir", str(self.folder), "--enable-debug-command", "local"],
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.ping, 20, "redis-server", self.proc, log)

    def ping(self) -> bool:
        with socket.create_connection((HOST, self.port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=10)
            self.proc = None


@dataclass
class Replica:
    name: str
    port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def start(self, model: Path, config: Path) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(model), "--config", str(config),
               "--host", HOST, "--port", str(self.port), "--workers", "1"]
        with open(self.log, "ab") as err, open(self.folder / "server.out", "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=service_env(), start_new_session=True)

    def wait_ready(self) -> None:
        assert self.proc is not None
        wait_until(lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200, READY_S,
                   f"replica {self.name}", self.proc, self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the replica's whole process group: no drain, no goodbye."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def records(self) -> list[dict[str, Any]]:
        """The JSON log records this replica wrote so far (access records and warnings)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out




class Haproxy:
    def __init__(self, folder: Path, replicas: list[Replica]) -> None:
        self.exe = need("haproxy", "haproxy")
        self.folder, self.port = folder, free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cfg = folder / "haproxy.cfg"
        folder.mkdir(parents=True, exist_ok=True)
        self.cfg.write_text(haproxy_config(HOST, self.port, [(r.name, r.port) for r in replicas]))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.folder / "haproxy.log"
        check = subprocess.run([self.exe, "-c", "-q", "-f", str(self.cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([self.exe, "-db", "-f", str(self.cfg)], stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200, 20, "haproxy",
                   self.proc, log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=10)


@dataclass
class Cluster:
    """Redis, the replicas behind haproxy (fail open), and one more replica alone that fails closed."""

    model: Path
    config: Path
    closed_config: Path
    redis: RedisServer
    replicas: list[Replica]
    closed: Replica
    lb: Haproxy

    def ensure_replicas(self) -> None:
        """Start again any replica a test killed, and wait until haproxy sends it traffic again."""
        dead = [r for r in self.replicas if not r.alive()]
        for r in dead:
            r.start(self.model, self.config)
        for r in dead:
            r.wait_ready()
        if dead:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(self.serving()) < len(self.replicas):
                time.sleep(0.1)

    def serving(self) -> set[str]:
        """The replicas that answered a few /readyz through the balancer."""
        return {httpx.get(f"{self.lb.url}/readyz", timeout=5).headers.get("x-replica", "")
                for _ in range(2 * len(self.replicas))}

    def stop(self) -> None:
        for proc in (self.lb, self.closed, *self.replicas, self.redis):
            with contextlib.suppress(Exception):
                proc.stop()


@contextlib.contextmanager
def cluster(model: Path, config_text: str, closed_text: str, tmp: Path) -> Any:
    """A started Cluster until the block ends; every process is stopped, whatever happened."""
    tmp.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(tmp / "redis")
    need("haproxy", "haproxy")
    config, closed_config = tmp / "service.toml", tmp / "service-closed.toml"
    journal = str(tmp / "journal")  # the replicas' shared volume
    config.write_text(config_text.replace("@REDIS@", redis.url).replace("@JOURNAL@", journal))
    closed_config.write_text(closed_text.replace("@REDIS@", redis.url).replace("@JOURNAL@", journal))
    replicas = [Replica(name, free_port(), tmp / name) for name in ("a", "b")]
    closed = Replica("closed", free_port(), tmp / "closed")
    c = Cluster(model, config, closed_config, redis, replicas, closed, Haproxy(tmp / "haproxy", replicas))
    try:
        redis.start()
        for r in replicas:
            r.start(model, config)
        closed.start(model, closed_config)
        for r in (*replicas, closed):
            r.wait_ready()
        c.lb.start()
        yield c
    finally:
        c.stop()
