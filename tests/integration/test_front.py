"""Completions served from uvicorn's protocol object (proxy/front.py), over raw sockets where
HTTP framing is the point: keep-alive, pipelining, HTTP/1.0, ``Connection: close``, refusals
before the body, chunked streams, a client leaving. Every behaviour is also checked to be the
same through the ASGI path (``ProxyApp``: what uvicorn's own protocol reaches, e.g. for a request
the front hands over, and what any other server would use)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from proxy.front import FrontProtocol
from tests.support.fake_vllm import FakeVllm
from tests.support.traffic import wait_until

BODY = {"model": "tiny/base", "prompt": [1, 2, 3, 4], "max_tokens": 4, "return_token_ids": True}


def _request(body: dict[str, Any] | bytes, *extra: str, path: str = "/v1/completions") -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [
        f"POST {path} HTTP/1.1",
        "host: proxy",
        "content-type: application/json",
        f"content-length: {len(raw)}",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked) from ``sock``; ``buf`` keeps what was
    read past it."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response head")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    del buf[:]
    buf += rest
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    if "content-length" in headers:
        size = int(headers["content-length"])
        while len(buf) < size:
            buf += sock.recv(65536)
        body = bytes(buf[:size])
        del buf[:size]
        return status, headers, body
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while True:
        while b"\r\n" not in buf:
            buf += sock.recv(65536)
        line, _, _ = bytes(buf).partition(b"\r\n")
        size = int(line, 16)
        need = len(line) + 2 + size + 2
        while len(buf) < need:
            buf += sock.recv(65536)
        body += bytes(buf[len(line) + 2 : len(line) + 2 + size])
        del buf[:need]
        if size == 0:
            return status, headers, body


def _closed(sock: socket.socket, timeout: float = 5) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture(params=[True, False], ids=["protocol", "asgi"])
def front(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _connect(h: Any) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", h.proxy.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def test_the_proxy_serves_completions_from_its_protocol(make_fleet) -> None:
    h = make_fleet(1)
    assert issubclass(h.proxy.server.config.http_protocol_class, FrontProtocol)
    h2 = make_fleet(1, front=False)
    assert not issubclass(h2.proxy.server.config.http_protocol_class, FrontProtocol)


def test_keep_alive_and_pipelined_requests_answer_in_order(make_fleet, front: bool) -> None:
    h = make_fleet(1, front=front)
    bodies = [{**BODY, "seed": s, "max_tokens": 2 + s} for s in range(3)]
    with _connect(h) as sock:
        # Three requests in one write (pipelined), then one more on the same connection.
        sock.sendall(b"".join(_request(b, f"x-request-id: req-{i}") for i, b in enumerate(bodies)))
        buf = bytearray()
        for i in range(3):
            status, headers, body = _read_response(sock, buf)
            assert status == 200
            assert headers["x-request-id"] == f"req-{i}"
            assert headers["x-proxy-replica"] == "0"
            assert "date" in headers
            assert len(json.loads(body)["choices"][0]["token_ids"]) == 2 + i
        sock.sendall(_request(BODY))
        assert _read_response(sock, buf)[0] == 200


def test_http_1_0_and_connection_close_end_the_connection(make_fleet, front: bool) -> None:
    h = make_fleet(1, front=front)
    with _connect(h) as sock:
        sock.sendall(_request(BODY, "connection: close"))
        status, headers, _ = _read_response(sock, bytearray())
        assert status == 200 and headers["connection"] == "close"
        assert _closed(sock)
    with _connect(h) as sock:
        sock.sendall(_request(BODY).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        status, _, body = _read_response(sock, bytearray())
        assert status == 200 and json.loads(body)["choices"]
        assert _closed(sock)


def test_a_declared_oversize_body_is_refused_before_it_is_read(make_fleet, front) -> None:
    h = make_fleet(1, front=front, max_body_bytes=2048)
    with _connect(h) as sock:
        # Only the head is sent: the answer must not wait for the 10 MB it announces.
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
            b"content-length: 10000000\r\n\r\n"
        )
        status, _, body = _read_response(sock, bytearray())
        assert status == 413
        assert "PROXY_MAX_BODY_BYTES" in json.loads(body)["error"]["message"]
    assert h.fakes[0].served == []


def test_a_chunked_body_past_the_limit_is_refused(make_fleet, front: bool) -> None:
    h = make_fleet(1, front=front, max_body_bytes=2048)
    big = json.dumps({**BODY, "prompt": list(range(2000))}).encode()
    with _connect(h) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n0\r\n\r\n" % (len(big), big)
        )
        assert _read_response(sock, bytearray())[0] == 413
    assert h.fakes[0].served == []


def test_a_refused_key_keeps_the_connection_usable(make_fleet, front: bool) -> None:
    h = make_fleet(1, front=front, api_keys=["sk-good-0123456789abcdef"])
    with _connect(h) as sock:
        buf = bytearray()
        sock.sendall(_request(BODY, "authorization: Bearer sk-bad-0123456789abcdef"))
        status, headers, body = _read_response(sock, buf)
        assert status == 401 and "www-authenticate" in headers
        assert json.loads(body)["error"]["message"]
        sock.sendall(_request(BODY, "authorization: Bearer sk-good-0123456789abcdef"))
        assert _read_response(sock, buf)[0] == 200


def test_bad_json_and_a_query_string(make_fleet, front: bool) -> None:
    h = make_fleet(1, front=front)
    with _connect(h) as sock:
        buf = bytearray()
        sock.sendall(_request(b'{"model": "tiny/base", "prompt": [1,'))
        status, _, body = _read_response(sock, buf)
        assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
        # A query string is not the exact hot URL: served through the ASGI path, same answer.
        sock.sendall(_request(BODY, path="/v1/completions?trace=1"))
        assert _read_response(sock, buf)[0] == 200


def test_a_stream_is_chunked_and_complete(make_fleet, front: bool) -> None:
    fakes = [FakeVllm(name="r0", stream_chunks=5, stream_delay_s=0.01)]
    h = make_fleet(fakes=fakes, front=front)
    with _connect(h) as sock:
        buf = bytearray()
        sock.sendall(_request({**BODY, "max_tokens": 10, "stream": True}))
        status, headers, body = _read_response(sock, buf)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in body.decode().splitlines() if ln.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) == 6
        sock.sendall(_request(BODY))  # the connection is still good after a stream
        assert _read_response(sock, buf)[0] == 200
    assert fakes[0].streams_completed == 1
    wait_until(lambda: h.rt.fleet.replicas[0].in_flight == 0)


def test_a_client_leaving_a_buffered_request_releases_it(make_fleet) -> None:
    """The protocol path cancels a request whose client left: the upstream connection is
    closed (vLLM then aborts the generation) and the in-flight count is released at once."""
    fakes = [FakeVllm(name="r0", completion_delay_s=30)]
    h = make_fleet(fakes=fakes)
    with _connect(h) as sock:
        sock.sendall(_request(BODY))
        wait_until(lambda: h.rt.fleet.replicas[0].in_flight == 1)
    started = time.monotonic()
    wait_until(lambda: h.rt.fleet.replicas[0].in_flight == 0)
    assert time.monotonic() - started < 10
    # (The fake replica, a Starlette app, sleeps on; vLLM aborts a request whose connection
    # closes.) The proxy itself is ready for the next one:
    fakes[0].completion_delay_s = 0
    assert h.client.post("/v1/completions", json=BODY).status_code == 200


def test_the_same_answers_through_both_paths(make_fleet) -> None:
    answers = []
    for front in (True, False):
        h = make_fleet(1, front=front)
        with httpx.Client(base_url=h.proxy.url, timeout=30) as client:
            got = [
                client.post("/v1/completions", json={**BODY, "seed": 7}),
                client.post("/v1/completions", json={"model": "nope", "prompt": [1]}),
                client.post("/v1/completions", json={"model": "tiny/base", "prompt": [-1]}),
                client.post("/v1/chat/completions", content=b"[]"),
            ]
        answers.append(
            [
                (
                    r.status_code,
                    r.headers["content-type"],
                    r.headers.get("x-proxy-replica"),
                    r.json().get("choices") or r.json()["error"]["message"],
                )
                for r in got
            ]
        )
    assert answers[0] == answers[1]
    assert [a[0] for a in answers[0]] == [200, 404, 400, 400]


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(make_fleet, front) -> None:
    """FrontProtocol replaces uvicorn's per-request keep-alive timer with a deadline and one
    sweep per server: a connection idle past the timeout is still closed, after a completion
    (answered by the protocol) and after an ASGI answer on the same connection alike."""
    h = make_fleet(1, front=front)
    h.proxy.server.config.timeout_keep_alive = 0.5  # read by each new connection
    # The ASGI request is pipelined behind the completion (sent in the same write), so that the
    # short timeout cannot close the connection between the two however slow this thread is.
    for follow_up in (b"", b"GET /v1/models HTTP/1.1\r\nhost: proxy\r\n\r\n"):
        with _connect(h) as sock:
            buf = bytearray()
            sock.sendall(_request(BODY) + follow_up)
            assert _read_response(sock, buf)[0] == 200
            if follow_up:
                assert _read_response(sock, buf)[0] == 200
            # The close is awaited, not timed: any delay under load passes.
            assert _closed(sock, timeout=60)
