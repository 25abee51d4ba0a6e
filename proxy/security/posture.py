"""Start-up posture: the log lines that say how exposed the proxy is."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.checks import is_loopback


def posture(
    host: str,
    port: int,
    *,
    data_keys: int,
    admin_keys: int,
    adapter_roots: Sequence[str],
    upstream_insecure: bool,
) -> list[tuple[int, str]]:
    """The start-up log lines (level, message) that say how exposed the proxy is, from where it
    listens, how many data and admin keys it has, its adapter roots and its TLS posture."""
    lines: list[tuple[int, str]] = []
    keys = bool(data_keys or admin_keys)
    where = f"{host}:{port}"
    if not keys:
        if is_loopback(host):
            lines.append(
                (
                    logging.INFO,
                    f"no PROXY_API_KEYS/PROXY_ADMIN_KEYS: listening on loopback only ({where}); "
                    "every endpoint is open to local processes",
                )
            )
        else:
            lines.append(
                (
                    logging.WARNING,
                    f"no PROXY_API_KEYS/PROXY_ADMIN_KEYS and listening on {where} "
                    "(PROXY_ALLOW_UNAUTHENTICATED=true): anyone who reaches this port can load "
                    "adapters, pause the fleet and spend the upstream token",
                )
            )
    else:
        lines.append(
            (
                logging.INFO,
                f"inbound auth on ({data_keys} data key(s), "
                f"{admin_keys} admin key(s)); /health and /metrics stay open",
            )
        )
        if not admin_keys:
            lines.append(
                (
                    logging.WARNING,
                    "PROXY_API_KEYS without PROXY_ADMIN_KEYS: control-plane endpoints (adapter "
                    "load, pause, resume) refuse every caller with 403",
                )
            )
    if adapter_roots:
        lines.append((logging.INFO, f"adapters may be loaded from: {', '.join(adapter_roots)}"))
    else:
        lines.append(
            (
                logging.INFO if is_loopback(host) else logging.WARNING,
                "PROXY_ADAPTER_ROOTS is not set: any lora_path is passed to the replicas",
            )
        )
    if upstream_insecure:
        lines.append(
            (
                logging.WARNING,
                "PROXY_UPSTREAM_INSECURE=true: replicas' TLS certificates are NOT verified",
            )
        )
    return lines
