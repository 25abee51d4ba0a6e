"""The cost policy learns each replica's KV capacity from its /metrics (vllm:cache_config_info's
num_gpu_blocks, as vLLM publishes it), once the health loop has scraped it."""

from __future__ import annotations

from tests.support.fake_vllm import FakeVllm
from tests.support.traffic import wait_until


def test_scraped_num_gpu_blocks_become_the_routers_kv_capacity(make_fleet) -> None:  # type: ignore[no-untyped-def]
    # Replica 1 reports "None" (vLLM's value before the cache is sized): unknown, not zero.
    h = make_fleet(fakes=[FakeVllm(name="a", num_gpu_blocks=1500), FakeVllm(name="b")])
    wait_until(lambda: h.rt.router.kv_capacity_tokens == {0: 1500 * 16})
    prompt = list(range(100))
    assert h.client.post(
        "/v1/completions", json={"model": "tiny/base", "prompt": prompt}
    ).is_success
