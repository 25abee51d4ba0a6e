"""The data plane's upstream client: one POST per completion, relayed back to the client.

Three implementations behind one small interface (``Relay.post`` -> ``Reply``):

* ``LeanPool`` (default, ``PROXY_UPSTREAM_TRANSPORT=lean``, proxy/pool.py): a keep-alive pool on
  asyncio + httptools, chosen by measurement (issue 12: 54-58 us CPU per request for a bare
  pass-through with it, 192 with aiohttp; bench/results/overhead.md re-measures both).
* ``AiohttpRelay`` (``PROXY_UPSTREAM_TRANSPORT=aiohttp``): aiohttp's ``ClientSession``
  directly, the previous default.
* ``HttpxRelay`` (``PROXY_UPSTREAM_TRANSPORT=httpx``, or when tests inject a transport): the
  shared ``httpx.AsyncClient``. The control plane and the probes always use httpx
  (``Upstream``): they are not hot, and their code reads better with it.

All three classify failures exactly like upstream.py: nothing sent (``ReplicaUnreachable``),
sent but broken (``ReplicaBroken``), or silent too long (``UpstreamTimeout``).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol

import aiohttp
import httpx

from proxy.errors import UpstreamTimeout
from proxy.pool import LeanPool
from proxy.settings import Settings
from proxy.upstream import ReplicaBroken, ReplicaUnreachable, Upstream, upstream_headers

# aiohttp's pool: no global cap (TRL's max_inflight_tasks decides concurrency, and a cap here
# would queue rollouts invisibly); idle connections kept 60 s, longer than any gap between
# rollouts, shorter than typical load-balancer idle timeouts in front of replicas.
KEEPALIVE_S = 60.0


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


# -- aiohttp ---------------------------------------------------------------------------------


class _AiohttpReply:
    __slots__ = ("_response", "body", "headers", "status")
    released = False

    def __init__(self, response: aiohttp.ClientResponse, body: bytes) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self.body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def close(self) -> None:
        self._response.release()


class AiohttpRelay:
    def __init__(self, settings: Settings, verify: ssl.SSLContext | bool) -> None:
        self.settings = settings
        self.verify = verify
        self.headers = upstream_headers(settings)
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.upstream_timeout_s,
        )
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # aiohttp binds its session to the running loop: create it in the app's lifespan.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, ssl=self.verify)
        self.session = aiohttp.ClientSession(
            connector=connector,
            headers=self.headers,
            timeout=self.timeout,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Reply:
        assert self.session is not None, "AiohttpRelay.start() was not awaited"
        what = f"POST {path}"
        try:
            response = await self.session.post(base_url + path, data=content, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            raise ReplicaUnreachable(
                f"replica {replica} unreachable for {what}: {type(exc).__name__}"
            ) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(f"replica {replica} timed out on {what}") from exc
        except aiohttp.ClientError as exc:
            raise ReplicaBroken(
                f"replica {replica} failed during {what}: {type(exc).__name__}"
            ) from exc
        if stream:
            return _AiohttpReply(response, b"")
        try:
            body = await response.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            response.release()
            raise UpstreamTimeout(f"replica {replica} timed out on {what}") from exc
        except aiohttp.ClientError as exc:
            response.release()
            raise ReplicaBroken(
                f"replica {replica} failed during {what}: {type(exc).__name__}"
            ) from exc
        return _AiohttpReply(response, body)


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


def make_relay(
    settings: Settings, upstream: Upstream, verify: ssl.SSLContext | bool, injected_transport: bool
) -> Relay:
    if injected_transport:
        return HttpxRelay(upstream)  # tests' in-process replicas: only httpx can reach them
    if settings.upstream_transport == "lean":
        return LeanPool(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.upstream_timeout_s,
            ssl_context=verify,
            fixed_headers=upstream_headers(settings),
        )
    if settings.upstream_transport == "aiohttp":
        return AiohttpRelay(settings, verify)
    return HttpxRelay(upstream)
