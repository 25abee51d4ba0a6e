"""The data plane's upstream client: one POST per completion, relayed back to the client.

Two implementations behind one small interface (``Relay.post`` -> ``Reply``):

* ``AiohttpRelay`` (default, ``PROXY_UPSTREAM_TRANSPORT=aiohttp``): aiohttp's ``ClientSession``
  directly. Profiled under rollout traffic, httpx's request building (it re-parses the replica
  URL, merges default headers and cookies on every call) and its response wrapping cost about a
  sixth of the proxy's CPU per completion on top of the aiohttp transport underneath (see
  bench/results/overhead_profile.md). The control plane and the probes keep httpx (``Upstream``):
  they are not hot, and their code reads better with it.
* ``HttpxRelay`` (``PROXY_UPSTREAM_TRANSPORT=httpx``, or when tests inject a transport): the
  shared ``httpx.AsyncClient``.

Both classify failures exactly like upstream.py: nothing sent (``ReplicaUnreachable``), sent but
broken (``ReplicaBroken``), or silent too long (``UpstreamTimeout``).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp
import httpx

from proxy.errors import UpstreamTimeout
from proxy.settings import Settings
from proxy.upstream import ReplicaBroken, ReplicaUnreachable, Upstream, upstream_headers

# aiohttp's pool: no global cap (TRL's max_inflight_tasks decides concurrency, and a cap here
# would queue rollouts invisibly); idle connections kept 60 s, longer than any gap between
# rollouts, shorter than typical load-balancer idle timeouts in front of replicas.
KEEPALIVE_S = 60.0


class Reply(Protocol):
    status: int
    headers: Mapping[str, str]
    body: bytes  # empty for a streamed reply

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def close(self) -> None: ...


class Relay(Protocol):
    async def start(self) -> None: ...

    async def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Reply: ...

    async def aclose(self) -> None: ...


# -- aiohttp ---------------------------------------------------------------------------------


class _AiohttpReply:
    __slots__ = ("_response", "body", "headers", "status")

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
    if settings.upstream_transport == "aiohttp" and not injected_transport:
        return AiohttpRelay(settings, verify)
    return HttpxRelay(upstream)
