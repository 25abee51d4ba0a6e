"""Ports picked at run time, for servers that tests, benchmarks and scripts start."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out on ``host``; the caller's server binds it right after
    (another process could take it in between, which a test on 127.0.0.1 does not race with)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
