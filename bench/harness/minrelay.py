"""The least a Python relay can cost per request on this machine: ``run_overhead``'s
``floor-min`` target (``python -m bench.harness.passthrough --front min``).

uvloop, one ``asyncio.Protocol`` per side and httptools' parsers, nothing else: no timeouts, no
validation, no error handling, no headers relayed, a fresh upstream connection only when none is
idle. It is not a usable proxy (a replica that fails hangs its request); it is the yardstick for
what the proxy's own front and upstream client (``floor-protocol``) add to a Python relay's
unavoidable cost, socket syscalls and event-loop turns included.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import httptools
import uvloop

Backend = tuple[str, int]


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to a backend; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        body, self.chunks = b"".join(self.chunks), []
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("backend closed the connection"))


class _Pool:
    def __init__(self, backends: Sequence[Backend]) -> None:
        self.idle: dict[Backend, list[_Upstream]] = {b: [] for b in backends}

    async def post(self, backend: Backend, path: bytes, body: bytes) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        idle = self.idle[backend]
        if idle:
            conn = idle.pop()
        else:
            _, conn = await loop.create_connection(_Upstream, *backend)
        conn.waiter = loop.create_future()
        assert conn.transport is not None
        conn.transport.write(
            b"POST %s HTTP/1.1\r\nhost: backend\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path, len(body), body)
        )
        answer = await conn.waiter
        idle.append(conn)
        return answer


class _Routed:
    """rollout-proxy's routing core on the bare relay (``floor-min-routed``): the C scan and
    pack of the prompt, orjson of the rest, ``Router.route`` with the default cost policy over
    the in-flight counts, and the completion learned, as the proxy does per request; nothing of
    its front, guard, limits, metrics, logs or client. The distance from ``floor-min`` is what
    routing costs under load; from the proxy, what everything else does."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        from proxy.core import native
        from proxy.core.hashing import make_hasher
        from proxy.core.policy import make_policy
        from proxy.core.prefix_index import PrefixIndex
        from proxy.core.router import Router
        from proxy.dataplane import completion_token_ids
        from proxy.hotpath import packed_key
        from proxy.settings import Settings

        native_module = native.module_for(True)  # refuses to run without it
        assert native_module is not None
        defaults = Settings(replicas=[f"http://{h}:{p}" for h, p in backends])
        self.split = native_module.split_prompt
        self.router = Router(
            make_hasher("fast", 16, "sha256", None, True),
            PrefixIndex(defaults.index_capacity, defaults.max_replicas),
            make_policy(defaults.policy, defaults.imbalance),
        )
        self.backends = list(backends)
        self.in_flight = [0] * len(backends)
        # Imported once here, not per request (bench/harness/minrelay.py imports no proxy code at
        # its top).
        self.packed_key = packed_key
        self.completion_token_ids = completion_token_ids

    async def post(self, pool: _Pool, path: bytes, body: bytes) -> tuple[int, bytes]:
        key = self.packed_key(self.split, body)
        assert key is not None, "floor-min-routed relays token-id prompts only"
        in_flight = self.in_flight
        decision = self.router.route(key, [(i, float(n)) for i, n in enumerate(in_flight)])
        replica = decision.replica
        in_flight[replica] += 1
        try:
            status, answer = await pool.post(self.backends[replica], path, body)
        finally:
            in_flight[replica] -= 1
        generated = self.completion_token_ids(answer)
        if status == 200 and generated is not None:
            self.router.record_completion(key, decision, generated)
        return status, answer


class _Client(asyncio.Protocol):
    """One client connection: each request is forwarded to the next backend (or, routed, to
    the one rollout-proxy's router picks)."""

    def __init__(self, pool: _Pool, backends: Iterator[Backend], routed: _Routed | None) -> None:
        self.pool = pool
        self.backends = backends
        self.routed = routed
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        body, self.chunks = b"".join(self.chunks), []
        asyncio.get_running_loop().create_task(self._serve(self.url, body))

    async def _serve(self, path: bytes, body: bytes) -> None:
        if self.routed is None:
            status, answer = await self.pool.post(next(self.backends), path, body)
        else:
            status, answer = await self.routed.post(self.pool, path, body)
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(answer), answer)
        )


async def _serve_forever(port: int, backends: Sequence[Backend], routed: bool) -> None:
    loop = asyncio.get_running_loop()
    pool, turn = _Pool(backends), itertools.cycle(backends)
    router = _Routed(backends) if routed else None
    server = await loop.create_server(lambda: _Client(pool, turn, router), "127.0.0.1", port)
    await server.serve_forever()


def run(port: int, backend_urls: Sequence[str], routed: bool = False) -> None:
    backends = []
    for url in backend_urls:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        backends.append((parts.hostname, parts.port))
    uvloop.run(_serve_forever(port, backends, routed))
