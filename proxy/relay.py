"""The data plane's upstream client: one POST per completion, relayed back to the client.

One small interface (``Relay.post`` -> ``Reply``), like httpx's transport interface:

* ``LeanPool`` (proxy/pool.py): the keep-alive pool on asyncio + httptools that serves every
  completion (docs/decisions/ says why it replaced a general-purpose client).
* ``HttpxRelay``: the shared ``httpx.AsyncClient`` over a transport the caller injects
  (``create_app(settings, transport)``: tests' and the simulator's in-process replicas, which
  only httpx can reach). Not a setting: the product always runs the lean pool.

Both classify failures exactly like upstream.py: nothing sent (``ReplicaUnreachable``), sent but
broken (``ReplicaBroken``), or silent too long (``UpstreamTimeout``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol

import httpx

from proxy.pool import LeanPool
from proxy.settings import Settings
from proxy.upstream import Upstream, tls_verify, upstream_headers


class Reply(Protocol):
    status: int
    body: bytes  # empty for a streamed reply
    # True once ``close()`` has nothing left to do (the lean pool's buffered replies give their
    # connection back as soon as the body is in): the data plane then skips awaiting it.
    released: bool

    @property
    def headers(self) -> Mapping[str, str]: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def close(self) -> None: ...


class Relay(Protocol):
    async def start(self) -> None: ...

    # A coroutine function, or (the lean pool) a function that returns its coroutine.
    def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Awaitable[Reply]: ...

    async def aclose(self) -> None: ...


# -- httpx ------------------------------------------------------------------------------------


class _HttpxReply:
    __slots__ = ("_response", "body", "headers", "status")
    released = False

    def __init__(self, response: httpx.Response, body: bytes) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: Mapping[str, str] = response.headers
        self.body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_raw():
            yield chunk

    async def close(self) -> None:
        await self._response.aclose()


class HttpxRelay:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None  # the shared client belongs to Upstream

    async def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Reply:
        if stream:
            response = await self.upstream.open_stream(replica, base_url, path, content, headers)
            return _HttpxReply(response, b"")
        response = await self.upstream.call(
            replica, base_url, "POST", path, content=content, headers=headers
        )
        return _HttpxReply(response, response.content)


def make_relay(settings: Settings, upstream: Upstream, injected_transport: bool) -> Relay:
    if injected_transport:
        return HttpxRelay(upstream)  # in-process replicas: only httpx can reach them
    return LeanPool(
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.upstream_timeout_s,
        ssl_context=tls_verify(settings),
        fixed_headers=upstream_headers(settings),
    )
