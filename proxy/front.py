"""Completions answered from uvicorn's HTTP protocol object, without ASGI in between.

Why. Per request, uvicorn's ASGI interface builds a ``RequestResponseCycle``, an
``asyncio.Event``, a task and the ASGI message dicts, and every ``receive``/``send`` is a
coroutine call: several times the CPU of the same relay written as protocol callbacks, on the one
route that carries every rollout (docs/decisions/front-protocol.md has the figures).

What. ``FrontProtocol`` is uvicorn's httptools protocol (``http=`` accepts a protocol class) with
its parser callbacks taken over for ``POST /v1/completions`` and ``POST /v1/chat/completions``
when the request line names them exactly: one task runs ``DataPath.respond`` (proxy/hotpath.py)
and writes the answer straight to the transport, in one write or chunked for a stream. Everything
else -- other routes, a query string, ``Expect: 100-continue``, an upgrade, a request pipelined
behind another -- goes to uvicorn unchanged, and so to FastAPI (or ``ProxyApp``'s own ASGI data
path, which answers exactly the same).

Kept from uvicorn and the ASGI path: keys, header/body limits (413 closes the connection, as the
rest of the body is not wanted), token masking, routing, retries, ``X-Proxy-Replica``,
``X-Request-Id``, metrics, logs, HTTP/1.0 and ``Connection: close``, the keep-alive timeout, the
server's ``date`` header, graceful shutdown (the request is registered like every other; a
connection with a request in flight is closed once it is answered), and answers in order on a
connection (a request pipelined behind a completion waits in uvicorn's own queue). One deliberate
difference: a client that disconnects cancels its request, which closes the upstream connection,
so vLLM aborts the generation instead of finishing it for nobody (the ASGI path does so only for
streams).

Keep-alive. uvicorn arms a ``call_later`` timer each time a connection falls idle and cancels it
when the next request arrives; ``FrontProtocol`` notes when a connection fell idle instead, and
one ``IdleSweep`` per server closes the connections idle longer than ``timeout_keep_alive``, never
earlier, which is what the timeout is for (clients close first). One sweep costs less CPU per
request than a timer per request (bench/results/overhead_profile.md).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.dataplane import RelayedStream
from proxy.errors import PayloadTooLarge, ProxyError
from proxy.hotpath import HOT_ROUTES, DataPath
from proxy.security.limits import too_large
from proxy.shutdown import Shutdown

log = logging.getLogger("rollout_proxy.front")

HOT_URLS: dict[bytes, str] = {path.encode(): route for path, route in HOT_ROUTES.items()}


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}

# An idle connection is closed at most timeout_keep_alive / KEEP_ALIVE_SWEEPS after its timeout:
# eight sweeps per timeout keep that slack at 12.5% (9.4 s of the proxy's 75 s), and a sweep of
# a few hundred connections every few seconds costs nothing next to a timer per request.
KEEP_ALIVE_SWEEPS = 8


class IdleSweep:
    """Closes one server's keep-alive connections that stayed idle past their deadline, with one
    timer for all of them (armed while any connection is idle)."""

    __slots__ = ("connections", "every", "handle", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: set[Any]) -> None:
        self.loop = loop
        self.connections = connections  # uvicorn's server_state.connections
        self.every = float("inf")  # lowered by each connection to its timeout / KEEP_ALIVE_SWEEPS
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.handle is None:
            self.handle = self.loop.call_later(self.every, self.sweep)

    def sweep(self) -> None:
        self.handle = None
        now = self.loop.time()
        idle_left = False
        for conn in list(self.connections):
            deadline = getattr(conn, "idle_deadline", None)  # None: busy, or not ours
            if deadline is None:
                continue
            if now >= deadline:
                conn.idle_deadline = None
                conn.timeout_keep_alive_handler()  # uvicorn's: closes it unless closing already
            else:
                idle_left = True
        if idle_left:
            self.arm()


def idle_sweep_for(server_state: Any, loop: asyncio.AbstractEventLoop) -> IdleSweep:
    """The server's sweep, made by its first connection (kept on uvicorn's per-server state)."""
    sweep: IdleSweep | None = getattr(server_state, "proxy_idle_sweep", None)
    if sweep is None:
        sweep = IdleSweep(loop, server_state.connections)
        server_state.proxy_idle_sweep = sweep
    return sweep


class _Hot:
    """One completion in flight on a connection."""

    __slots__ = ("chunks", "done", "keep_alive", "problem", "route", "scope", "size", "started")

    def __init__(self, route: str, scope: dict[str, Any], keep_alive: bool) -> None:
        self.route = route
        self.scope = scope
        self.keep_alive = keep_alive
        self.started = time.perf_counter()
        self.chunks: list[bytes] = []
        self.size = 0
        self.problem: ProxyError | None = None
        self.done = False  # answered already (refused before its body was read)


class FrontProtocol(HttpToolsProtocol):
    """uvicorn's protocol, serving completions itself (see the module docstring)."""

    data_path: ClassVar[DataPath]
    proxy_shutdown: ClassVar[Shutdown]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hot: _Hot | None = None  # the completion being read or answered
        self.reading_hot = False  # the parser's current message is ``hot``
        self.hot_task: asyncio.Task[None] | None = None
        # When this idle connection is closed (loop time); None while a request is being read
        # or answered. Replaces uvicorn's per-request timer (module docstring).
        self.idle_deadline: float | None = None
        self.idle_sweep: IdleSweep | None = None
        # uvicorn's default headers (date, server) as the bytes of an answer's head, and the
        # list they were joined from: uvicorn replaces that list when the date changes (once a
        # second), so a connection joins them at most once a second, not once per answer.
        self.defaults_from: list[tuple[bytes, bytes]] | None = None
        self.defaults_head = b""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sweep = self.idle_sweep = idle_sweep_for(self.server_state, self.loop)
        sweep.every = min(sweep.every, self.timeout_keep_alive / KEEP_ALIVE_SWEEPS)

    # -- keep-alive: a deadline per connection, one sweep per server ---------------------------

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn calls this when bytes arrive and when the connection ends.
        self.idle_deadline = None

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive deadline noted instead of a timer armed."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.idle_deadline = None
        if self.flow.read_paused:  # (resume_reading checks it too; a call less per request)
            self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_deadline = self.loop.time() + self.timeout_keep_alive
        sweep = self.idle_sweep
        if sweep is not None:
            sweep.arm()

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        """uvicorn's, less the ASGI scope: uvicorn builds it here (two dicts and a copy of the
        app's state per request), and a completion reads five of its keys. It is built once the
        request line is known: uvicorn's own for every other request (``_asgi_scope``), a small
        one for a completion."""
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _asgi_scope(self) -> None:
        """The scope uvicorn's ``on_message_begin`` builds, around what was read since."""
        url, expect, headers = self.url, self.expect_100_continue, self.headers
        super().on_message_begin()
        self.url, self.expect_100_continue, self.headers = url, expect, headers
        self.scope["headers"] = headers

    def on_headers_complete(self) -> None:
        route = HOT_URLS.get(self.url)
        parser = self.parser
        if (
            route is None
            or parser.get_method() != b"POST"
            or self.expect_100_continue
            or self.hot is not None
            or self.pipeline
            or (self.cycle is not None and not self.cycle.response_complete)
            or parser.should_upgrade()
        ):
            self.reading_hot = False
            self._asgi_scope()
            super().on_headers_complete()
            return
        self.reading_hot = True
        version = parser.get_http_version()
        scope: dict[str, Any] = {
            "type": "http",
            "http_version": version,
            "method": "POST",
            "path": self.url.decode("ascii"),
            "raw_path": self.url,
            "query_string": b"",
            "headers": self.headers,
        }
        self.scope = scope  # type: ignore[assignment]
        hot = self.hot = _Hot(route, scope, version != "1.0" and parser.should_keep_alive())
        problem = self.data_path.guard.check_data_route_head(scope)
        if problem is None:
            return
        if isinstance(problem, PayloadTooLarge):
            self._refuse(hot, problem)  # the body is not wanted: answer and close now
        else:
            hot.problem = problem  # answered once the (small) body is read past

    def on_body(self, body: bytes) -> None:
        hot = self.hot
        if not self.reading_hot or hot is None:
            super().on_body(body)
            return
        if hot.done or hot.problem is not None:
            return
        hot.size += len(body)
        limit = self.data_path.guard.max_body_bytes
        if hot.size > limit:
            self._refuse(hot, PayloadTooLarge(too_large(limit), param="body"))
            return
        hot.chunks.append(body)

    def on_message_complete(self) -> None:
        hot = self.hot
        if not self.reading_hot or hot is None:
            super().on_message_complete()
            return
        self.reading_hot = False
        if hot.done:
            return
        if hot.problem is not None:
            self._answer_error(hot, hot.problem)
            return
        # Reading goes on while this is answered, so that a client leaving is seen at once; a
        # request pipelined behind this one is parsed and queued (``_start_asgi_task``).
        raw = hot.chunks[0] if len(hot.chunks) == 1 else b"".join(hot.chunks)
        hot.chunks = []
        task = self.loop.create_task(self._serve(hot, raw))
        self.hot_task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.proxy_shutdown.running.add(task)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if self.hot is not None:
            # A request pipelined behind a completion being answered: it waits its turn in
            # uvicorn's own queue (started by ``on_response_complete`` once this one is done).
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))
            return
        super()._start_asgi_task(cycle, app)

    # -- connection events ---------------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        task = self.hot_task
        if task is not None and not task.done():
            task.cancel()  # the client left: stop the upstream request too
        super().connection_lost(exc)

    def shutdown(self) -> None:
        hot = self.hot
        if hot is None:
            super().shutdown()
        else:
            hot.keep_alive = False  # closed once its answer is written

    # -- answering -----------------------------------------------------------------------------

    async def _serve(self, hot: _Hot, raw: bytes) -> None:
        task = self.hot_task
        try:
            answer = await self.data_path.respond(hot.route, hot.scope, raw, hot.started)
            if isinstance(answer, RelayedStream):
                await self._stream(hot, answer)
            else:
                self._write_whole(hot, answer.status_code, answer.raw_headers, answer.body)
        except asyncio.CancelledError:
            hot.keep_alive = False  # the client left (or the stream was cut): nothing to add
        finally:
            self.proxy_shutdown.running.discard(task)
            self.hot_task = None
            self._finish(hot)

    def _head(self, hot: _Hot, status: int, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        defaults = self.server_state.default_headers
        if defaults is not self.defaults_from:
            self.defaults_from = defaults
            self.defaults_head = b"".join(b"%s: %s\r\n" % pair for pair in defaults)
        parts = [STATUS_LINES.get(status) or _status_line(status), self.defaults_head]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if not hot.keep_alive:
            parts.append(b"connection: close\r\n")
        return parts

    def _write_whole(
        self, hot: _Hot, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview
    ) -> None:
        parts = self._head(hot, status, headers)
        parts += (b"\r\n", bytes(body))
        self.transport.write(b"".join(parts))

    async def _stream(self, hot: _Hot, stream: RelayedStream) -> None:
        """Relay an SSE stream with chunked framing. ``drain`` waits while the client's socket
        is full, and the next chunk is not taken from the replica until then, so a slow client
        slows its replica stream (proxy/pool.py stops reading it) instead of growing memory."""
        parts = self._head(hot, stream.status_code, stream.raw_headers)
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        write = self.transport.write
        flow = self.flow
        write(b"".join(parts))
        try:
            async for chunk in stream.masked_chunks():
                if chunk:
                    write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    if flow.write_paused:
                        await flow.drain()
            write(b"0\r\n\r\n")
        except asyncio.CancelledError:
            if not self.proxy_shutdown.cut_short():
                raise
            log.warning("a stream was cut off: the shutdown grace period ended")
            hot.keep_alive = False
        except Exception as exc:  # the replica failed mid-stream: the client sees it end short
            log.warning("a stream from replica %d broke: %s", stream.replica.index, exc)
            hot.keep_alive = False
        finally:
            await stream.finish()

    def _refuse(self, hot: _Hot, problem: ProxyError) -> None:
        """Answer ``problem`` before the body is read, and close: the rest is not wanted."""
        hot.keep_alive = False
        hot.done = True
        self._answer_error(hot, problem)

    def _answer_error(self, hot: _Hot, problem: ProxyError) -> None:
        answer = self.data_path.error(hot.route, problem)
        self._write_whole(hot, answer.status_code, answer.raw_headers, answer.body)
        self._finish(hot)

    def _finish(self, hot: _Hot) -> None:
        if not hot.done:
            self.hot = None
        # else: refused before its body ended; the connection is closing, and the rest of the
        # body is swallowed by ``on_body`` until it does.
        if not hot.keep_alive:
            self.transport.close()
            return
        self.on_response_complete()  # counts it, resumes reading, arms the keep-alive timer


# What FrontProtocol relies on in uvicorn's httptools protocol: the methods it overrides or
# calls, with their parameters. ``unsupported`` checks them before the front is used, and
# tests/unit/test_uvicorn_canary.py checks these and the attributes the front reads.
UVICORN_HOOKS: dict[str, tuple[str, ...]] = {
    "connection_made": ("self", "transport"),
    "connection_lost": ("self", "exc"),
    "on_message_begin": ("self",),
    "on_headers_complete": ("self",),
    "on_body": ("self", "body"),
    "on_message_complete": ("self",),
    "on_response_complete": ("self",),
    "_start_asgi_task": ("self", "cycle", "app"),
    "_unset_keepalive_if_required": ("self",),
    "timeout_keep_alive_handler": ("self",),
    "shutdown": ("self",),
}


def unsupported() -> str | None:
    """Why the installed uvicorn cannot carry ``FrontProtocol``, or None when it can."""
    for name, params in UVICORN_HOOKS.items():
        method = getattr(HttpToolsProtocol, name, None)
        if not callable(method):
            return f"HttpToolsProtocol has no method {name}"
        got = tuple(inspect.signature(method).parameters)
        if got != params:
            return f"HttpToolsProtocol.{name} takes {got}, not {params}"
    return None


def front_protocol(data_path: DataPath, shutdown: Shutdown) -> type[FrontProtocol]:
    """A ``FrontProtocol`` class bound to this app's data path (uvicorn builds one protocol
    object per connection from the class it is given)."""
    return type(
        "FrontProtocol", (FrontProtocol,), {"data_path": data_path, "proxy_shutdown": shutdown}
    )
