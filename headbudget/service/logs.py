"""Structured JSON logs: one object per line, access records with request id, tier, budget and latency."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ACCESS = logging.getLogger("headbudget.access")
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _timestamp(seconds: float) -> str:
    """UTC, to the millisecond: 2026-01-31T12:00:00.123Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object; fields passed in ``extra`` become keys."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_") and key != "color_message":
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _AccessFile:
    """Access records straight to their file, each one ``os.write`` of a whole line on an O_APPEND descriptor (the
    lines of several workers never interleave), as ``JsonFormatter`` writes them: logging's record, handler lock,
    formatter and stream for every request cost several times the line itself in a server whose forward passes
    keep evicting the caches (docs/decisions.md, 2026-11-29)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.failing = False

    def write(self, level: str, fields: dict[str, Any]) -> None:
        record = {"ts": _timestamp(time.time()), "level": level, "logger": ACCESS.name, "msg": "request", **fields}
        try:
            os.write(self.fd, (json.dumps(record, default=str) + "\n").encode())
        except OSError as e:  # a full disk must not fail the request it records (logging's handlers swallow too)
            if not self.failing:
                logging.getLogger(__name__).error("cannot write the access log %s: %s", self.path, e)
            self.failing = True
        else:
            self.failing = False

    def close(self) -> None:
        os.close(self.fd)


_access_file: _AccessFile | None = None


def configure_logging(level: str = "INFO", access_log: Path | None = None) -> None:
    """Send our logs and uvicorn's to stderr as JSON lines (uvicorn's own access log is replaced by ours); access
    records to ``access_log`` instead when given (appended: every worker writes whole lines). A file asked for is
    written whatever ``level`` (which quiets stderr): usage is reconciled from it; probes and scrapes only at
    debug."""
    global _access_file
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    ACCESS.handlers[:], ACCESS.propagate = [], access_log is None
    ACCESS.setLevel(min(root.level, logging.INFO) if access_log is not None else logging.NOTSET)
    if _access_file is not None:
        _access_file.close()
    _access_file = _AccessFile(access_log) if access_log is not None else None
    for name in ("uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").disabled = True


def access_logged(quiet: bool = False) -> bool:
    """Whether an access record would be written at the configured level (debug for probes and scrapes)."""
    return ACCESS.isEnabledFor(logging.DEBUG if quiet else logging.INFO)


def log_access(fields: dict[str, Any], quiet: bool = False) -> None:
    """One access record (debug level for probes and scrapes)."""
    level = logging.DEBUG if quiet else logging.INFO
    if _access_file is None:
        ACCESS.log(level, "request", extra=fields)
    elif ACCESS.isEnabledFor(level):
        _access_file.write("debug" if quiet else "info", fields)
