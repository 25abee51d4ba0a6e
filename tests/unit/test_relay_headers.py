"""The answer's headers as the data plane relays them (proxy/dataplane.py's _relay_headers):
what the replica sent of RELAYED_HEADERS, X-Proxy-Replica, and the request's X-Request-Id in
the replica's place or last."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from proxy.dataplane import RelayedBody, _relay_headers


class _Reply:
    def __init__(self, headers: Mapping[str, str], body: bytes = b"{}") -> None:
        self.status = 200
        self.headers = headers
        self.body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    async def close(self) -> None:
        return None


def test_relayed_headers_keep_the_replicas_order_and_replace_its_request_id() -> None:
    reply = _Reply(
        {
            "server": "uvicorn",
            "content-type": "application/json",
            "x-request-id": "the-replicas-own",
            "cache-control": "no-store",
            "date": "today",
        }
    )
    assert _relay_headers(reply, 3, "req-1") == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"req-1"),
        (b"cache-control", b"no-store"),
        (b"x-proxy-replica", b"3"),
    ]


def test_a_request_id_the_replica_did_not_send_comes_last() -> None:
    reply = _Reply({"content-type": "text/event-stream"})
    assert _relay_headers(reply, 70, "req-2") == [
        (b"content-type", b"text/event-stream"),
        (b"x-proxy-replica", b"70"),
        (b"x-request-id", b"req-2"),
    ]


def test_a_buffered_answer_adds_its_length() -> None:
    answer = RelayedBody(_Reply({}, b'{"ok":1}'), 0, "r", None)
    assert answer.raw_headers == [
        (b"x-proxy-replica", b"0"),
        (b"x-request-id", b"r"),
        (b"content-length", b"8"),
    ]
    assert answer.body == b'{"ok":1}' and answer.status_code == 200
