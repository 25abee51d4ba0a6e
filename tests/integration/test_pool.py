"""The lean upstream client (proxy/pool.py) against fake replicas and against raw TCP servers
that misbehave on purpose: refused, reset mid-body, a keep-alive connection closed under it,
silence, garbage, and a client slower than its replica."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from fakes.net import free_port
from proxy.errors import UpstreamTimeout
from proxy.pool import HIGH_WATER, JOIN_BELOW, Connection, LeanPool
from proxy.upstream import ReplicaBroken, ReplicaUnreachable
from tests.support.fake_vllm import FakeVllm
from tests.support.servers import ServerThread

BODY = json.dumps(
    {"model": "tiny/base", "prompt": [1, 2, 3], "max_tokens": 4, "return_token_ids": True}
).encode()
HEADERS = {"content-type": "application/json", "x-request-id": "t-1"}

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


OPEN_POOLS: list[LeanPool] = []


def make_pool(**overrides: float) -> LeanPool:
    opts: dict[str, float] = {"connect_timeout": 2.0, "read_timeout": 5.0, **overrides}
    pool = LeanPool(
        connect_timeout=opts["connect_timeout"],
        read_timeout=opts["read_timeout"],
        ssl_context=True,
        fixed_headers={"authorization": "Bearer upstream-token"},
    )
    OPEN_POOLS.append(pool)
    return pool


@pytest.fixture(autouse=True)
async def close_pools() -> AsyncIterator[None]:
    """Every pool a test made is closed, passed or failed (no connection outlives its test)."""
    yield
    while OPEN_POOLS:
        await OPEN_POOLS.pop().aclose()


class RawServer:
    """A TCP server whose handler gets (reader, writer, connection number)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"\r\n"
        + body
    )


@pytest.fixture
def fake() -> Iterator[ServerThread]:
    server = ServerThread(FakeVllm(name="r0").app()).start()
    yield server
    server.stop()


async def test_buffered_answer_and_the_connection_is_kept(fake: ServerThread) -> None:
    pool = make_pool()
    first = await pool.post(0, fake.url, "/v1/completions", BODY, HEADERS, stream=False)
    assert first.status == 200
    assert first.headers["content-type"] == "application/json"
    assert json.loads(first.body)["choices"][0]["token_ids"]
    await first.close()
    second = await pool.post(0, fake.url, "/v1/completions", BODY, HEADERS, stream=False)
    assert second.status == 200
    assert second.conn is first.conn  # one connection, reused
    assert second.conn.served == 2
    await pool.aclose()


async def test_chunked_stream_arrives_in_pieces(fake: ServerThread) -> None:
    pool = make_pool()
    body = json.dumps({"model": "tiny/base", "prompt": [1, 2, 3], "stream": True}).encode()
    reply = await pool.post(0, fake.url, "/v1/completions", body, HEADERS, stream=True)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    chunks = [c async for c in reply.chunks()]
    await reply.close()
    text = b"".join(chunks).decode()
    assert len(chunks) >= 2 and text.rstrip().endswith("data: [DONE]")
    # the stream ended cleanly, so its connection serves the next request
    again = await pool.post(0, fake.url, "/v1/completions", BODY, HEADERS, stream=False)
    assert again.conn is reply.conn
    await pool.aclose()


async def test_request_carries_token_and_headers() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head, body = await read_request(reader)
        seen.append(head + body)
        writer.write(ok(b"{}"))
        await writer.drain()

    async with RawServer(handler) as url:
        pool = make_pool()
        reply = await pool.post(3, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert reply.status == 200 and reply.body == b"{}"
        await pool.aclose()
    request = seen[0]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nauthorization: Bearer upstream-token\r\n" in request
    assert b"\r\nx-request-id: t-1\r\n" in request
    assert request.endswith(b"\r\n\r\n" + BODY)


async def test_refused_is_unreachable() -> None:
    pool = make_pool()
    with pytest.raises(ReplicaUnreachable, match="replica 1 unreachable"):
        await pool.post(
            1, f"http://127.0.0.1:{free_port()}", "/v1/completions", BODY, HEADERS, False
        )


async def test_reset_mid_body_is_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
        await writer.drain()
        writer.transport.abort()  # RST with 990 bytes missing

    async with RawServer(handler) as url:
        pool = make_pool()
        with pytest.raises(ReplicaBroken, match="mid-answer"):
            await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        await pool.aclose()


async def test_reset_mid_stream_is_raised_from_the_chunks() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async with RawServer(handler) as url:
        pool = make_pool()
        reply = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=True)
        got = []
        with pytest.raises(ReplicaBroken):
            async for chunk in reply.chunks():
                got.append(chunk)
        assert got == [b"hello"]
        await reply.close()
        await pool.aclose()


async def test_closed_before_answering_on_a_new_connection_is_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)  # read it, then hang up without a word

    async with RawServer(handler) as url:
        pool = make_pool()
        with pytest.raises(ReplicaBroken, match="before answering"):
            await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        await pool.aclose()


