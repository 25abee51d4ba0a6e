"""The floor for a Python proxy: a bare ASGI app on uvicorn that forwards each POST to the next
backend (round robin) and relays status and body. No routing, no validation, no metrics: what
uvicorn plus an upstream client alone cost per request on this machine, to read rollout-proxy's
overhead against (run_overhead's ``floor`` and ``floor-aiohttp`` targets).

    python -m bench.harness.passthrough --port 8000 --backends http://127.0.0.1:8001,http://127.0.0.1:8002
    python -m bench.harness.passthrough --client aiohttp ...   # one shared aiohttp session instead

``--client lean`` (default) uses the proxy's own upstream client (proxy/pool.py), so the floor
moves with it; ``aiohttp`` is the previous floor. ``--front protocol`` serves the POSTs the way
rollout-proxy serves completions by default (proxy/front.py: from uvicorn's protocol object,
no ASGI messages) with the lean client: the floor of the proxy's own architecture
(run_overhead's ``floor-protocol``), so what rollout-proxy costs above it is its routing,
validation and bookkeeping alone. ``--front min`` is bench/harness/minrelay.py: the least a Python
relay can do (``floor-min``), the yardstick for the front and client themselves.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from proxy.hotpath import WholeAnswer

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# (base URL, path, body) -> (status, content type, body)
Forward = Callable[[str, str, bytes], Awaitable[tuple[int, bytes, bytes]]]

JSON_HEADERS = {"content-type": "application/json"}


class Passthrough:
    def __init__(self, backends: Sequence[str], client: str = "lean") -> None:
        if not backends:
            raise ValueError("at least one backend URL")
        if client not in ("lean", "aiohttp"):
            raise ValueError(f"unknown client {client!r}")
        self.client = client
        self._next = itertools.cycle(backends)
        self._forward: Forward | None = None
        self._close: Callable[[], Awaitable[None]] | None = None

    async def _start(self) -> None:
        if self.client == "lean":
            from proxy.pool import LeanPool

            pool = LeanPool(connect_timeout=5, read_timeout=60, ssl_context=True, fixed_headers={})

            async def forward_lean(base: str, path: str, body: bytes) -> tuple[int, bytes, bytes]:
                reply = await pool.post(0, base, path, body, JSON_HEADERS, stream=False)
                return reply.status, reply.headers.get("content-type", "").encode(), reply.body

            self._forward, self._close = forward_lean, pool.aclose
            return
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def forward_aiohttp(base: str, path: str, body: bytes) -> tuple[int, bytes, bytes]:
            async with session.post(base + path, data=body, headers=JSON_HEADERS) as resp:
                data = await resp.read()
                return resp.status, resp.headers.get("Content-Type", "").encode(), data

        self._forward, self._close = forward_aiohttp, session.close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self._start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._close is not None:
                        await self._close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http" and self._forward is not None
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        status, ctype, body = await self._forward(next(self._next), scope["path"], b"".join(chunks))
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class RoundRobinPath:
    """What proxy/front.py needs of a data path (``guard``, ``respond``, ``error``), doing
    nothing but forwarding to the next backend with the lean client."""

    def __init__(self, backends: Sequence[str]) -> None:
        from proxy.pool import LeanPool
        from proxy.security.guard import Guard
        from proxy.security.keys import KeyRing

        self._next = itertools.cycle(backends)
        self.pool = LeanPool(connect_timeout=5, read_timeout=60, ssl_context=True, fixed_headers={})
        self.guard = Guard(KeyRing(), max_body_bytes=2**26, max_header_bytes=2**16)

    async def respond(self, route: str, scope: Scope, raw: bytes, started: float) -> WholeAnswer:
        reply = await self.pool.post(0, next(self._next), scope["path"], raw, JSON_HEADERS, False)
        ctype = reply.headers.get("content-type", "").encode()
        body = reply.body
        return WholeAnswer(
            reply.status,
            [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
            body,
        )

    def error(self, route: str, exc: Exception) -> WholeAnswer:
        body = str(exc).encode()
        return WholeAnswer(500, [(b"content-length", str(len(body)).encode())], body)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.harness.passthrough", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backends", required=True, help="comma-separated base URLs")
    p.add_argument("--client", choices=("lean", "aiohttp"), default="lean")
    p.add_argument("--front", choices=("asgi", "protocol", "min", "min-routed"), default="asgi")
    args = p.parse_args(argv)
    import uvicorn

    backends = [u.strip().rstrip("/") for u in args.backends.split(",") if u.strip()]
    # The proxy's own collector settings (proxy/server.py), so floor and proxy compare alike.
    from proxy.server import settle_garbage_collector

    settle_garbage_collector()
    if args.front in ("min", "min-routed"):
        from bench.harness.minrelay import run

        run(args.port, backends, routed=args.front == "min-routed")
        return 0
    app = Passthrough(backends, args.client)
    http: Any = "auto"
    if args.front == "protocol":
        from proxy.front import front_protocol
        from proxy.shutdown import Shutdown

        http = front_protocol(RoundRobinPath(backends), Shutdown(5.0))  # type: ignore[arg-type]
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, http=http
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
