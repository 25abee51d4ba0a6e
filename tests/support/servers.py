"""Run ASGI apps over real HTTP on 127.0.0.1 with an OS-picked port, in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import uvicorn


def _http(app: Any, front: bool) -> Any:
    """The proxy is served the way ``python -m proxy`` serves it (proxy/server.py): its
    completions from the protocol object; ``front=False`` serves them through uvicorn's own
    protocol and the ASGI app instead (the path any other server takes)."""
    if not front or getattr(getattr(app, "state", None), "rt", None) is None:
        return "auto"
    from proxy.server import http_protocol

    return http_protocol(app)


class ServerThread:
    """uvicorn in a daemon thread. ``url`` is valid once ``start()`` returns."""

    def __init__(self, app: Any, port: int = 0, front: bool = True) -> None:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says
        # TCP, and without it every small response waits ~40 ms for a delayed ACK (Nagle).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="auto",
            access_log=False,
            timeout_graceful_shutdown=5,
            http=_http(app, front),
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])

        asyncio.run(serve())

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

    def restart(self, app: Any) -> ServerThread:
        """A new server for ``app`` on the same port (a replica process coming back)."""
        return ServerThread(app, port=self.port).start()

    def kill(self) -> None:
        """Stop abruptly, like a crashed process: every open connection is reset (the kernel
        does that when a process dies), nothing in flight is answered."""
        if self.loop is not None and self.loop.is_running():

            def reset_all() -> None:
                # In one loop callback: stop accepting, then reset every connection, so no
                # connection can slip in between and be left open (and hang its client).
                for listener in getattr(self.server, "servers", []):
                    listener.close()
                for conn in list(self.server.server_state.connections):
                    transport = getattr(conn, "transport", None)
                    if transport is not None:
                        transport.abort()

            done = threading.Event()
            self.loop.call_soon_threadsafe(lambda: (reset_all(), done.set()))
            done.wait(timeout=5)
        self.server.force_exit = True
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
