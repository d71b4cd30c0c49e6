"""The worker supervisor passes SIGHUP on to its workers from the signal's handler, not from its loop, which reads
its signal queue every 0.5 s (a revoked key was answered for up to half a second after a reload)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from headbudget.service import server


class _Worker:
    def __init__(self, pid: int | None) -> None:
        self.pid = pid


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_sighup_reaches_the_workers_before_the_loop_looks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sent: list[tuple[int, int]] = []

    def kill(pid: int, sig: int) -> None:
        if pid == 3:
            raise ProcessLookupError(pid)  # a worker that just ended
        sent.append((pid, sig))

    before = signal.getsignal(signal.SIGHUP)
    try:
        supervisor = server._Supervisor(uvicorn.Config("x:y", workers=2), sockets=[])
        supervisor.processes = [_Worker(11), _Worker(None), _Worker(3), _Worker(12)]  # type: ignore[list-item]
        monkeypatch.setattr(server.os, "kill", kill)
        handler: Any = signal.getsignal(signal.SIGHUP)
        handler(signal.SIGHUP, None)  # what the kernel's delivery runs, with the loop asleep in its 0.5 s wait
        assert sent == [(11, signal.SIGHUP), (12, signal.SIGHUP)]
        assert supervisor.signal_queue == [signal.SIGHUP]  # the loop still logs it
        supervisor.handle_signals()
        assert sent == [(11, signal.SIGHUP), (12, signal.SIGHUP)]  # and does not send it twice
    finally:
        signal.signal(signal.SIGHUP, before)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_a_real_sighup_is_passed_on_while_the_loop_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread")
    sent: list[int] = []
    before = signal.getsignal(signal.SIGHUP)
    try:
        supervisor = server._Supervisor(uvicorn.Config("x:y", workers=2), sockets=[])
        supervisor.processes = [_Worker(21)]  # type: ignore[list-item]
        real_kill = os.kill
        monkeypatch.setattr(server.os, "kill", lambda pid, sig: sent.append(pid))  # os.kill, for the workers
        threading.Timer(0.05, lambda: real_kill(os.getpid(), signal.SIGHUP)).start()
        for _ in range(100):  # uvicorn's loop waits like this; the handler runs during the wait
            if sent:
                break
            supervisor.should_exit.wait(0.1)
        assert sent == [21] and supervisor.signal_queue == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, before)
