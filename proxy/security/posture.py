"""Start-up posture: the log lines that say how exposed the proxy is, and what loopback is."""

from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.settings import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def posture(settings: Settings) -> list[tuple[int, str]]:
    """The start-up log lines (level, message) that say how exposed the proxy is."""
    lines: list[tuple[int, str]] = []
    keys = bool(settings.api_keys or settings.admin_keys)
    where = f"{settings.host}:{settings.port}"
    if not keys:
        if is_loopback(settings.host):
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
                f"inbound auth on ({len(settings.api_keys)} data key(s), "
                f"{len(settings.admin_keys)} admin key(s)); /health and /metrics stay open",
            )
        )
        if not settings.admin_keys:
            lines.append(
                (
                    logging.WARNING,
                    "PROXY_API_KEYS without PROXY_ADMIN_KEYS: control-plane endpoints (adapter "
                    "load, pause, resume) refuse every caller with 403",
                )
            )
    if settings.adapter_roots:
        lines.append(
            (logging.INFO, f"adapters may be loaded from: {', '.join(settings.adapter_roots)}")
        )
    else:
        lines.append(
            (
                logging.INFO if is_loopback(settings.host) else logging.WARNING,
                "PROXY_ADAPTER_ROOTS is not set: any lora_path is passed to the replicas",
            )
        )
    if settings.upstream_insecure:
        lines.append(
            (
                logging.WARNING,
                "PROXY_UPSTREAM_INSECURE=true: replicas' TLS certificates are NOT verified",
            )
        )
    return lines
