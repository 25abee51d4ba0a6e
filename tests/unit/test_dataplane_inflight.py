"""DataPlane.forward's in-flight count: a replica counts a request from the send until its
answer is read (or its stream ends), however the attempt ends: an answer, a retry, a timeout,
a cancellation while a retried reply is being closed. Real runtime, scripted upstream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from proxy.app import Runtime, build_runtime
from proxy.core.extract import extract_completion
from proxy.core.fleet import Status
from proxy.dataplane import RelayedStream
from proxy.errors import UpstreamTimeout
from proxy.settings import Settings

ANSWER = b'{"choices": [{"text": "x", "token_ids": [7, 8]}]}'


class Reply:
    def __init__(self, status: int, on_close: BaseException | None = None) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {"content-type": "application/json"}
        self.body = ANSWER if status == 200 else b'{"error": "engine died"}'
        self.released = False
        self.on_close = on_close
        self.closed = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    async def close(self) -> None:
        self.closed += 1
        if self.on_close is not None:
            raise self.on_close


class ScriptedRelay:
    """Answers each post with the next scripted reply, or raises it; records the in-flight
    counts the replicas had while each request was out."""

    def __init__(self, rt: Runtime, script: list[Reply | BaseException]) -> None:
        self.rt = rt
        self.script = script
        self.seen: list[list[int]] = []

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Any:
        self.seen.append([r.in_flight for r in self.rt.fleet.replicas])
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


def _runtime(script: list[Reply | BaseException]) -> tuple[Runtime, ScriptedRelay]:
    rt = build_runtime(Settings(replicas=["http://127.0.0.1:9", "http://127.0.0.1:10"]), None)
    for replica in rt.fleet.replicas:
        replica.status = Status.READY
    relay = ScriptedRelay(rt, script)
    rt.data.relay = relay
    return rt, relay


async def _forward(rt: Runtime, stream: bool = False) -> Any:
    body = {"model": rt.fleet.base_model or "m", "prompt": [1, 2, 3], "stream": stream}
    key = extract_completion(body, None)
    return await rt.data.forward("completions", "/v1/completions", b"{}", key, "rid", 0.0)


def _in_flight(rt: Runtime) -> list[int]:
    return [r.in_flight for r in rt.fleet.replicas]


async def test_an_answer_and_a_retry_release_their_counts() -> None:
    rt, relay = _runtime([Reply(503), Reply(200)])
    answer = await _forward(rt)
    assert answer.status_code == 200
    assert sorted(relay.seen[0]) == [0, 1]  # counted while out
    assert sorted(relay.seen[1]) == [0, 1]  # the first one's count was released before
    assert _in_flight(rt) == [0, 0]


@pytest.mark.parametrize(
    "failure", [UpstreamTimeout("replica timed out"), asyncio.CancelledError(), RuntimeError()]
)
async def test_a_failed_send_releases_its_count(failure: BaseException) -> None:
    rt, _ = _runtime([failure])
    with pytest.raises(type(failure)):
        await _forward(rt)
    assert _in_flight(rt) == [0, 0]


async def test_a_cancellation_while_closing_a_retried_reply_releases_its_count() -> None:
    rt, _ = _runtime([Reply(503, on_close=asyncio.CancelledError())])
    with pytest.raises(asyncio.CancelledError):
        await _forward(rt)
    assert _in_flight(rt) == [0, 0]


async def test_every_replica_failing_relays_the_last_answer_with_nothing_counted() -> None:
    rt, _ = _runtime([Reply(503), Reply(503)])
    answer = await _forward(rt)
    assert answer.status_code == 503 and _in_flight(rt) == [0, 0]


async def test_a_stream_holds_its_count_until_it_finishes() -> None:
    rt, _ = _runtime([Reply(200)])
    stream = await _forward(rt, stream=True)
    assert isinstance(stream, RelayedStream)
    assert sorted(_in_flight(rt)) == [0, 1]
    await stream.finish()
    assert _in_flight(rt) == [0, 0]
