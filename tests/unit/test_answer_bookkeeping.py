"""A buffered answer's bookkeeping (learning the completion, the answered tallies) runs once the
answer is written (``RelayedBody.written``), not before: at one connection the client waits for
everything the proxy does before the write (bench/results/overhead_r9.md). Whoever writes the
answer runs it, once, also when the write fails; the ASGI call does so itself."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from bench.request_micro import _runtime, drive
from bench.run_overhead import completion_request
from proxy.core.extract import RoutingKey
from proxy.dataplane import RelayedBody, completion_token_ids
from proxy.hotpath import parse_json

SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "raw_path": b"/v1/completions",
    "query_string": b"",
    "headers": [(b"host", b"proxy"), (b"content-type", b"application/json")],
}


def _answered(rt: Any) -> float:
    return float(sum(rt.metrics.requests.values.values()))


def _turn_blocks(rt: Any, raw: bytes, answer: RelayedBody) -> list[Any]:
    """The block keys of prompt + generated ids: what learning the completion records."""
    body = parse_json(raw)
    generated = completion_token_ids(bytes(answer.body))
    assert generated
    turn = RoutingKey(body["model"], list(body["prompt"]) + generated, None, None, False, 1)
    blocks: list[Any] = rt.router.block_keys(turn, rt.fleet.lora_path(body["model"]))
    return blocks


@pytest.mark.parametrize("native_mode", ["off", "auto"])
def test_learning_and_tallies_wait_for_the_write_and_run_once(native_mode: str) -> None:
    rt, path = _runtime(native_mode)
    raw = orjson.dumps(completion_request(False, 3))
    answer = drive(path.respond("completions", SCOPE, raw, 0.0))
    assert isinstance(answer, RelayedBody) and answer.status_code == 200
    blocks = _turn_blocks(rt, raw, answer)
    prompt_blocks = len(parse_json(raw)["prompt"]) // 16
    assert len(blocks) > prompt_blocks  # the completion fills blocks of its own
    # Routed (the prompt is recorded), but the answer is not written yet: nothing learned of
    # the completion, nothing tallied as answered.
    assert len(rt.router.index.lookup(blocks)) == prompt_blocks
    assert _answered(rt) == 0
    answer.written()
    assert len(rt.router.index.lookup(blocks)) == len(blocks)
    assert _answered(rt) == 1
    answer.written()  # a second call has nothing left to do
    assert _answered(rt) == 1


def test_the_asgi_call_runs_it_after_sending_even_when_sending_fails() -> None:
    rt, path = _runtime("auto")
    seen: list[float] = []

    async def send(message: dict[str, Any]) -> None:
        seen.append(_answered(rt))
        if message["type"] == "http.response.body":
            raise OSError("the client left")

    raw = orjson.dumps(completion_request(False))
    answer = drive(path.respond("completions", SCOPE, raw, 0.0))
    assert isinstance(answer, RelayedBody)
    with pytest.raises(OSError):
        asyncio.run(answer({}, None, send))
    assert seen == [0, 0]  # both messages went out before the tallies
    assert _answered(rt) == 1
