"""proxy/wire.py: a buffered answer leaves uvicorn in one write, and arrives whole."""

from __future__ import annotations

from typing import Any

import httpx

from proxy.wire import send_whole
from tests.support.servers import ServerThread

BODY = b'{"choices": [{"text": "ok"}]}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


class CountingTransport:
    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def test_one_write_per_answer_through_uvicorn() -> None:
    seen: list[CountingTransport] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        cycle = send.__self__
        counting = CountingTransport(cycle.transport)
        cycle.transport = counting
        seen.append(counting)
        await send_whole(send, 200, list(HEADERS), BODY)
        cycle.transport = counting.transport

    server = ServerThread(app).start()
    try:
        with httpx.Client(base_url=server.url) as client:
            for _ in range(2):  # and the kept-alive connection serves the next one
                r = client.post("/v1/completions", content=b"{}")
                assert r.status_code == 200 and r.content == BODY
                assert r.headers["content-type"] == "application/json"
    finally:
        server.stop()
    for counting in seen:
        assert len(counting.writes) == 1
        assert counting.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert counting.writes[0].endswith(b"\r\n\r\n" + BODY)


async def test_any_other_send_gets_the_two_messages() -> None:
    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await send_whole(send, 201, list(HEADERS), BODY)
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[0]["status"] == 201 and messages[1]["body"] == BODY
