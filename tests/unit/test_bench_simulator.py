"""The replica simulator's pure parts: block hashing, the KV-cache model, its configuration."""

from __future__ import annotations

import pytest

from bench.harness.simulator import Allocation, KVCache, Replica, SimClock, SimConfig, block_hashes

BS = 4  # small blocks keep the tables readable


def hashes(tokens: list[int], adapter: tuple[str, str] | None = None) -> list[int]:
    return block_hashes(tokens, adapter, BS)


# -- hashing ---------------------------------------------------------------------------------


def test_only_full_blocks_are_hashed() -> None:
    assert len(hashes(list(range(3)))) == 0
    assert len(hashes(list(range(4)))) == 1
    assert len(hashes(list(range(11)))) == 2


def test_hashes_chain_so_a_shared_prefix_shares_exactly_its_blocks() -> None:
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = hashes([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    c = hashes([9, 9, 9, 9, 5, 6, 7, 8, 9, 10, 11, 12])  # same block 1, different parent
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a[1] != c[1] and a[2] != c[2]


def test_adapter_is_part_of_every_block_key() -> None:
    toks = list(range(8))
    base = hashes(toks)
    v1 = hashes(toks, ("trl-policy-v1", "/a/v1"))
    v1_moved = hashes(toks, ("trl-policy-v1", "/b/v1"))
    assert not set(base) & set(v1)
    assert not set(v1) & set(v1_moved)  # vLLM keys LoRA blocks by name and path


def test_continuing_a_chain_equals_hashing_the_whole_sequence() -> None:
    toks = list(range(20))
    full = hashes(toks)
    tail = block_hashes(toks, None, BS, start=2, parent=full[1])
    assert full[2:] == tail


# -- KV cache --------------------------------------------------------------------------------


def test_second_identical_prompt_hits_all_but_the_capped_last_block() -> None:
    cache = KVCache(100)
    prompt = hashes(list(range(16)))  # 4 full blocks; vLLM's cap: (16 - 1) // 4 = 3
    first = cache.allocate(prompt, 3, total_blocks=6)
    assert first is not None and first.hit_blocks == 0
    second = cache.allocate(prompt, 3, total_blocks=6)
    assert second is not None and second.hit_blocks == 3


def test_blocks_of_running_requests_are_never_evicted() -> None:
    cache = KVCache(4)
    a = cache.allocate(hashes(list(range(8))), 1, total_blocks=4)
    assert a is not None
    assert cache.used_blocks == 4
    # The pool is full of pinned blocks: a new request must wait, not evict.
    assert cache.allocate(hashes(list(range(100, 108))), 1, total_blocks=1) is None
    cache.release(a, [])
    assert cache.used_blocks == 0
    assert cache.allocate(hashes(list(range(100, 108))), 1, total_blocks=1) is not None


def test_eviction_is_lru_and_tail_first_within_a_request() -> None:
    cache = KVCache(6)
    old = hashes(list(range(12)))  # 3 blocks
    new = hashes(list(range(50, 62)))
    a = cache.allocate(old, 2, total_blocks=3)
    assert a is not None
    cache.release(a, [])
    b = cache.allocate(new, 2, total_blocks=3)
    assert b is not None
    cache.release(b, [])
    assert cache.cached_blocks == 6
    # One more block evicts exactly one: the least recently freed request's tail block.
    c = cache.allocate(hashes(list(range(90, 94))), 0, total_blocks=1)
    assert c is not None and cache.evictions == 1
    assert cache.match(old, 3) == 2  # old[2] (its tail) went first
    assert cache.match(new, 3) == 3


def _full_of_two_finished_requests() -> tuple[KVCache, list[int], list[int]]:
    """A 4-block cache holding two finished 2-block prompts, x freed before y."""
    cache = KVCache(4)
    x, y = hashes(list(range(8))), hashes(list(range(20, 28)))
    for chain in (x, y):
        alloc = cache.allocate(chain, 2, total_blocks=2)
        assert alloc is not None
        cache.release(alloc, [])
    return cache, x, y


def test_blocks_registered_again_after_their_eviction_count_as_recomputed() -> None:
    cache, x, _ = _full_of_two_finished_requests()
    assert cache.recomputed_blocks == 0  # first registrations are not recompute
    z = cache.allocate(hashes(list(range(40, 48))), 0, total_blocks=2)  # evicts x, LRU
    assert z is not None and cache.evictions == 2
    cache.release(z, [])
    again = cache.allocate(x, 0, total_blocks=2)  # x's prefill again: both blocks recomputed
    assert again is not None and again.hit_blocks == 0
    assert cache.recomputed_blocks == 2
    cache.reset_counters()
    assert (cache.evictions, cache.recomputed_blocks) == (0, 0)


def test_a_hit_refreshes_recency() -> None:
    cache, x, y = _full_of_two_finished_requests()
    again = cache.allocate(x, 2, total_blocks=2)  # x is used again: now most recent
    assert again is not None and again.hit_blocks == 2
    cache.release(again, [])
    z = cache.allocate(hashes(list(range(40, 48))), 0, total_blocks=2)
    assert z is not None
    assert cache.match(x, 2) == 2 and cache.match(y, 2) == 0


def test_generated_blocks_become_cached_on_release() -> None:
    cache = KVCache(100)
    prompt_tokens = list(range(8))
    output = list(range(100, 108))
    seq = hashes(prompt_tokens + output)
    alloc = cache.allocate(seq[:2], 1, total_blocks=4)
    assert alloc is not None and alloc.anon == 2
    cache.release(alloc, seq[2:])
    # The next turn (prompt + completion + tool output) hits all four blocks.
    assert cache.match(hashes(prompt_tokens + output + [7, 7, 7, 7, 7]), 4) == 4


def test_reset_forgets_cached_blocks_but_keeps_running_ones_allocated() -> None:
    cache = KVCache(10)
    running = cache.allocate(hashes(list(range(8))), 1, total_blocks=3)
    done = cache.allocate(hashes(list(range(30, 38))), 1, total_blocks=2)
    assert running is not None and done is not None
    cache.release(done, [])
    cache.reset()
    assert cache.cached_blocks == 0
    assert cache.used_blocks == 3
    assert cache.allocate(hashes(list(range(8))), 1, total_blocks=3) is not None
    cache.release(running, [])  # releasing a block orphaned by the reset must not resurrect it
    assert cache.match(hashes(list(range(30, 38))), 2) == 0


def test_capacity_accounting_never_exceeds_the_pool() -> None:
    cache = KVCache(16)
    allocs: list[Allocation] = []
    for i in range(40):
        alloc = cache.allocate(hashes([i] * 12 + [i + 1] * 4), 3, total_blocks=5)
        if alloc is None:
            cache.release(allocs.pop(0), [])
            continue
        allocs.append(alloc)
        assert cache.used_blocks + len(cache._evictable) <= cache.capacity
    for alloc in allocs:
        cache.release(alloc, [])
    assert cache.used_blocks == 0


# -- configuration and sampling ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_blocks", 0), ("time_scale", 0.0), ("prefill_us_per_token", -1.0), ("max_num_seqs", 0)],
)
def test_bad_config_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SimConfig.from_overrides({field: value})


def test_cache_must_hold_one_full_context() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SimConfig(kv_blocks=10, max_model_len=4096)


def test_unknown_override_is_named() -> None:
    with pytest.raises(ValueError, match="kv_blokcs"):
        SimConfig.from_overrides({"kv_blokcs": 5})


def test_step_time_grows_with_the_batch() -> None:
    cfg = SimConfig()
    assert cfg.step_seconds(64) > cfg.step_seconds(1) > 0
    assert cfg.step_seconds(64) == pytest.approx(0.0072)


def test_completions_are_a_function_of_the_seed() -> None:
    replica = Replica(SimConfig(), SimClock(1.0))
    a, reason_a = replica.sample_output(42, 3000)
    b, _ = replica.sample_output(42, 3000)
    c, _ = replica.sample_output(43, 3000)
    assert a == b and a != c
    assert reason_a in ("stop", "length")
    short, reason = replica.sample_output(42, 3)
    assert len(short) == 3 and reason == "length"
    assert all(0 <= t < SimConfig().vocab_size for t in a)


def test_completion_lengths_follow_the_configured_median() -> None:
    replica = Replica(SimConfig(gen_median_tokens=600, gen_sigma=0.7), SimClock(1.0))
    lengths = sorted(len(replica.sample_output(s, 3000)[0]) for s in range(2000))
    assert 540 <= lengths[1000] <= 660
