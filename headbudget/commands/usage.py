"""``headbudget usage``: compute usage per key and UTC day from the state store (Redis), as CSV or JSON lines.

The workers add every answered request to its key's day in Redis (units and saved units in compute units,
requests, texts, tokens; service/state/store.py); this command reads them back for billing. Without Redis each worker
counts in its own memory and nothing outlives it, so there is nothing to export: that is an error, not an empty list.

``--reconcile LOG ...`` compares the answers an access log holds with the store: each answered request's charge id
is looked up, so an answer the store lacks is named, and a key's usage over the log's days that the log does not
explain (an answer computed but not delivered, or a log that misses lines) shows as the difference of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import re
import sys
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from headbudget.commands.common import CliError

FIELDS = ("day", "key", "owner", "tier", "units", "requests", "texts", "tokens", "saved_units")
RECONCILE_FIELDS = ("key", "answered", "units", "missing", "missing_units", "store_units", "store_minus_log_units")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("usage", help="list or export compute usage per key and UTC day (from Redis)")
    p.add_argument("--config", type=Path, default=Path("service.toml"),
                   help="the service config; its [state] redis_url is where usage is kept")
    p.add_argument("--since", metavar="YYYY-MM-DD", help="first UTC day listed (default: the first recorded)")
    p.add_argument("--until", metavar="YYYY-MM-DD", help="last UTC day listed, included (default: the last)")
    p.add_argument("--key", metavar="NAME", action="append", default=[],
                   help="only this key, by its name in the config or in the usage records (repeatable)")
    p.add_argument("--format", choices=("csv", "jsonl"), default="csv",
                   help="CSV with a header line (default), or one JSON object a line")
    p.add_argument("--reconcile", metavar="LOG", type=Path, nargs="+",
                   help="compare the answers in these access logs (JSON lines) with the store, per key; exit 1 "
                        "when an answer in a log is not in the store")
    p.set_defaults(func=run)


def parse_day(flag: str, text: str | None) -> str | None:
    """A ``YYYY-MM-DD`` date as given (checked to be a real day), or None."""
    if text is None:
        return None
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise CliError(f"{flag} {text!r}: give a date as YYYY-MM-DD (UTC), for example 2026-01-31") from None


def run(args: argparse.Namespace) -> int:
    from headbudget.service.settings import ConfigError, load_config

    since, until = parse_day("--since", args.since), parse_day("--until", args.until)
    if since and until and since > until:
        raise CliError(f"--since {since} is after --until {until}")
    try:
        config = load_config(args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None
    if not config.state.redis_url:
        raise CliError(f"{args.config} has no [state] redis_url: usage is kept in Redis, and without it each worker "
                       "counts in its own memory, lost when it stops; configure Redis to bill from usage")
    if args.reconcile:
        return _reconcile(config.state, args.reconcile, args.format)
    rows = asyncio.run(_rows(config.state, since, until))
    if args.key:
        by_name = {k.name: k.sha256[:16] for k in config.keys if k.name}
        unknown = [n for n in args.key if n not in by_name and n not in {r.name for r in rows}]
        if unknown:
            period = f" from {since or 'the start'} to {until or 'today'}" if since or until else ""
            raise CliError(f"no key named {unknown[0]!r} in {args.config} or in the usage records{period} "
                           f"(named keys: {', '.join(sorted(by_name)) or 'none'})")
        owners = {by_name[n] for n in args.key if n in by_name}
        rows = [r for r in rows if r.name in args.key or r.owner in owners]
    _write(rows, args.format)
    return 0


async def _rows(state: Any, since: str | None, until: str | None) -> list[Any]:
    from headbudget.service.state.redis_store import RedisState
    from headbudget.service.state.store import StateUnavailable

    store = RedisState(state)
    try:
        return await store.usage_rows(since, until)
    except StateUnavailable as e:
        raise CliError(f"cannot read usage from {_safe_url(state.redis_url)}: {e}") from None
    finally:
        await store.close()


@dataclass
class _Answered:
    """What a log says a key was answered, and how much of it the store holds."""

    key: str
    days: set[str] = field(default_factory=set)
    charges: dict[str, int] = field(default_factory=dict)  # charge id -> milli-units
    missing: list[str] = field(default_factory=list)


def _answers(logs: list[Path]) -> dict[str, _Answered]:
    """Every 200 answer with a charge id in the logs, by key name (a line that is not a JSON object is skipped)."""
    from headbudget.service.accounting.compute import milli_of_units

    by_key: dict[str, _Answered] = {}
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError as e:
            raise CliError(f"--reconcile {path}: {e.strerror or e}") from None
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if not isinstance(r, dict) or r.get("status") != 200 or "charge_id" not in r:
                continue
            try:
                charge = milli_of_units(float(r.get("charge") or 0))
            except (TypeError, ValueError, OverflowError):
                continue  # not a line the server wrote
            a = by_key.setdefault(str(r.get("key_name")), _Answered(str(r.get("key_name"))))
            a.charges[str(r["charge_id"])] = charge
            a.days.add(str(r.get("ts", ""))[:10])
    return by_key


def _reconcile(state: Any, logs: list[Path], fmt: str) -> int:
    from headbudget.service.accounting.compute import units

    answered = _answers(logs)
    if not answered:
        raise CliError("no answered request with a charge id in " + ", ".join(map(str, logs)))
    store = asyncio.run(_look_up(state, answered))
    records = []
    for a in sorted(answered.values(), key=lambda a: a.key):
        logged = sum(a.charges.values())
        records.append({"key": a.key, "answered": len(a.charges), "units": units(logged),
                        "missing": len(a.missing), "missing_units": units(sum(a.charges[i] for i in a.missing)),
                        "store_units": units(store[a.key]), "store_minus_log_units": units(store[a.key] - logged)})
    _print(records, fmt, RECONCILE_FIELDS)
    for a in answered.values():
        for charge_id in a.missing:
            sys.stderr.write(f"not in the store: key {a.key}, charge {charge_id}, "
                             f"{units(a.charges[charge_id])} compute units\n")
    return 1 if any(a.missing for a in answered.values()) else 0


async def _look_up(state: Any, answered: dict[str, _Answered]) -> dict[str, int]:
    """Note each answer the store lacks; each key's units in the store over its log's days."""
    from headbudget.service.state.redis_store import RedisState
    from headbudget.service.state.store import StateUnavailable

    store = RedisState(state)
    try:
        for a in answered.values():
            ids = list(a.charges)
            a.missing = [i for i, found in zip(ids, await store.counted(ids), strict=True) if not found]
        days = sorted({d for a in answered.values() for d in a.days})
        rows = await store.usage_rows(days[0], days[-1]) if days else []
    except StateUnavailable as e:
        raise CliError(f"cannot read usage from {_safe_url(state.redis_url)}: {e}") from None
    finally:
        await store.close()
    return {a.key: sum(r.usage.units for r in rows if r.name == a.key and r.day in a.days) for a in answered.values()}


def _print(records: list[dict[str, Any]], fmt: str, fields: tuple[str, ...]) -> None:
    if fmt == "jsonl":
        for record in records:
            sys.stdout.write(json.dumps(record) + "\n")
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)


def _safe_url(url: str) -> str:
    """The Redis URL without a password."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def _write(rows: list[Any], fmt: str) -> None:
    from headbudget.service.accounting.compute import units

    records = [{"day": r.day, "key": r.name, "owner": r.owner, "tier": r.tier, "units": units(r.usage.units),
                "requests": r.usage.requests, "texts": r.usage.texts, "tokens": r.usage.tokens,
                "saved_units": units(r.usage.saved)} for r in rows]
    _print(records, fmt, FIELDS)
