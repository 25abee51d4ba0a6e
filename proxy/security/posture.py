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
    local = is_loopback(host)
    if data_keys or admin_keys:
        keys = f"{data_keys} data key(s), {admin_keys} admin key(s)"
        lines = [(logging.INFO, f"inbound auth on ({keys}); /health and /metrics stay open")]
    elif local:
        message = (
            f"no PROXY_API_KEYS/PROXY_ADMIN_KEYS: listening on loopback only ({host}:{port}); "
            "every endpoint is open to local processes"
        )
        lines = [(logging.INFO, message)]
    else:
        message = (
            f"no PROXY_API_KEYS/PROXY_ADMIN_KEYS and listening on {host}:{port} "
            "(PROXY_ALLOW_UNAUTHENTICATED=true): anyone who reaches this port can load "
            "adapters, pause the fleet and spend the upstream token"
        )
        lines = [(logging.WARNING, message)]
    if data_keys and not admin_keys:
        message = (
            "PROXY_API_KEYS without PROXY_ADMIN_KEYS: control-plane endpoints (adapter load, "
            "pause, resume) refuse every caller with 403"
        )
        lines.append((logging.WARNING, message))
    if adapter_roots:
        lines.append((logging.INFO, f"adapters may be loaded from: {', '.join(adapter_roots)}"))
    else:
        message = "PROXY_ADAPTER_ROOTS is not set: any lora_path is passed to the replicas"
        lines.append((logging.INFO if local else logging.WARNING, message))
    if upstream_insecure:
        message = "PROXY_UPSTREAM_INSECURE=true: replicas' TLS certificates are NOT verified"
        lines.append((logging.WARNING, message))
    return lines
