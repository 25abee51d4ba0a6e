"""The floor for a Python proxy: a bare ASGI app on uvicorn that forwards each POST to the next
backend (round robin) with one shared aiohttp session, and relays status and body. No routing,
no validation, no metrics: what uvicorn + aiohttp alone cost per request on this machine, to read
rollout-proxy's overhead against (run_overhead's ``py-floor`` target).

    python -m bench.passthrough --port 8000 --backends http://127.0.0.1:8001,http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import aiohttp

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Passthrough:
    def __init__(self, backends: Sequence[str]) -> None:
        if not backends:
            raise ValueError("at least one backend URL")
        self._next = itertools.cycle(backends)
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    connector = aiohttp.TCPConnector(limit=0)
                    self._session = aiohttp.ClientSession(connector=connector)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._session is not None:
                        await self._session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http" and self._session is not None
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        url = next(self._next) + scope["path"]
        headers = {"Content-Type": "application/json"}
        async with self._session.request(
            scope["method"], url, data=b"".join(chunks), headers=headers
        ) as resp:
            body = await resp.read()
            out_headers = [(b"content-type", resp.headers.get("Content-Type", "").encode())]
            await send(
                {"type": "http.response.start", "status": resp.status, "headers": out_headers}
            )
            await send({"type": "http.response.body", "body": body})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backends", required=True, help="comma-separated base URLs")
    args = p.parse_args(argv)
    import uvicorn

    app = Passthrough([u.strip().rstrip("/") for u in args.backends.split(",") if u.strip()])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
