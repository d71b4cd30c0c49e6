"""``headbudget usage``: compute usage per key and UTC day from the state store (Redis), as CSV or JSON lines.

The workers add every answered request to its key's day in Redis (units and saved units in compute units,
requests, texts, tokens; service/state.py); this command reads them back for billing. Without Redis each worker
counts in its own memory and nothing outlives it, so there is nothing to export: that is an error, not an empty list.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import re
import sys
from datetime import date
from pathlib import Path
from typing import Any

from headbudget.commands.common import CliError

FIELDS = ("day", "key", "owner", "tier", "units", "requests", "texts", "tokens", "saved_units")


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
    from headbudget.service.redis_state import RedisState
    from headbudget.service.state import StateUnavailable

    store = RedisState(state)
    try:
        return await store.usage_rows(since, until)
    except StateUnavailable as e:
        raise CliError(f"cannot read usage from {_safe_url(state.redis_url)}: {e}") from None
    finally:
        await store.close()


def _safe_url(url: str) -> str:
    """The Redis URL without a password."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def _write(rows: list[Any], fmt: str) -> None:
    from headbudget.service.compute import units

    records = [{"day": r.day, "key": r.name, "owner": r.owner, "tier": r.tier, "units": units(r.usage.units),
                "requests": r.usage.requests, "texts": r.usage.texts, "tokens": r.usage.tokens,
                "saved_units": units(r.usage.saved)} for r in rows]
    if fmt == "jsonl":
        for record in records:
            sys.stdout.write(json.dumps(record) + "\n")
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
