"""``headbudget keys``: create API keys (stored in the config as SHA-256 hashes) and list them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from headbudget.commands.common import CliError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("keys", help="manage API keys in the service config")
    sub = p.add_subparsers(dest="keys_command", required=True)
    add = sub.add_parser("add", help="create a key for a tier; prints it once")
    add.add_argument("--tier", required=True, help="a tier defined in the config")
    add.add_argument("--config", type=Path, default=Path("service.toml"))
    add.add_argument("--name", default="", help="a label for logs and audits (not secret)")
    add.set_defaults(func=run_add)
    ls = sub.add_parser("list", help="list keys (names, tiers, hash prefixes)")
    ls.add_argument("--config", type=Path, default=Path("service.toml"))
    ls.set_defaults(func=run_list)


def run_add(args: argparse.Namespace) -> int:
    from headbudget.service.auth import append_key
    from headbudget.service.settings import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None
    if args.tier not in config.tiers:
        raise CliError(f"tier {args.tier!r} is not defined in {args.config} (tiers: {', '.join(sorted(config.tiers))})")
    key = append_key(args.config, args.tier, args.name)
    try:
        load_config(args.config)
    except ConfigError as e:  # should not happen; say so rather than leave a broken file unnoticed
        raise CliError(f"{args.config} no longer validates after adding the key: {e}") from None
    print(f"added a key for tier {args.tier!r} to {args.config}; it is shown only now. "
          "Send SIGHUP to a running server to load it.", file=sys.stderr)
    print(key)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from headbudget.service.settings import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as e:
        raise CliError(str(e)) from None
    for k in config.keys:
        print(f"{k.sha256[:12]}  {k.tier:<12} {k.name}")
    return 0
