"""``headbudget keys``: create API keys (stored in the config as SHA-256 hashes), list, revoke and expire them.

The config file is edited as text, so that its comments and layout stay as the operator wrote them, and every
edit is checked before it lands: the edited text must parse to the old document plus exactly the intended
change and validate as a service config; it is written to a temporary file beside the config and renamed over
it, so a running server's SIGHUP never reads half a file.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from headbudget.commands.common import CliError

_TABLE = re.compile(r"^\s*\[")  # any table header ([x] or [[x]])
_KEYS_TABLE = re.compile(r"^\s*\[\[\s*keys\s*\]\]\s*(#.*)?$")
_ASSIGNMENT = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")
MIN_PREFIX = 6  # hex digits: `keys list` shows 12; fewer would too easily match the wrong key


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("keys", help="manage API keys in the service config")
    sub = p.add_subparsers(dest="keys_command", required=True)
    add = sub.add_parser("add", help="create a key for a tier; prints it once")
    add.add_argument("--tier", required=True, help="a tier defined in the config")
    add.add_argument("--config", type=Path, default=Path("service.toml"))
    add.add_argument("--name", default="", help="a label for logs and audits (not secret)")
    add.add_argument("--expires", default=None, metavar="WHEN",
                     help="refuse the key from then on: a date (2026-12-31: from 00:00 UTC that day) or an ISO "
                          "datetime (2026-12-31T18:00:00Z; without an offset: UTC)")
    add.set_defaults(func=run_add)
    ls = sub.add_parser("list", help="list keys (hash prefixes, tiers, state, expiry, names)")
    ls.add_argument("--config", type=Path, default=Path("service.toml"))
    ls.set_defaults(func=run_list)
    rv = sub.add_parser("revoke", help="mark a key revoked (kept in the file for audits); with a Redis state store "
                                       "every replica refuses it at once, else on SIGHUP")
    rv.add_argument("--config", type=Path, default=Path("service.toml"))
    which = rv.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", help="the key's name (must name one key that is not revoked)")
    which.add_argument("--sha256", metavar="PREFIX", help=f"a prefix of the key's hash, at least {MIN_PREFIX} "
                                                          "hex digits (as `keys list` shows it)")
    rv.set_defaults(func=run_revoke)


def _load(path: Path) -> Any:
    from headbudget.service.settings import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        raise CliError(str(e)) from None


def parse_expiry(text: str, now: float | None = None) -> datetime:
    """``--expires``: a date or an ISO datetime, as an aware UTC instant in the future."""
    from headbudget.service.settings import utc_instant

    try:
        when = utc_instant(text.strip())
    except ValueError:
        raise CliError(f"--expires {text!r}: give a date (2026-12-31) or an ISO datetime "
                       "(2026-12-31T18:00:00Z)") from None
    if when.timestamp() <= (time.time() if now is None else now):
        raise CliError(f"--expires {text!r}: {_utc(when)} is not in the future")
    return when


def _utc(t: datetime | None) -> str:
    from headbudget.service.settings import utc_text

    return utc_text(t)


def _toml_string(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped) + '"'


def run_add(args: argparse.Namespace) -> int:
    from headbudget.service.accounting.auth import hash_key, new_key

    config = _load(args.config)
    if args.tier not in config.tiers:
        raise CliError(f"tier {args.tier!r} is not defined in {args.config} (tiers: {', '.join(sorted(config.tiers))})")
    expires = parse_expiry(args.expires) if args.expires is not None else None
    key = new_key()
    entry = {"sha256": hash_key(key), "tier": args.tier}
    lines = ["[[keys]]", f'sha256 = "{entry["sha256"]}"', f"tier = {_toml_string(args.tier)}"]
    if args.name:
        entry["name"] = args.name
        lines.append(f"name = {_toml_string(args.name)}")
    if expires is not None:
        lines.append(f"expires = {_utc(expires)}")
    text = args.config.read_text(encoding="utf-8")
    new_text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"

    def check(old: dict[str, Any], new: dict[str, Any]) -> bool:
        added = {**entry, **({"expires": expires} if expires is not None else {})}
        return _without_keys(new) == _without_keys(old) and new.get("keys") == [*old.get("keys", []), added]

    _replace_checked(args.config, text, new_text, check)
    if args.name and any(k.name == args.name and not k.revoked for k in config.keys):
        # allowed (rotation: the new key first, then revoke the old one), but --name can no longer pick one
        print(f"note: another key is also named {args.name!r}; revoke either with --sha256 PREFIX", file=sys.stderr)
    until = f", refused from {_utc(expires)}" if expires is not None else ""
    print(f"added a key for tier {args.tier!r} to {args.config}{until}; it is shown only now. "
          "Send SIGHUP to a running server to load it.", file=sys.stderr)
    print(key)
    return 0


def run_list(args: argparse.Namespace) -> int:
    config = _load(args.config)
    now = time.time()
    print(f"{'sha256':<12}  {'tier':<12} {'state':<8} {'expires':<20}  name")
    for k in config.keys:
        print(f"{k.sha256[:12]}  {k.tier:<12} {k.state(now):<8} {_utc(k.expires):<20}  {k.name}"
              + (f"  (revoked {_utc(k.revoked_at)})" if k.revoked_at is not None else ""))
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    config = _load(args.config)
    keys = list(config.keys)
    if args.name is not None:
        named = [i for i, k in enumerate(keys) if k.name == args.name]
        if not named:
            raise CliError(f"no key is named {args.name!r} in {args.config}")
        live = [i for i in named if not keys[i].revoked]
        if len(live) > 1:
            prefixes = ", ".join(keys[i].sha256[:12] for i in live)
            raise CliError(f"{len(live)} keys are named {args.name!r} ({prefixes}); revoke one with --sha256 PREFIX")
        matches = live or named[:1]
    else:
        prefix = args.sha256.strip().lower()
        if not re.fullmatch(rf"[0-9a-f]{{{MIN_PREFIX},64}}", prefix):
            raise CliError(f"--sha256 {args.sha256!r}: give at least {MIN_PREFIX} hex digits of the key's hash "
                           "(`headbudget keys list` shows 12)")
        matches = [i for i, k in enumerate(keys) if k.sha256.startswith(prefix)]
        if not matches:
            raise CliError(f"no key's sha256 starts with {prefix!r} in {args.config}")
        if len(matches) > 1:
            raise CliError(f"{len(matches)} keys' sha256 start with {prefix!r}; give more digits")
    index = matches[0]
    target = keys[index]
    label = f"{target.sha256[:12]}" + (f" ({target.name})" if target.name else "")
    if target.revoked:
        print(f"key {label} is already revoked (since {_utc(target.revoked_at)}); {args.config} is unchanged",
              file=sys.stderr)
        _share(config, target.sha256, target.revoked_at)
        return 0
    # Marked, not deleted: the access log names keys, so an audit must still find whose a key was and since
    # when it is refused, and its holder is told "revoked" rather than "unknown".
    now = datetime.now(UTC).replace(microsecond=0)
    text = args.config.read_text(encoding="utf-8")
    new_text = _mark_revoked(text, index, now)

    def check(old: dict[str, Any], new: dict[str, Any]) -> bool:
        want = list(old["keys"])
        if want[index].get("sha256") != target.sha256:  # the file changed since it was read
            return False
        want[index] = {**want[index], "revoked": True, "revoked_at": now}
        return _without_keys(new) == _without_keys(old) and new.get("keys") == want

    _replace_checked(args.config, text, new_text, check)
    print(f"revoked key {label} of tier {target.tier!r} in {args.config}", file=sys.stderr)
    _share(config, target.sha256, now)
    return 0


def _share(config: Any, sha256: str, when: datetime | None) -> None:
    """Tell the state store, whose replicas then refuse the key at once; without one, say that SIGHUP does."""
    if not config.state.redis_url:
        print("send SIGHUP to a running server to refuse it", file=sys.stderr)
        return
    import asyncio

    from headbudget.service.state.redis_store import RedisState
    from headbudget.service.state.store import StateUnavailable

    async def revoke() -> None:
        store = RedisState(config.state)
        try:
            await store.revoke({sha256: _utc(when) if when else ""})
        finally:
            await store.close()

    try:
        asyncio.run(revoke())
    except StateUnavailable as e:
        print(f"note: the state store could not be reached ({e}); send SIGHUP to every replica to refuse it",
              file=sys.stderr)
        return
    print("every replica that shares the state store refuses it now", file=sys.stderr)


def _without_keys(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "keys"}


def _mark_revoked(text: str, index: int, when: datetime) -> str:
    """``text`` with the ``index``-th ``[[keys]]`` table given ``revoked = true`` and ``revoked_at``; an existing
    ``revoked``/``revoked_at`` line of that table is replaced, the rest of the file left as it is."""
    lines = text.splitlines(keepends=True)
    headers = [i for i, line in enumerate(lines) if _KEYS_TABLE.match(line)]
    if index >= len(headers):
        raise CliError("cannot edit the keys: they are not all written as [[keys]] tables; edit the file by hand")
    start = headers[index] + 1
    end = next((i for i in range(start, len(lines)) if _TABLE.match(lines[i])), len(lines))
    body = [line for line in lines[start:end]
            if not ((m := _ASSIGNMENT.match(line)) and m.group(1) in ("revoked", "revoked_at"))]
    # after the table's last assignment, so that blank lines and comments before the next table stay there
    last = max((i for i, line in enumerate(body) if _ASSIGNMENT.match(line)), default=-1)
    if last >= 0 and not body[last].endswith("\n"):
        body[last] += "\n"
    added = ["revoked = true\n", f"revoked_at = {_utc(when)}\n"]
    return "".join([*lines[:start], *body[:last + 1], *added, *body[last + 1:], *lines[end:]])


def _replace_checked(path: Path, old_text: str, new_text: str,
                     check: Callable[[dict[str, Any], dict[str, Any]], bool]) -> None:
    """Write ``new_text`` over ``path`` if it parses to what ``check(old_doc, new_doc)`` expects and validates as a
    service config; through a temporary file and a rename, so the file is always either old or new."""
    from headbudget.service.settings import ConfigError, load_config

    try:
        ok = check(tomllib.loads(old_text), tomllib.loads(new_text))
    except (tomllib.TOMLDecodeError, KeyError, IndexError):
        ok = False
    if not ok:
        raise CliError(f"{path} is laid out in a way this command cannot edit safely; it is unchanged "
                       "(edit it by hand)")
    target = path.resolve()  # a symlinked config: replace the file it points to, keep the link
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new_text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, target.stat().st_mode & 0o7777)
        try:
            load_config(tmp)
        except ConfigError as e:
            raise CliError(f"{path} would not validate after the change, so it is unchanged: {e}") from None
        os.replace(tmp, target)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}; it is unchanged") from None
    finally:
        tmp.unlink(missing_ok=True)

