"""Usage the state store could not take, kept on local disk until it can.

When Redis does not answer (fail-open, or a request already admitted when it went away), an answered request's
usage goes to a journal: one file per process in ``StateConfig.journal_dir``, one JSON line per request, fsync'd
before the answer leaves. A replay sends every line to the store under its charge id and then removes the lines
sent, so a line sent twice (a crash between the two steps, or two processes replaying one file) counts once.
Any process with the same folder replays every file in it: a replica killed with lines in its journal has them
replayed when it (or another one on the volume) starts. Past ``journal_max_bytes`` a file takes no more lines.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from headbudget.service.state.store import StateStore, StateUnavailable, Usage, UsageRow

log = logging.getLogger("headbudget.service")


@dataclass(frozen=True)
class Entry:
    """One answered request's usage and the id it counts under."""

    charge_id: str
    row: UsageRow

    def line(self) -> str:
        r = self.row
        return json.dumps({"charge_id": self.charge_id, "day": r.day, "owner": r.owner, "name": r.name,
                           "tier": r.tier, "usage": r.usage.fields()}, separators=(",", ":")) + "\n"

    @classmethod
    def parse(cls, line: str) -> Entry:
        d = json.loads(line)
        return cls(str(d["charge_id"]), UsageRow(str(d["day"]), str(d["owner"]), str(d["name"]), str(d["tier"]),
                                                 Usage.parse(d["usage"])))


@contextmanager
def _locked(path: Path, mode: str) -> Iterator[IO[str]]:
    """``path`` opened and locked against the other processes' appends and replays."""
    with open(path, mode, encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class UsageJournal:
    """This process's journal file, and the replay of every journal file in its folder."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.max_bytes = max_bytes
        self.path = folder / f"usage-{socket.gethostname()}-{os.getpid()}.jsonl"
        self._appending = threading.Lock()
        self._replaying = asyncio.Lock()

    def append(self, entry: Entry) -> bool:
        """Write one entry and fsync it (blocking: call it off the event loop). False when the file is full."""
        line = entry.line()
        with self._appending, _locked(self.path, "a") as f:
            if f.tell() + len(line.encode()) > self.max_bytes:
                return False
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return True

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("usage-*.jsonl"))

    def waiting(self) -> bool:
        """Whether any file of the folder holds lines (by size: the poll reads no file)."""
        for path in self.files():
            try:
                if path.stat().st_size:
                    return True
            except OSError:
                continue
        return False

    def pending(self) -> int:
        """Lines waiting in every file of the folder."""
        n = 0
        for path in self.files():
            try:
                with open(path, encoding="utf-8") as f:
                    n += sum(1 for line in f if line.strip())
            except OSError:
                continue
        return n

    async def replay(self, store: StateStore) -> int:
        """Send every waiting line to ``store``; the number of lines sent. Stops at the first file whose store
        write fails (StateUnavailable), keeping what it has not sent."""
        async with self._replaying:
            sent = 0
            for path in self.files():
                sent += await self._replay_file(path, store)
            return sent

    async def _replay_file(self, path: Path, store: StateStore) -> int:
        lines = await asyncio.to_thread(_read, path)
        done = 0
        try:
            for line in lines:
                try:
                    entry = Entry.parse(line)
                except (ValueError, KeyError, TypeError):
                    log.error("usage journal %s: skipping an unreadable line: %.200s", path, line)
                else:
                    await store.record_usage(entry.row, entry.charge_id)
                done += 1
        finally:
            if done:
                await asyncio.to_thread(_drop_first, path, done)
        if done:
            log.info("usage journal %s: %d requests' usage sent to the state store", path.name, done)
        return done


def _read(path: Path) -> list[str]:
    try:
        with _locked(path, "r") as f:
            return [line for line in f.read().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _drop_first(path: Path, n: int) -> None:
    """Remove the first ``n`` entries in place (appends wait on the lock and land after what stays)."""
    with _locked(path, "r+") as f:
        rest = [line for line in f.read().splitlines() if line.strip()][n:]
        f.seek(0)
        f.write("".join(line + "\n" for line in rest))
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


async def replay_while_running(journal: UsageJournal, store: StateStore, every_s: float = 1.0) -> None:
    """Replay the folder's journals whenever they hold lines and the store answers (a task for the server's life)."""
    while True:
        try:
            if await asyncio.to_thread(journal.waiting) and await store.ping():
                await journal.replay(store)
        except StateUnavailable:
            pass  # the store went away again: the lines stay for the next round
        except OSError as e:
            log.error("usage journal %s: %s", journal.folder, e)
        await asyncio.sleep(every_s)
