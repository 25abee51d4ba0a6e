"""The lean upstream client (proxy/pool.py) against a real vLLM CPU server: what vLLM's own
uvicorn sends (Content-Length answers, chunked SSE streams), its keep-alive timeout closing
idle connections under the pool, and a stream abandoned halfway.

Shares the session's replicas with the other vLLM tests (tests/e2e/vllm_support)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from proxy.pool import LeanPool
from tests.e2e.vllm_support.client import random_prompt, trl_completion_body
from tests.e2e.vllm_support.pair import SERVED_NAME, VllmPair

pytest_plugins = ["tests.e2e.vllm_support.fixtures"]
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

HEADERS = {"content-type": "application/json", "x-request-id": "pool-e2e"}
# vLLM's uvicorn closes idle keep-alive connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
VLLM_KEEP_ALIVE_S = 5


def make_pool() -> LeanPool:
    return LeanPool(connect_timeout=5, read_timeout=120, ssl_context=True, fixed_headers={})


def body(rng: random.Random, **extra: object) -> bytes:
    payload = trl_completion_body(SERVED_NAME, random_prompt(rng, 40), max_tokens=12)
    payload.update(extra)
    return json.dumps(payload).encode()


async def test_buffered_completion_and_keep_alive(vllm_pair: VllmPair) -> None:
    rng = random.Random("pool-buffered")
    url = vllm_pair.urls[0]
    pool = make_pool()
    try:
        first = await pool.post(0, url, "/v1/completions", body(rng), HEADERS, stream=False)
        assert first.status == 200, first.body
        choice = json.loads(first.body)["choices"][0]
        assert len(choice["token_ids"]) == 12
        second = await pool.post(0, url, "/v1/completions", body(rng), HEADERS, stream=False)
        assert second.status == 200 and second.conn is first.conn
        # vLLM's own error answer is relayed as it is (a 4xx with a JSON body)
        bad = await pool.post(
            0, url, "/v1/completions", body(rng, model="no-such-model"), HEADERS, stream=False
        )
        assert bad.status == 404 and b"does not exist" in bad.body
    finally:
        await pool.aclose()


async def test_streamed_completion_carries_every_token_then_done(vllm_pair: VllmPair) -> None:
    rng = random.Random("pool-stream")
    pool = make_pool()
    try:
        reply = await pool.post(
            0, vllm_pair.urls[1], "/v1/completions", body(rng, stream=True), HEADERS, stream=True
        )
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        chunks = [c async for c in reply.chunks()]
        await reply.close()
        events = [e for e in b"".join(chunks).decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        # vLLM sends a token per event when its API server keeps up, and coalesces the tokens
        # the engine produced meanwhile into one event when it does not (CI, 2026-12-02: all 12
        # in one event on a loaded machine). What the pool must show is every token and [DONE]
        # whatever the framing; piece-by-piece delivery is timed against fakes in
        # tests/integration/test_pool.py (test_chunked_stream_arrives_in_pieces).
        choices = [json.loads(e[len("data: ") :])["choices"][0] for e in events[:-1]]
        assert choices, events
        assert sum(len(c["token_ids"]) for c in choices) == 12
        assert "".join(c["text"] for c in choices)  # the generated text, in order
        # a stream read to its end leaves the connection reusable
        again = await pool.post(
            0, vllm_pair.urls[1], "/v1/completions", body(rng), HEADERS, stream=False
        )
        assert again.status == 200 and again.conn is reply.conn
    finally:
        await pool.aclose()


async def test_connection_closed_by_vllm_keep_alive_timeout(vllm_pair: VllmPair) -> None:
    rng = random.Random("pool-stale")
    url = vllm_pair.urls[0]
    pool = make_pool()
    try:
        first = await pool.post(0, url, "/v1/completions", body(rng), HEADERS, stream=False)
        assert first.status == 200
        await asyncio.sleep(VLLM_KEEP_ALIVE_S + 1.5)
        assert first.conn.closed  # vLLM hung up on the idle connection
        second = await pool.post(0, url, "/v1/completions", body(rng), HEADERS, stream=False)
        assert second.status == 200 and second.conn is not first.conn
    finally:
        await pool.aclose()


async def test_abandoned_stream_closes_its_connection(vllm_pair: VllmPair) -> None:
    rng = random.Random("pool-abandon")
    url = vllm_pair.urls[1]
    pool = make_pool()
    try:
        long = body(rng, stream=True, max_tokens=200)
        reply = await pool.post(1, url, "/v1/completions", long, HEADERS, stream=True)
        async for _ in reply.chunks():
            break  # the client left after the first chunk
        await reply.close()
        assert reply.conn.closed  # closing the connection is how vLLM learns to abort
        after = await pool.post(1, url, "/v1/completions", body(rng), HEADERS, stream=False)
        assert after.status == 200 and after.conn is not reply.conn
    finally:
        await pool.aclose()
