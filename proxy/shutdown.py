"""Graceful shutdown: what SIGTERM does to requests in flight (docs/reliability.md, Shutdown).

Kubernetes SIGKILLs after its grace period, so waiting for every request (uvicorn's default)
would leave rollouts reset with no word why: requests still running when
``PROXY_SHUTDOWN_GRACE_S`` ends are answered 503 instead. This module holds the state; the
server (proxy/server.py) drives it, ``ProxyApp`` registers every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from proxy.asgi import ASGIApp, Message, Receive, Scope, Send
from proxy.errors import ProxyError, UpstreamUnavailable
from proxy.security.guard import error_response_parts

log = logging.getLogger("rollout_proxy.shutdown")


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Stop a background task: cancel it and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Shutdown:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.draining = False
        self.running: set[asyncio.Task[Any] | None] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """Signal received: /health turns 503 from now on. Only sets a flag (safe to call from
        a signal handler)."""
        self.draining = True

    def start_grace(self) -> None:
        """The listener is closed: give the requests in flight ``grace_s`` to finish."""
        self.draining = True
        if self._timer is None:
            running = len([t for t in self.running if t is not None])
            log.info(
                "shutting down: %d request(s) in flight get up to %.0f s to finish "
                "(PROXY_SHUTDOWN_GRACE_S)",
                running,
                self.grace_s,
            )
            self._timer = asyncio.get_running_loop().call_later(self.grace_s, self.cut_all)

    def cut_all(self) -> None:
        """The grace period is over: cancel every request still running."""
        left = [t for t in self.running if t is not None and not t.done()]
        if left:
            log.warning(
                "shutting down: %d request(s) still running after %.0f s; answering them 503",
                len(left),
                self.grace_s,
            )
        for task in left:
            self._cut.add(task)
            task.cancel()

    def cut_short(self) -> bool:
        """Whether the current task's cancellation is the end of the grace period (then it is
        taken back: the request is answered instead of torn down). Called where it is caught."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    def error(self) -> ProxyError:
        return UpstreamUnavailable(
            f"the proxy is shutting down and this request did not finish within "
            f"{self.grace_s:g} s (PROXY_SHUTDOWN_GRACE_S); it was not answered by a replica: "
            "send it again (to another proxy, or this one once it is back)",
            status_code=503,
        )

    async def guarded(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run ``app`` for one request (FastAPI's routes); if the grace period ends it, answer
        503 when nothing was sent yet."""
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await app(scope, receive, tracking)
        except asyncio.CancelledError:
            if not self.cut_short():
                raise
            if not started:
                status, headers, body = error_response_parts(self.error())
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