async def test_stale_keep_alive_is_retried_once_on_a_new_connection() -> None:
    """The replica answers one request per connection and hangs up on the next one without a
    word, as when its keep-alive timeout races the proxy's reuse. The request is sent again on
    a fresh connection and succeeds; the caller never sees the stale connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b'{"n": %d}' % n))
        await writer.drain()
        await read_request(reader)  # the reuse: closed unanswered

    async with RawServer(handler) as url:
        pool = make_pool()
        first = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert first.body == b'{"n": 1}'
        second = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert second.body == b'{"n": 2}'
        await pool.aclose()


async def test_connection_closed_while_idle_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b'{"n": %d}' % n))
        await writer.drain()  # then close: the handler returns

    async with RawServer(handler) as url:
        pool = make_pool()
        first = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        await asyncio.sleep(0.1)  # the close arrives while the connection is idle
        assert first.conn.closed
        second = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert second.body == b'{"n": 2}' and second.conn is not first.conn
        await pool.aclose()


async def test_connection_close_header_is_honoured() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b"{}", b"connection: close\r\n"))
        await writer.drain()
        await asyncio.sleep(1)

    async with RawServer(handler) as url:
        pool = make_pool()
        reply = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert reply.status == 200 and reply.conn.closed
        assert not pool.origin(url).idle
        await pool.aclose()


async def test_body_delimited_by_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": 1}')
        await writer.drain()

    async with RawServer(handler) as url:
        pool = make_pool()
        reply = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert reply.status == 200 and reply.body == b'{"a": 1}'
        await pool.aclose()


async def test_silence_is_a_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with RawServer(handler) as url:
        pool = make_pool(read_timeout=0.3)
        with pytest.raises(UpstreamTimeout, match="silent"):
            await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        await pool.aclose()


async def test_a_slow_stream_is_not_a_timeout_while_it_keeps_talking() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):
            await asyncio.sleep(0.1)
            writer.write(b"1\r\nx\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with RawServer(handler) as url:
        pool = make_pool(read_timeout=0.3)  # the whole answer takes twice that
        reply = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=True)
        assert b"".join([c async for c in reply.chunks()]) == b"x" * 6
        await reply.close()
        await pool.aclose()


async def test_garbage_is_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with RawServer(handler) as url:
        pool = make_pool()
        with pytest.raises(ReplicaBroken, match="invalid HTTP response"):
            await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        await pool.aclose()


async def test_slow_client_pauses_the_replica_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica streams 4 MiB as fast as it can; the consumer takes a chunk every few ms.
    The pool stops reading the replica once HIGH_WATER bytes wait, so what it holds stays
    bounded by that plus one socket read, and the replica's own writes back up."""
    total = 4 * 1024 * 1024
    piece = b"y" * 16384

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            writer.write(piece)
            await writer.drain()

    most_buffered = 0
    pauses = 0
    real_on_body = Connection.on_body

    def on_body(self: Connection, body: bytes) -> None:
        nonlocal most_buffered, pauses
        was = self.paused
        real_on_body(self, body)
        assert self.reply is not None
        most_buffered = max(most_buffered, self.reply.buffered)
        pauses += self.paused and not was

    monkeypatch.setattr(Connection, "on_body", on_body)
    async with RawServer(handler) as url:
        pool = make_pool()
        reply = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=True)
        received = 0
        async for chunk in reply.chunks():
            received += len(chunk)
            await asyncio.sleep(0.002)
        await reply.close()
        await pool.aclose()
    assert received == total
    assert pauses > 0
    assert most_buffered <= HIGH_WATER + 256 * 1024  # one socket read at most beyond the mark


async def test_a_large_body_arrives_whole() -> None:
    """Bodies above JOIN_BELOW are written apart from the head; the replica sees one request."""
    large = json.dumps({"model": "tiny/base", "prompt": list(range(30_000))}).encode()
    assert len(large) > JOIN_BELOW
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        _, body = await read_request(reader)
        seen.append(body)
        writer.write(ok(b"{}"))
        await writer.drain()

    async with RawServer(handler) as url:
        pool = make_pool()
        reply = await pool.post(0, url, "/v1/completions", large, HEADERS, stream=False)
        assert reply.status == 200
    assert seen == [large]


async def test_bytes_after_a_complete_answer_retire_the_connection() -> None:
    """A replica that sends the start of a second response behind a complete one leaves the
    connection's parser mid-message: the next request must not read that as its answer."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            await read_request(reader)
            writer.write(ok(b"first") + b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nstal")
        while True:
            await read_request(reader)
            writer.write(ok(b"from connection %d" % n))

    server = RawServer(handler)
    async with server as url:
        pool = make_pool()
        first = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert first.body == b"first"
        second = await pool.post(0, url, "/v1/completions", BODY, HEADERS, stream=False)
        assert (second.status, second.body) == (200, b"from connection 2")
        assert server.connections == 2
        await pool.aclose()


@pytest.mark.parametrize(
    "bad", [{"x-request-id": "a\r\nx-evil: 1"}, {"x-request-id": "a\nb"}, {"x\ry": "v"}]
)
async def test_a_header_with_a_line_break_is_refused(
    fake: ServerThread, bad: dict[str, str]
) -> None:
    """No header can smuggle a second header or a second request into the upstream stream,
    per request or fixed; well-formed ones around it go through."""
    pool = make_pool()
    with pytest.raises(ValueError, match="line break"):
        await pool.post(0, fake.url, "/v1/completions", BODY, {**HEADERS, **bad}, stream=False)
    with pytest.raises(ValueError, match="line break"):
        LeanPool(connect_timeout=1, read_timeout=1, ssl_context=True, fixed_headers=bad)
    reply = await pool.post(0, fake.url, "/v1/completions", BODY, HEADERS, stream=False)
    assert reply.status == 200
