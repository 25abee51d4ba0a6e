"""The data path's upstream client: a small keep-alive HTTP/1.1 pool on ``asyncio.Protocol`` and
httptools' response parser (tests and the simulation reach in-process replicas through httpx
instead: fakes/httpx_relay.py).

Why not a library: the upstream client sets the floor of a Python relay, and general clients pay
for a request object model, a task per request and header multidicts on every call
(docs/decisions/lean-pool.md has the side-by-side figures). The relay needs only this: POST a body
it already holds, read one response, keep the connection for the next request. Control calls and
probes keep httpx (proxy/upstream.py).

What it handles, because real replicas do all of it:

* Content-Length, chunked (vLLM streams SSE chunked) and close-delimited bodies.
* Timeouts: connect (``PROXY_CONNECT_TIMEOUT_S``); read as the longest silence
  (``PROXY_UPSTREAM_TIMEOUT_S``, checked by one watchdog for all requests), not counted while the
  client is the slow side; idle keep-alive connections are dropped after ``IDLE_TIMEOUT_S``.
* A connection the replica closed between requests (vLLM's uvicorn closes idle keep-alive
  connections after 5 s): dropped when the close is seen, and when the close races the next
  request (nothing of a response arrived on a reused connection), that request is sent once more
  on a fresh connection. Completions have no side effect (dataplane.py's retry rule), so this is
  safe even if the replica had read the request.
* Back-pressure: a streamed body buffers at most ``HIGH_WATER`` bytes; beyond that the upstream
  socket stops being read until the client side has taken the buffer (the ASGI server's
  ``send`` waits while the client's socket buffer is full), so a slow client slows its replica
  stream instead of growing the proxy's memory.
* TLS with the same SSL context as every other client (proxy/upstream.py's ``tls_verify``).
* Failures classified for the retry rule as proxy/upstream.py classifies httpx's, an
  unreachable replica worded by the same helper.

No task and no closure per request: a request is one ``transport.write`` and one future per
wait. Each connection keeps one httptools parser for all its responses (llhttp frames the next
message of a keep-alive connection by itself) and is the parser's callback object: it fills the
reply in flight, so a request creates no parser and no extra frame per callback.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from proxy.errors import UpstreamTimeout
from proxy.settings import Settings
from proxy.upstream import ReplicaBroken, tls_verify, unreachable, upstream_headers

# Idle keep-alive connections are closed after 60 s: longer than any gap between a trainer's
# rollouts, shorter than typical load-balancer idle timeouts in front of replicas (the value the
# aiohttp relay used).
IDLE_TIMEOUT_S = 60.0
# Idle connections kept per replica. 512: TRL's max_inflight_tasks is a few hundred rollouts,
# all of which may land on one replica; more than that are opened and closed as needed (the
# value httpx's pool used here).
MAX_IDLE_PER_ORIGIN = 512
# A streamed body stops being read from the replica once this much waits for the client:
# 64 KiB, asyncio's own default high-water mark for a transport's write buffer; a token's SSE
# event is ~200 bytes, so this never throttles a client that keeps up.
HIGH_WATER = 64 * 1024
# Response headers the data path looks at (relayed, or deciding the body's framing); the rest
# are dropped without being decoded.
KEPT_HEADERS = frozenset({b"content-type", b"x-request-id", b"cache-control"})
FRAMING_HEADERS = frozenset({b"content-length", b"transfer-encoding"})
# A request body shorter than this leaves in the same write as the head (one syscall; a TRL
# rollout body is ~3.5 KiB); a longer one is written on its own rather than copied into a join.
JOIN_BELOW = 64 * 1024
# Request lines (method, path, host, fixed headers) kept ready per replica origin: the data plane
# posts to two paths, 16 leaves room for any other caller without letting one grow the cache.
MAX_REQUEST_LINES = 16


class Reply(Protocol):
    """What the data plane reads of an upstream answer (``LeanReply``, or a test's stand-in)."""

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
    """The data plane's upstream client: ``LeanPool``, or (``create_app``'s ``make_relay``) one
    that reaches in-process replicas through the injected httpx transport."""

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


class _Lost(Exception):
    """The connection ended before a byte of the response arrived (maybe a stale keep-alive)."""


class Origin:
    """One replica's address, its request-head prefix and its idle connections."""

    __slots__ = ("host", "idle", "lines", "port", "prefix", "server_hostname", "ssl")

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None, fixed: bytes) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if https else 80)
        self.ssl = ssl_context if https else None
        self.server_hostname = self.host if https else None
        # Every request to this origin starts "POST <path> HTTP/1.1\r\nhost: ...\r\n<fixed>".
        self.prefix = b"\r\nhost: " + parts.netloc.encode("idna") + b"\r\n" + fixed
        self.idle: list[Connection] = []
        self.lines: dict[str, bytes] = {}  # request_line's, by path

    def request_line(self, path: str) -> bytes:
        """``POST <path> HTTP/1.1``, the host and the fixed headers, built once per path (the
        data plane posts to two; any other caller's paths are bounded by MAX_REQUEST_LINES)."""
        line = self.lines.get(path)
        if line is None:
            if len(self.lines) >= MAX_REQUEST_LINES:
                self.lines.clear()
            line = self.lines[path] = b"POST " + path.encode("ascii") + b" HTTP/1.1" + self.prefix
        return line


