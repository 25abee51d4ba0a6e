"""The common-prefix walk (proxy/core/reach.py) against a direct transcription of its rule."""

from __future__ import annotations

import random

import pytest

from proxy.core.reach import mask_of, prefix_reach, specific


def reference(
    held: list[int], branching: list[bool], eligible: int, replicas: list[int]
) -> tuple[dict[int, int], int]:
    common = max(
        (d + 1 for d in range(len(held)) if held[d] == eligible or branching[d]), default=0
    )
    reach = {}
    for r in replicas:
        n = 0
        while n < len(held) and held[n] >> r & 1:
            n += 1
        reach[r] = n
    return reach, common


@pytest.mark.parametrize("seed", range(300))
def test_prefix_reach_matches_the_rule(seed: int) -> None:
    rng = random.Random(seed)
    replicas = sorted(rng.sample(range(16), rng.randint(1, 8)))
    eligible = mask_of(replicas)
    depth = rng.randint(0, 40)
    # Mostly shrinking holder sets, as real chains are, with the odd block held out of order.
    held, alive = [], eligible
    for _ in range(depth):
        if rng.random() < 0.2:
            alive &= ~(1 << rng.choice(replicas))
        extra = (1 << rng.choice(replicas)) if rng.random() < 0.1 else 0
        held.append((alive | extra) & eligible)
    branching = [rng.random() < 0.05 for _ in range(depth)]
    assert prefix_reach(held, branching, eligible, replicas) == reference(
        held, branching, eligible, replicas
    )


def test_specific_counts_only_blocks_beyond_the_common_preamble() -> None:
    assert specific({0: 5, 1: 2, 2: 3}, 3) == {0: 2, 1: 0, 2: 0}
