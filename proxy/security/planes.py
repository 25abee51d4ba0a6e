"""Which plane (open, data, admin) a request path belongs to, and whether the path is in the
canonical form the plane check relies on (docs/security.md)."""

from __future__ import annotations

import re
from enum import Enum

from proxy.checks import has_control

OPEN_PATHS = frozenset({"/health", "/livez", "/metrics"})
ADMIN_PATHS = frozenset(
    {
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/pause",
        "/resume",
        "/reset_prefix_cache",
        # TRL's merged-weight (NCCL) sync: world size probe and the transfer itself
        "/get_world_size",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)
ADMIN_PREFIX = "/admin"


class Plane(Enum):
    OPEN = "open"
    DATA = "data"
    ADMIN = "admin"


def classify(path: str) -> Plane:
    """The plane of a (canonical) request path. Unknown paths are data plane: with keys
    configured an anonymous caller gets 401 for them, not a 404 that maps the routes."""
    if path in OPEN_PATHS:
        return Plane.OPEN
    if path in ADMIN_PATHS or path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
        return Plane.ADMIN
    return Plane.DATA


# Segments of letters, digits, '_' and '-', optionally joined by single '.' or '~' inside a
# segment: no '.'/'..' segment, no empty segment, no trailing '/', nothing percent-encoded.
_PLAIN_PATH = re.compile(r"/|(?:/[A-Za-z0-9_-]+(?:[.~][A-Za-z0-9_-]+)*)+")


def path_problem(path: str, raw_path: bytes | None = None) -> str | None:
    """Why ``path`` is not in canonical form, or None. Refused rather than normalised, so the
    proxy, Starlette and the replica all see the same path (docs/security.md)."""
    if _PLAIN_PATH.fullmatch(path) and (raw_path is None or raw_path == path.encode()):
        return None  # the common case (every path TRL and OpenAI clients use), one regex
    if not path.startswith("/"):
        return "the request path must start with '/'"
    if has_control(path):
        return "the request path contains control characters"
    if "\\" in path:
        return "the request path contains a backslash"
    if any(c in path for c in "?#%"):
        # Only reachable percent-encoded (or double-encoded): httpx would re-read them as a
        # query, a fragment or an escape when it builds the upstream URL.
        return "the request path contains an encoded '?', '#' or '%'"
    segments = path.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return "the request path contains '.' or '..' segments"
    if any(not s for s in segments[:-1]):
        return "the request path contains an empty segment ('//')"
    if len(path) > 1 and path.endswith("/"):
        return "the request path ends with '/'"
    if raw_path is not None:
        lowered = raw_path.lower()
        if b"%2f" in lowered or b"%5c" in lowered:
            return "the request path contains an encoded '/' or '\\'"
    return None