class Connection(asyncio.Protocol):
    """One keep-alive connection; serves one reply at a time."""

    def __init__(self, pool: LeanPool, origin: Origin) -> None:
        self.pool = pool
        self.loop = pool.loop  # (the pool's is a property: read per request otherwise)
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.reply: LeanReply | None = None
        self.closed = False
        self.served = 0
        self.idle_since = 0.0
        self.paused = False
        self.parser = httptools.HttpResponseParser(self)
        # A second response began in bytes that followed a complete one: nothing asked for it,
        # so the connection cannot frame the next response and is not reused.
        self.garbled = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's, under uvicorn, is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:
            # Bytes on an idle connection: nothing asked for them; the connection cannot be
            # trusted to frame the next response.
            self.abort()
            return
        reply.received = True
        reply.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            reply.fail(ReplicaBroken(f"{reply.what}: invalid HTTP response ({exc})"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.conns.discard(self)
        reply = self.reply
        if reply is not None and not reply.complete:
            reply.on_connection_lost()

    # -- httptools callbacks: they run inside feed_data, so ``reply`` is the one in flight ----

    def on_message_begin(self) -> None:
        reply = self.reply
        if reply is None or reply.complete:
            self.garbled = True

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in KEPT_HEADERS:
            reply = self.reply
            assert reply is not None
            reply.headers[name.decode("latin-1")] = value.decode("latin-1")
        elif name in FRAMING_HEADERS:
            reply = self.reply
            assert reply is not None
            reply.framed = True

    def on_headers_complete(self) -> None:
        reply = self.reply
        assert reply is not None  # (not typing.cast: a call per callback)
        reply.status = self.parser.get_status_code()
        reply.headers_done = True
        if reply.stream:
            reply._wake()

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        assert reply is not None
        reply._chunks.append(body)
        reply.buffered += len(body)
        if reply.stream:
            if reply.buffered > HIGH_WATER:
                self.pause()
            reply._wake()

    def on_message_complete(self) -> None:
        reply = self.reply
        assert reply is not None
        reply.complete = True
        reply.keep_alive = self.parser.should_keep_alive()
        if not reply.stream:
            chunks = reply._chunks
            reply.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        reply._wake()

    # -- pool side -----------------------------------------------------------------------------

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()


class LeanReply:
    """The response to one request: status, the kept headers, then the body (buffered, or
    streamed through ``chunks()``), filled by its connection's parser callbacks."""

    __slots__ = (
        "_chunks",
        "_waiter",
        "body",
        "buffered",
        "complete",
        "conn",
        "error",
        "framed",
        "headers",
        "headers_done",
        "keep_alive",
        "last_data",
        "pool",
        "received",
        "released",
        "replica",
        "request_path",
        "status",
        "stream",
    )

    def __init__(
        self, pool: LeanPool, conn: Connection, stream: bool, replica: int, path: str
    ) -> None:
        self.pool = pool
        self.conn = conn
        self.stream = stream
        self.replica = replica  # for error messages (``what``), built only when one is
        self.request_path = path
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self._chunks: list[bytes] = []
        self.buffered = 0
        self.headers_done = False
        self.framed = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.released = False  # close() has nothing left to do (the data plane skips it)
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # Silence is measured from here until the answer is complete or failed (the pool's
        # watchdog looks at every connection's reply in flight).
        self.last_data = conn.loop.time()

    @property
    def what(self) -> str:
        return _what(self.replica, self.request_path)

    # -- events from the connection --------------------------------------------------------------

    def on_connection_lost(self) -> None:
        if self.headers_done and not self.framed:
            # Neither a length nor chunked: the body is whatever came before the close
            # (httptools has no end-of-input call to say so).
            self.conn.on_message_complete()
            self.keep_alive = False
            return
        if not self.received:
            self.fail(_Lost())
        else:
            self.fail(ReplicaBroken(f"{self.what}: the replica closed the connection mid-answer"))

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    def time_out(self) -> None:
        self.fail(
            UpstreamTimeout(
                f"{self.what} timed out: the replica was silent longer than "
                "PROXY_UPSTREAM_TIMEOUT_S"
            )
        )
        self.conn.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self.pool.loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    # -- the caller's side -------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[bytes]:
        """The streamed body as it arrives; raises ReplicaBroken / UpstreamTimeout when the
        replica fails mid-stream."""
        while True:
            if self._chunks:
                taken, self._chunks, self.buffered = self._chunks, [], 0
                self.conn.resume()
                for chunk in taken:
                    yield chunk
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    async def close(self) -> None:
        self.release()

    def release(self) -> None:
        """Give the connection back (reusable only after a complete, keep-alive answer)."""
        self.released = True
        conn = self.conn
        if conn.reply is not self:
            return
        conn.reply = None
        if self.complete and self.keep_alive and not conn.closed and not conn.garbled:
            conn.resume()
            self.pool.keep(conn)
        else:
            conn.abort()


class LeanPool:
    """Keep-alive connections per replica origin; ``post`` sends one request."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        ssl_context: ssl.SSLContext | bool,
        fixed_headers: Mapping[str, str],
        idle_timeout: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        if isinstance(ssl_context, bool):  # False: PROXY_UPSTREAM_INSECURE
            verify, ssl_context = ssl_context, ssl.create_default_context()
            if not verify:
                ssl_context.check_hostname = False
                ssl_context.verify_mode = ssl.CERT_NONE
        self.ssl = ssl_context
        self.fixed = _header_lines(fixed_headers)
        self.origins: dict[str, Origin] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        # Read timeouts: one watchdog for every reply in flight rather than a timer armed and
        # cancelled per request. It looks every quarter of the timeout, at most every second, so
        # silence is cut off between read_timeout and read_timeout + that period (900 s + 1 s by
        # default). It walks the open connections (registered once each, when opened) rather
        # than a set of replies that every request would join and leave: a few hundred
        # connections a second cost less than an add and a discard per request.
        self.conns: set[Connection] = set()
        self.watch_every = min(1.0, read_timeout / 4)
        self._watchdog: asyncio.TimerHandle | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> LeanPool:
        return cls(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.upstream_timeout_s,
            ssl_context=tls_verify(settings),
            fixed_headers=upstream_headers(settings),
        )

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _arm_watchdog(self) -> None:
        if self._watchdog is None and not self.closing:
            self._watchdog = self.loop.call_later(self.watch_every, self._look_for_silence)

    def _look_for_silence(self) -> None:
        self._watchdog = None
        now = self.loop.time()
        for conn in list(self.conns):
            reply = conn.reply
            if reply is None or reply.complete or reply.error is not None:
                continue  # idle, or its answer is in (or failed): nothing to wait for
            if conn.paused:
                # The client is the slow side: the replica is waiting on us, not silent.
                reply.last_data = now
            elif now - reply.last_data >= self.read_timeout:
                reply.time_out()
        if self.conns:
            self._arm_watchdog()

    def origin(self, base_url: str) -> Origin:
        origin = self.origins.get(base_url)
        if origin is None:
            origin = self.origins[base_url] = Origin(base_url, self.ssl, self.fixed)
        return origin

    def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Coroutine[None, None, LeanReply]:
        """Send ``POST path`` with ``content``; the awaited reply is returned once the status
        and headers arrived (``stream``) or the whole body did. The caller must ``close()`` the
        reply (a no-op, ``released``, for a buffered one).

        Not a coroutine itself: it returns ``_exchange``'s, so that a request runs one coroutine
        frame in the pool rather than two (every resumption of a request walks its frames)."""
        origin = self.origin(base_url)
        head = b"".join(
            (
                origin.request_line(path),
                _header_lines(headers),
                b"content-length: %d\r\n\r\n" % len(content),
            )
        )
        return self._exchange(origin, self._idle(origin), head, content, stream, replica, path)

    async def _exchange(
        self,
        origin: Origin,
        conn: Connection | None,
        head: bytes,
        content: bytes,
        stream: bool,
        replica: int,
        path: str,
    ) -> LeanReply:
        """One request on ``conn`` (an idle connection, or None: a new one), and once more on a
        new connection when a reused one turns out closed by the replica before answering."""
        fresh = conn is None
        if conn is None:
            conn = await self._connect(origin, replica, path)
        while True:
            reply = LeanReply(self, conn, stream, replica, path)
            conn.reply = reply
            assert conn.transport is not None
            if len(content) < JOIN_BELOW:
                conn.transport.write(head + content)
            else:
                conn.transport.write(head)
                conn.transport.write(content)
            # The wait is written out here rather than through until_headers / until_complete
            # and _wait: two coroutine frames less per request, on every request.
            try:
                while not (reply.headers_done if stream else reply.complete):
                    if reply.error is not None:
                        raise reply.error
                    waiter = reply._waiter = conn.loop.create_future()
                    await waiter
            except BaseException as exc:
                # Failed or cancelled (the client left): this connection's state is unknown.
                reply.release()
                conn.abort()
                if not isinstance(exc, _Lost):
                    raise
                if fresh:
                    raise ReplicaBroken(
                        f"{_what(replica, path)}: the replica closed the connection before "
                        "answering"
                    ) from None
                fresh = True
            else:
                if not stream:
                    reply.release()
                return reply
            # The replica closed it as we reused it: once more, on a new connection.
            conn = await self._connect(origin, replica, path)

    def _idle(self, origin: Origin) -> Connection | None:
        idle = origin.idle
        expired_before = self.loop.time() - self.idle_timeout
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if conn.idle_since < expired_before:
                conn.abort()
                continue
            return conn
        return None

    def keep(self, conn: Connection) -> None:
        idle = conn.origin.idle
        if self.closing or len(idle) >= MAX_IDLE_PER_ORIGIN:
            conn.abort()
            return
        conn.served += 1
        conn.idle_since = self.loop.time()
        idle.append(conn)

    async def _connect(self, origin: Origin, replica: int, path: str) -> Connection:
        conn = Connection(self, origin)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self.loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.server_hostname,
                )
        except OSError as exc:  # (TimeoutError and ssl.SSLError included)
            raise unreachable(replica, f"POST {path}", exc) from exc
        if not conn.closed:  # (lost already: nothing to watch)
            self.conns.add(conn)
            self._arm_watchdog()
        return conn

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def aclose(self) -> None:
        self.closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for origin in self.origins.values():
            while origin.idle:
                origin.idle.pop().abort()


def _what(replica: int, path: str) -> str:
    return f"replica {replica} POST {path}"


def _header_lines(headers: Mapping[str, str]) -> bytes:
    """``headers`` as request header lines, built, checked and encoded as one string rather
    than line by line (the data plane sends two per request, one of them its X-Request-Id): a
    CR or LF inside a name or value would add one to the counts, which must be one per line."""
    text = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if text.count("\n") != len(headers) or text.count("\r") != len(headers):
        broken = [
            name for name, value in headers.items() if "\r" in name + value or "\n" in name + value
        ]
        raise ValueError(f"header {broken[0]!r} contains a line break")
    return text.encode("latin-1")
