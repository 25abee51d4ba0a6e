"""The common-prefix rule, in one place: how far each replica holds a prompt's block chain, and
how deep its shared preamble goes (router.py's docstring explains the rule).

Both sources of "who holds block d" feed this one walk: the proxy's own index
(``Router.matches``) and the replicas' KV events mixed with the index (``PreciseMatcher.reach``,
kv_view.py). They differ only in how they build ``held``, so they cannot drift apart.

Cost: this runs for every routed request over every prompt block (32 for a 512-token prompt), so
the per-block work is done by C-level list operations (``accumulate``, ``count``, ``index``),
and Python steps once per replica that drops out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate
from operator import and_


def mask_of(replicas: Iterable[int]) -> int:
    mask = 0
    for r in replicas:
        mask |= 1 << r
    return mask


def prefix_reach(
    held: Sequence[int],
    branching: Sequence[bool],
    eligible: int,
    replicas: Iterable[int],
    shift: int = 0,
) -> tuple[dict[int, int], int]:
    """(reach per replica, depth of the common preamble), both in blocks.

    ``held[d]``: bitmask of the eligible replicas holding block ``d`` (0-based, chain order);
    ``branching[d]``: the proxy saw two different continuations of block ``d`` that do not end
    a request there (empty when none does). A replica's reach is how many leading blocks it
    holds; block ``d`` is common when every eligible replica holds it or it branches, and common
    is inherited by every block before it (``specific`` turns reach into the match that counts
    as affinity). ``shift``: replica ``r`` is bit ``r + shift`` of ``held`` and ``eligible``
    (the prefix index passes its values masked in place rather than shifted down block by
    block)."""
    n = len(held)
    if n and held.count(held[0]) == n:
        # Every block held by the same replicas (a prompt only ever sent whole): one C-level
        # count says it, and each replica holds all of the chain or none of it.
        first = held[0]
        common = n if first == eligible else 0
        if not common and True in branching:
            common = n - branching[::-1].index(True)
        first >>= shift
        return {r: n if first >> r & 1 else 0 for r in replicas}, common
    common = 0
    if n:
        # The deepest common block, found from the deep end by C-level list searches.
        if eligible in held:
            common = n - held[::-1].index(eligible)
        if True in branching:
            common = max(common, n - branching[::-1].index(True))
    reach = dict.fromkeys(replicas, 0)
    # holding[d]: the replicas holding every block up to d. It only ever loses replicas, so each
    # value it takes is one contiguous run, measured with a C-level count: one step per replica
    # that drops out rather than one per block.
    holding = list(accumulate(held, and_))
    alive = eligible
    depth = 0
    while depth < n and alive:
        now = holding[depth]
        dropped = alive & ~now
        while dropped:
            low = dropped & -dropped
            reach[low.bit_length() - 1 - shift] = depth
            dropped ^= low
        alive = now
        if now:
            depth += holding.count(now)
    while alive:
        low = alive & -alive
        reach[low.bit_length() - 1 - shift] = n
        alive ^= low
    return reach, common


def specific(reach: dict[int, int], common: int) -> dict[int, int]:
    """Each replica's blocks beyond the common preamble."""
    return {r: d - common if d > common else 0 for r, d in reach.items()}
