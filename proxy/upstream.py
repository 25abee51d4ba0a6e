"""The one shared upstream HTTP client, and the translation of transport failures into the
proxy's error hierarchy (the only place httpx exceptions are caught).

Failures are classified by whether the request can have reached the replica:

* ``ReplicaUnreachable`` (``sent=False``): the TCP connection was never established. Nothing was
  processed, so the request may be retried on another replica, whatever it was.
* ``ReplicaBroken`` (``sent=True``): the connection dropped or a protocol error occurred after
  the request was written. Whether to retry is the caller's decision (see app.py's rule).
* ``UpstreamTimeout``: the replica went silent longer than the configured read timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from proxy.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.settings import Settings


class ReplicaUnreachable(UpstreamUnavailable):
    sent = False


class ReplicaBroken(UpstreamUnavailable):
    sent = True


def _never_connected(exc: httpx.TransportError) -> bool:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        cause = exc.__cause__
        if cause is None:
            return True
        # httpx-aiohttp maps every aiohttp.ClientConnectionError, including "server
        # disconnected" after the request was written, to ConnectTimeout; only a
        # ClientConnectorError (or a plain timeout while connecting) means nothing was sent.
        name = type(cause).__name__
        return name.startswith("ClientConnector") or name in (
            "ConnectionTimeoutError",
            "TimeoutError",
        )
    return False


def translate(
    exc: httpx.HTTPError, replica: int, what: str
) -> UpstreamUnavailable | UpstreamTimeout:
    """httpx exception -> proxy error. Messages name the replica, never headers or tokens."""
    if isinstance(exc, httpx.TransportError) and _never_connected(exc):
        return ReplicaUnreachable(f"replica {replica} unreachable for {what}: {type(exc).__name__}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"replica {replica} timed out on {what}")
    return ReplicaBroken(f"replica {replica} failed during {what}: {type(exc).__name__}")


def make_transport(settings: Settings) -> httpx.AsyncBaseTransport:
    # Keep-alive pool sized for TRL's max_inflight_tasks (hundreds of concurrent rollouts)
    # across a handful of replicas; connections beyond it are opened and closed as needed.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    if settings.upstream_transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        return AiohttpTransport(limits=limits)
    return httpx.AsyncHTTPTransport(limits=limits)


class Upstream:
    """Owns the shared ``httpx.AsyncClient`` (created in the app's lifespan)."""

    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None):
        self.settings = settings
        headers = {}
        if settings.upstream_token is not None:
            headers["authorization"] = f"Bearer {settings.upstream_token.get_secret_value()}"
        self.client = httpx.AsyncClient(
            transport=transport or make_transport(settings),
            headers=headers,
            timeout=httpx.Timeout(
                connect=settings.connect_timeout_s,
                read=settings.upstream_timeout_s,
                write=settings.upstream_timeout_s,
                pool=settings.connect_timeout_s,
            ),
            follow_redirects=False,
        )
        self.probe_timeout = httpx.Timeout(settings.probe_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def call(
        self,
        replica: int,
        base_url: str,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: Mapping[str, str] | str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        """A buffered request; transport failures raise proxy errors."""
        try:
            return await self.client.request(
                method,
                base_url + path,
                json=json,
                content=content,
                params=params,
                headers=headers,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise translate(exc, replica, f"{method} {path}") from exc

    async def open_stream(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
    ) -> httpx.Response:
        """Send a POST and return as soon as headers arrive; the caller streams the body and
        must close the response."""
        request = self.client.build_request(
            "POST", base_url + path, content=content, headers=headers
        )
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise translate(exc, replica, f"POST {path}") from exc
