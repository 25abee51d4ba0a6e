"""Checks shared by the settings (at start-up) and the security modules (per request); a leaf
of the import graph, so ``proxy.settings`` does not depend on ``proxy.security``."""

from __future__ import annotations

import ipaddress
import posixpath

# Shortest inbound key accepted: a guessable key defeats constant-time comparison;
# ``secrets.token_urlsafe(32)`` gives 43 characters.
MIN_KEY_CHARS = 16


def normalize_root(root: str) -> str:
    """An allow-list root in canonical form; raises ValueError when it is not absolute."""
    root = root.strip()
    if not root.startswith("/"):
        raise ValueError(f"adapter root {root!r} must be an absolute path")
    if has_control(root):
        raise ValueError("adapter roots must not contain control characters")
    return normpath(root)


def has_control(text: str) -> bool:
    """Whether ``text`` holds an ASCII control character (C0 or DEL): refused in paths, which
    reach logs, replicas' file systems and upstream URLs."""
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def normpath(path: str) -> str:
    # posixpath.normpath keeps a leading '//' (POSIX leaves its meaning to the implementation);
    # Linux treats it as '/', and so do we, so '//etc' cannot slip past a '/etc' comparison.
    normalized = posixpath.normpath(path)
    return "/" + normalized.lstrip("/")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
