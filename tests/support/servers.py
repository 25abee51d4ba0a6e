"""Run ASGI apps over real HTTP on 127.0.0.1 with an OS-picked port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    """uvicorn in a daemon thread. ``url`` is valid once ``start()`` returns."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="auto", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def kill(self) -> None:
        """Stop abruptly: in-flight connections are dropped (a crashed replica)."""
        self.server.force_exit = True
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
