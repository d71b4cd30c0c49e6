"""Structured JSON logs: one object per line, access records with request id, tier, budget and latency."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

ACCESS = logging.getLogger("headbudget.access")
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object; fields passed in ``extra`` become keys."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
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


def configure_logging(level: str = "INFO", access_log: Path | None = None) -> None:
    """Send our logs and uvicorn's to stderr as JSON lines (uvicorn's own access log is replaced by ours); access
    records to ``access_log`` instead when given (appended: every worker writes whole lines)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    ACCESS.handlers[:], ACCESS.propagate = [], access_log is None
    if access_log is not None:
        access_log.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(access_log, encoding="utf-8")
        to_file.setFormatter(JsonFormatter())
        ACCESS.addHandler(to_file)
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
    ACCESS.log(logging.DEBUG if quiet else logging.INFO, "request", extra=fields)
