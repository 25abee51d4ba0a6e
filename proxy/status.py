"""``python -m proxy status --url URL [--watch]``: the fleet as an operator reads it.

Reads the proxy's own ``GET /admin/fleet`` (admin-key protected) and prints one row per replica:
state, adapters held, desired versus applied (``+`` a desired adapter it lacks, ``-`` one it
holds beyond the desired set), pause state, in-flight requests, recent prefix-cache hit rate,
weight version, last error and what it is waiting for. ``--watch`` redraws it every
``--interval`` seconds until interrupted.

The admin key comes from ``--admin-key`` or the environment (``PROXY_ADMIN_KEY``, else the first
of ``PROXY_ADMIN_KEYS``); it is sent as a Bearer token and never printed. The proxy's answer
carries no upstream token, and replica URLs are shown without any user:password part.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

COLUMNS = (
    "REPLICA",
    "STATE",
    "ADAPTERS",
    "DESIRED/APPLIED",
    "PAUSED",
    "IN-FLIGHT",
    "HIT-RATE",
    "WEIGHTS",
    "LAST-ERROR",
    "WAITING-FOR",
)
MAX_CELL = 60  # long errors and adapter lists are cut so a row stays on a wide terminal


class StatusError(Exception):
    """The fleet could not be read; the message is fit to print (it never holds the key)."""


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    text = str(value).replace("\n", " ")
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 3] + "..."


def _url(url: Any) -> str:
    """A replica URL without userinfo (a password must not reach the screen)."""
    if not isinstance(url, str):
        return "?"
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _adapters(held: Any) -> str:
    if not isinstance(held, dict) or not held:
        return "-"
    return ",".join(sorted(str(name) for name in held))


def _diff(replica: dict[str, Any]) -> str:
    missing = replica.get("missing") or []
    extra = replica.get("extra") or []
    if not missing and not extra:
        return "in sync"
    return " ".join([f"+{n}" for n in missing] + [f"-{n}" for n in extra])


def _paused(replica: dict[str, Any]) -> str:
    paused = replica.get("paused")
    if paused is None:
        return "unknown"
    known = (replica.get("observed") or {}).get("paused") == "known"
    return ("yes" if paused else "no") + ("" if known else " (applied)")


def _rate(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{100 * value:.1f}%"
    return "-"


def render(snapshot: dict[str, Any]) -> str:
    """The table for one ``/admin/fleet`` answer (pure: the tests call it directly)."""
    desired = snapshot.get("desired") or {}
    wanted = desired.get("adapters") or {}
    rows = [COLUMNS]
    for r in snapshot.get("replicas") or []:
        if not isinstance(r, dict) or r.get("status") == "removed":
            continue
        rows.append(
            (
                f"{r.get('index')} {_url(r.get('url'))}",
                _cell(r.get("status")),
                _cell(_adapters(r.get("adapters"))),
                _cell(_diff(r)),
                _paused(r),
                _cell(r.get("in_flight")),
                _rate(r.get("hit_rate")),
                _cell(r.get("weight_version")),
                _cell(r.get("last_error")),
                _cell(r.get("waiting_for")),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        f"desired: {len(wanted)} adapters ({_cell(','.join(sorted(wanted)) or '-')}), "
        f"paused={'yes' if desired.get('paused') else 'no'}; "
        f"base model {_cell(snapshot.get('base_model'))}"
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def admin_key(given: str | None) -> str | None:
    keys = [k.strip() for k in os.environ.get("PROXY_ADMIN_KEYS", "").split(",") if k.strip()]
    return given or os.environ.get("PROXY_ADMIN_KEY") or (keys[0] if keys else None)


def fetch(client: httpx.Client, url: str, key: str | None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        response = client.get(url.rstrip("/") + "/admin/fleet", headers=headers)
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach the proxy at {_url(url)}: {type(exc).__name__}") from None
    if response.status_code in (401, 403):
        raise StatusError(
            f"the proxy refused the admin key (HTTP {response.status_code}): pass --admin-key or "
            "set PROXY_ADMIN_KEY"
        )
    if response.status_code != 200:
        raise StatusError(f"GET /admin/fleet answered HTTP {response.status_code}")
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise StatusError("GET /admin/fleet did not answer a JSON object")
    return payload


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy status", description=__doc__)
    parser.add_argument("--url", required=True, help="the proxy's URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--watch", action="store_true", help="redraw until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    parser.add_argument("--count", type=int, default=0, help="with --watch: stop after N draws")
    parser.add_argument(
        "--admin-key", default=None, help="default: $PROXY_ADMIN_KEY, else $PROXY_ADMIN_KEYS"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="per request, seconds")
    args = parser.parse_args(argv)
    if args.interval <= 0 or args.timeout <= 0 or args.count < 0:
        parser.error("--interval and --timeout must be > 0, --count >= 0")
    key = admin_key(args.admin_key)
    drawn = 0
    with httpx.Client(timeout=args.timeout) as client:
        while True:
            try:
                table = render(fetch(client, args.url, key))
            except StatusError as exc:
                print(f"rollout-proxy status: {exc}", file=sys.stderr)
                if not args.watch:
                    return 1
                table = f"(last read failed: {exc})"
            if args.watch:
                print("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S ") + _url(args.url), flush=True)
            print(table, flush=True)
            drawn += 1
            if not args.watch or (args.count and drawn >= args.count):
                return 0
            try:
                time.sleep(args.interval)
            except KeyboardInterrupt:
                return 0
