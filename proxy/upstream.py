"""The one shared upstream HTTP client (control calls and probes), and the translation of
transport failures into the proxy's error hierarchy, for it and for the lean pool (proxy/pool.py).

Failures are classified by whether the request can have reached the replica:

* ``ReplicaUnreachable`` (``sent=False``): the TCP connection was never established. Nothing was
  processed, so the request may be retried on another replica, whatever it was.
* ``ReplicaBroken`` (``sent=True``): the connection dropped or a protocol error occurred after
  the request was written. Whether to retry is the caller's decision (see dataplane.py's rule).
* ``UpstreamTimeout``: the replica went silent longer than the configured read timeout.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

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


def _tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind a failed connection, if that is what it was (both transports wrap
    it two levels deep)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def unreachable(replica: int, what: str, cause: Exception) -> ReplicaUnreachable:
    """Nothing was sent, because of ``cause`` (for httpx and the lean pool alike): a connect
    timeout, a failed TLS handshake, or the exception's name."""
    if isinstance(cause, ssl.SSLError):
        # No request (and no token) was sent. Say why, since "unreachable" alone sends an
        # operator looking at the network; the words are the handshake's own ("certificate
        # verify failed: ...").
        reason = getattr(cause, "verify_message", None) or getattr(cause, "reason", None)
        why = f"TLS handshake failed ({reason or 'error'}); see PROXY_UPSTREAM_CA_BUNDLE"
    elif isinstance(cause, TimeoutError):
        why = "ConnectTimeout"  # (asyncio's, in the lean pool: named as httpx names it)
    else:
        why = type(cause).__name__
    return ReplicaUnreachable(f"replica {replica} unreachable for {what}: {why}")


def translate(
    exc: httpx.HTTPError, replica: int, what: str
) -> UpstreamUnavailable | UpstreamTimeout:
    """httpx exception -> proxy error. Messages name the replica, never headers or tokens."""
    tls = _tls_failure(exc) if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) else None
    if tls is not None or (isinstance(exc, httpx.TransportError) and _never_connected(exc)):
        return unreachable(replica, what, tls or exc)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"replica {replica} timed out on {what}")
    return ReplicaBroken(f"replica {replica} failed during {what}: {type(exc).__name__}")


def tls_verify(settings: Settings) -> ssl.SSLContext | bool:
    """What every upstream client (the lean pool, httpx on httpx-aiohttp) gets as ``verify``:
    a context trusting only PROXY_UPSTREAM_CA_BUNDLE when set; otherwise httpx's default one
    (certifi's bundle, SSL_CERT_FILE / SSL_CERT_DIR honoured), so that both clients trust the
    same CAs; False only with the explicit PROXY_UPSTREAM_INSECURE. Never a path string
    (deprecated in httpx 0.28). Hostname checking stays on in both contexts."""
    if settings.upstream_insecure:
        return False
    if settings.upstream_ca_bundle:
        return ssl.create_default_context(cafile=settings.upstream_ca_bundle)
    return httpx.create_ssl_context()


def make_transport(settings: Settings) -> httpx.AsyncBaseTransport:
    """Control calls and probes: httpx on httpx-aiohttp (a fraction of the CPU per call of
    httpx's own transport; probes are steady: every replica, every PROXY_HEALTH_INTERVAL_S).
    The keep-alive pool is sized for TRL's hundreds of concurrent rollouts."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    transport = AiohttpTransport(limits=limits, verify=tls_verify(settings))

    def session() -> aiohttp.ClientSession:
        # httpx-aiohttp's own session (same connector, aiohttp's default limit of 100), except
        # for the cookie jar: aiohttp's default one would replay cookies a replica sets on every
        # later request through the shared client.
        connector = aiohttp.TCPConnector(
            keepalive_timeout=limits.keepalive_expiry,
            ssl=transport.ssl_context,
            limit=limits.max_connections or 100,
        )
        return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    transport.client = session  # called lazily, inside the event loop
    return transport


def upstream_headers(settings: Settings) -> dict[str, str]:
    """Headers every upstream request carries: the token, and nothing of the client's."""
    if settings.upstream_token is None:
        return {}
    return {"authorization": f"Bearer {settings.upstream_token.get_secret_value()}"}


class Upstream:
    """Owns the shared ``httpx.AsyncClient`` (created in the app's lifespan)."""

    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None):
        self.settings = settings
        headers = upstream_headers(settings)
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
            # One client serves every caller: a cookie one replica set must not ride along on
            # later requests (another client's, or a broadcast). The jar accepts none.
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
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
