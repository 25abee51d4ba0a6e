"""The proxy in front of two real vLLM CPU replicas: routing shows up in vLLM's own counters.

Shares the session's two replicas with test_vllm_replicas.py; the proxy runs as a separate
process (``python -m proxy``) in exact hashing mode, learning block size and hash algorithm from
the replicas. Adapter names are unique to this module (the replicas outlive it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.vllm_support.client import (
    Completion,
    cache_hit_tokens,
    complete,
    load_adapter,
    metric_sum,
    prefix_counters,
    random_prompt,
    trl_completion_body,
)
from tests.e2e.vllm_support.pair import VllmPair
from tests.e2e.vllm_support.proxy_process import ProxyProcess, running_proxy

pytest_plugins = ["tests.e2e.vllm_support.fixtures"]
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

# TRL's G: samples per prompt, sent as G concurrent requests with one prompt.
GROUP = 8


@pytest.fixture(scope="module")
def proxy(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    # These tests check the affinity mechanics (the proxy's header against vLLM's own cache
    # counters), so they pin the `prefix` policy: the default `cost` policy deliberately spreads
    # a short prompt's group when a hit saves less prefill than the queue it would join costs
    # (tests/unit/test_policy.py, bench/results/routing.md).
    args = ["--hash-mode", "exact", "--vllm-hash-seed", vllm_pair.hash_seed, "--policy", "prefix"]
    with running_proxy(vllm_pair.urls, Path(log), args) as proc:
        yield proc


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    return random.Random(request.node.name)


def _fan_out(http: httpx.Client, url: str, bodies: list[dict[str, object]]) -> list[Completion]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: complete(http, url, b), bodies))


def _group(model: str, prompt: list[int], rng: random.Random) -> list[dict[str, object]]:
    # TRL samples at temperature 1 with a fresh 63-bit seed per rollout.
    return [
        trl_completion_body(model, prompt, temperature=1.0, seed=rng.getrandbits(63))
        for _ in range(GROUP)
    ]


def _decisions(http: httpx.Client, proxy: ProxyProcess, outcome: str) -> float:
    text = http.get(f"{proxy.url}/metrics").text
    return metric_sum(text, "rollout_proxy_routing_decisions_total", outcome=outcome)


def test_proxy_learns_the_replicas_cache_geometry_and_answers_trl_start_up(
    vllm_pair: VllmPair, proxy: ProxyProcess, http: httpx.Client
) -> None:
    fleet = http.get(f"{proxy.url}/admin/fleet").json()
    assert fleet["routing"]["block_size"] == vllm_pair.block_size
    assert fleet["routing"]["hash_mode"] == "exact"
    assert http.get(f"{proxy.url}/health").status_code == 200
    cfg = http.get(f"{proxy.url}/server_info", params={"config_format": "json"}).json()
    assert cfg["vllm_config"]["lora_config"]["max_loras"] == vllm_pair.max_loras
    assert cfg["vllm_config"]["parallel_config"]["data_parallel_size"] == 1
    models = http.get(f"{proxy.url}/v1/models").json()["data"]
    assert models[0]["id"] == vllm_pair.served_name
    assert models[0]["max_model_len"] > 0


def test_rollouts_of_one_prompt_land_on_one_replica_and_hit_its_cache(
    vllm_pair: VllmPair, proxy: ProxyProcess, http: httpx.Client, rng: random.Random
) -> None:
    name = "trl-policy-v21"
    resp = load_adapter(http, proxy.url, name, str(vllm_pair.adapters["lora_a"]))
    assert resp.status_code == 200, resp.text
    prompt = random_prompt(rng, 100)
    before = [prefix_counters(http, u) for u in vllm_pair.urls]

    first = _fan_out(http, proxy.url, _group(name, prompt, rng))
    middle = [prefix_counters(http, u) for u in vllm_pair.urls]
    second = _fan_out(http, proxy.url, _group(name, prompt, rng))
    after = [prefix_counters(http, u) for u in vllm_pair.urls]

    replicas = {c.replica for c in first + second}
    assert len(replicas) == 1, f"one prompt's rollouts went to replicas {replicas}"
    chosen = int(replicas.pop() or "-1")
    other = 1 - chosen
    # vLLM's own counters agree with the proxy's header: every prompt token was queried on the
    # chosen replica and none on the other.
    assert middle[chosen].queries - before[chosen].queries == GROUP * len(prompt)
    assert after[other] == before[other]
    # The second group finds the whole prompt cached (the first group may have been scheduled in
    # one engine step, where concurrent requests cannot yet reuse each other's blocks).
    hits = cache_hit_tokens(len(prompt), vllm_pair.block_size)
    assert after[chosen].hits - middle[chosen].hits == GROUP * hits


def test_a_version_loaded_everywhere_never_404s(
    vllm_pair: VllmPair, proxy: ProxyProcess, http: httpx.Client, rng: random.Random
) -> None:
    name = "trl-policy-v22"
    resp = load_adapter(http, proxy.url, name, str(vllm_pair.adapters["lora_b"]))
    assert resp.status_code == 200, resp.text
    for url in vllm_pair.urls:
        ids = [m["id"] for m in http.get(f"{url}/v1/models").json()["data"]]
        assert name in ids, f"{url} lacks {name} although the broadcast load answered 200"
    # Right after the load, distinct prompts spread over both replicas; none may 404.
    bodies = [trl_completion_body(name, random_prompt(rng, 40)) for _ in range(16)]
    results = _fan_out(http, proxy.url, bodies)
    assert {c.replica for c in results} == {"0", "1"}
    # Greedy tokens for the same prompt agree whichever replica served it.
    prompt = random_prompt(rng, 40)
    direct = [complete(http, u, trl_completion_body(name, prompt)) for u in vllm_pair.urls]
    via_proxy = complete(http, proxy.url, trl_completion_body(name, prompt))
    assert direct[0].token_ids == direct[1].token_ids == via_proxy.token_ids


def test_pause_with_cache_clearing_leaves_proxy_index_and_vllm_cold(
    vllm_pair: VllmPair, proxy: ProxyProcess, http: httpx.Client, rng: random.Random
) -> None:
    body = trl_completion_body(vllm_pair.served_name, random_prompt(rng, 100))
    complete(http, proxy.url, body)
    assert http.get(f"{proxy.url}/admin/fleet").json()["routing"]["index_blocks"] > 0

    assert http.post(f"{proxy.url}/pause", params={"mode": "keep"}).status_code == 200
    for url in vllm_pair.urls:
        assert http.get(f"{url}/is_paused").json() == {"is_paused": True}
    assert http.get(f"{proxy.url}/admin/fleet").json()["routing"]["index_blocks"] == 0
    assert http.post(f"{proxy.url}/resume").status_code == 200
    for url in vllm_pair.urls:
        assert http.get(f"{url}/is_paused").json() == {"is_paused": False}

    unmatched = _decisions(http, proxy, "unmatched")
    before = [prefix_counters(http, u) for u in vllm_pair.urls]
    complete(http, proxy.url, body)
    after = [prefix_counters(http, u) for u in vllm_pair.urls]
    # The proxy no longer claims a warm replica, and indeed no replica had the prompt cached.
    assert _decisions(http, proxy, "unmatched") == unmatched + 1
    assert sum(a.hits - b.hits for a, b in zip(after, before, strict=True)) == 0


def test_a_stream_through_the_proxy_front_equals_the_buffered_answer(
    vllm_pair: VllmPair, proxy: ProxyProcess, http: httpx.Client, rng: random.Random
) -> None:
    """Completions reach real vLLM through the proxy's protocol front (proxy/front.py): a
    streamed answer arrives as vLLM's SSE events, chunk-framed and complete, with the same
    tokens as the buffered answer to the same seeded request, and the connection stays usable."""
    prompt = random_prompt(rng, 40)
    body = trl_completion_body(vllm_pair.served_name, prompt, max_tokens=12)
    buffered = http.post(proxy.url + "/v1/completions", json=body)
    assert buffered.status_code == 200, buffered.text
    events: list[str] = []
    with http.stream("POST", proxy.url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["x-proxy-replica"] in ("0", "1")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == buffered.json()["choices"][0]["text"]
    assert http.post(proxy.url + "/v1/completions", json=body).status_code == 200
