"""Prefix index: bounded, approximately LRU, per-replica holders, branching, purge."""

from __future__ import annotations

import tracemalloc

import pytest

from proxy.core.prefix_index import BRANCHING, HAS_CHILD, REQUEST_END, PrefixIndex


def test_record_and_lookup_leading_run() -> None:
    idx = PrefixIndex(100)
    idx.record([1, 2, 3], replica=0)
    idx.record([1, 2, 4], replica=1)
    values = idx.lookup([1, 2, 3, 5])
    assert len(values) == 3  # stops at the first unknown block
    assert idx.holders(values[0]) == 0b11
    assert idx.holders(values[2]) == 0b01
    assert values[1] & BRANCHING  # 2 was followed by 3 and by 4
    assert values[2] & REQUEST_END and not values[1] & REQUEST_END
    assert values[0] & HAS_CHILD and not values[0] & BRANCHING
    assert idx.lookup([9, 1]) == []


def test_size_is_bounded_and_evictions_counted() -> None:
    idx = PrefixIndex(1000)
    for i in range(10_000):
        idx.record([i], replica=i % 3)
        assert len(idx) <= 1000
    assert len(idx) >= 500
    assert idx.evictions == 10_000 - len(idx)


def test_recently_used_survives_eviction() -> None:
    idx = PrefixIndex(100)
    idx.record([-1], 0)
    for i in range(1000):
        idx.record([i], 1)
        if i % 20 == 0:
            assert idx.lookup([-1]), f"hot block evicted after {i} inserts"
    assert idx.lookup([0]) == []  # cold ones are gone


def test_forget_replica_and_clear() -> None:
    idx = PrefixIndex(100)
    idx.record([1, 2], 0)
    idx.record([1, 2], 2)
    idx.forget_replica(0)
    values = idx.lookup([1, 2])
    assert [idx.holders(v) for v in values] == [0b100, 0b100]
    idx.clear()
    assert len(idx) == 0 and idx.lookup([1]) == []


def test_replica_bounds() -> None:
    idx = PrefixIndex(10, max_replicas=4)
    with pytest.raises(ValueError):
        idx.record([1], 4)
    with pytest.raises(ValueError):
        PrefixIndex(1)


def test_memory_per_tracked_block() -> None:
    """Measured, not assumed: bytes of Python heap per tracked block at steady state (64-bit
    keys like real hashes, 2 replicas, chains of 16 blocks). The benchmark target is <= 150."""
    import random

    rng = random.Random(0)
    n = 100_000
    chains = [[rng.getrandbits(64) for _ in range(16)] for _ in range(n // 16)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(capacity=2 * n)
    for i, chain in enumerate(chains):
        idx.record(chain, replica=i % 2)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_block = (after - before) / len(idx)
    print(f"prefix index: {per_block:.1f} bytes per tracked block ({len(idx)} blocks)")
    assert len(idx) == n
    assert per_block <= 150


def test_recording_with_the_lookup_it_follows_is_recording_alone() -> None:
    """``record(keys, r, known=lookup(keys))`` (what the router does) leaves the index answering
    every lookup exactly as ``record(keys, r)`` does."""
    import random

    rng = random.Random(5)
    a, b = PrefixIndex(400, 8), PrefixIndex(400, 8)
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randint(1, 12))] for _ in range(30)]
    chains = []
    for _ in range(300):
        base = rng.choice(prefixes)
        chain = base + [rng.getrandbits(64) for _ in range(rng.randint(0, 6))]
        replica = rng.randrange(8)
        a.record(chain, replica)
        b.record(chain, replica, b.lookup(chain))
        chains.append(chain)
    for chain in chains[-60:]:
        assert a.lookup(chain) == b.lookup(chain)
    assert len(a) <= 400 and len(b) <= 400


def test_recording_a_known_chain_again_adds_only_what_is_new() -> None:
    """A prompt routed again (a group's rollouts) finds its chain known: sent to the same
    replica nothing changes; sent elsewhere, every block gains that holder."""
    index = PrefixIndex(1000, 4)
    chain = [11, 12, 13, 14]
    index.record(chain, 0)
    first = index.lookup(chain)
    index.record(chain, 0, index.lookup(chain))
    assert index.lookup(chain) == first
    index.record(chain, 1, index.lookup(chain))
    assert [index.holders(v) for v in index.lookup(chain)] == [0b11] * 4
    index.record(chain[:2], 2, index.lookup(chain[:2]))  # a shorter request ends at block 1
    values = index.lookup(chain)
    assert [index.holders(v) for v in values] == [0b111, 0b111, 0b11, 0b11]
    assert values[1] & REQUEST_END
    index.record([*chain, 15], 3)  # continued past its last block: linked, not branching
    values = index.lookup([*chain, 15])
    assert values[3] & HAS_CHILD and not values[3] & BRANCHING
    assert [index.holders(v) for v in values] == [0b1111, 0b1111, 0b1011, 0b1011, 0b1000]


@pytest.mark.parametrize("seed", range(60))
def test_reach_of_looked_up_values_is_the_walk_of_their_decoding(seed: int) -> None:
    """``PrefixIndex.reach`` (with its shortcut for a chain every eligible replica holds) is
    reach.py's walk over the holders and branching flags decoded block by block."""
    import random

    from proxy.core.prefix_index import _BRANCH_BITS, BRANCHING
    from proxy.core.reach import mask_of, prefix_reach

    rng = random.Random(seed)
    index = PrefixIndex(capacity=4096, max_replicas=4)
    chains = [[rng.randrange(1 << 60) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    for _ in range(rng.randint(1, 12)):
        chain = rng.choice(chains)
        cut = rng.randint(1, len(chain))
        tail = [rng.randrange(1 << 60) for _ in range(rng.randint(0, 3))]
        index.record(chain[:cut] + tail, rng.randrange(4))
        if rng.random() < 0.1:
            index.forget_replica(rng.randrange(4))
    for chain in chains:
        values = index.lookup(chain)
        replicas = sorted(rng.sample(range(4), rng.randint(1, 4)))
        count = rng.randint(0, len(values))
        eligible = mask_of(replicas)
        held = [index.holders(v) & eligible for v in values[:count]]
        branching = [v & _BRANCH_BITS == BRANCHING for v in values[:count]]
        assert index.reach(values, count, replicas) == prefix_reach(
            held, branching, eligible, replicas
        )


def test_a_block_whose_holders_are_all_forgotten_is_still_found() -> None:
    """A stored value keeps its link or request-end bit when its holders are cleared, so it is
    never mistaken for a missing block (``lookup`` tells a miss by a falsy value)."""
    index = PrefixIndex(capacity=64, max_replicas=2)
    index.record([1, 2, 3], 0)
    index.record([1], 1)
    index.forget_replica(0)
    index.forget_replica(1)
    values = index.lookup([1, 2, 3])
    assert len(values) == 3
    assert [index.holders(v) for v in values] == [0, 0, 0]
