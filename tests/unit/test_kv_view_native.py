"""The events views' per-key loops in C (proxy/core/_native.c's view_*) against their Python
reference (proxy/core/kv_view.py's _store, _remove, _hold, _release, _expect, _prefix).

Both run the same random operation sequences on their own copies of a view's containers; after
every operation the containers (their contents and their order: the LRU order of ``freed`` and
the expiry order of ``pending`` are what ``doomed`` and ``held_prefix`` read), the stamps drawn
and the returned values must be equal. A small key universe makes repeats, pins shared between
requests, removals of pinned blocks and re-stores of freed ones frequent. Then the same through
``ReplicaView`` itself: a view on each implementation fed the same batches, requests and lookups.
Skipped where the extension is not built."""

from __future__ import annotations

from collections import Counter, OrderedDict
from itertools import count
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.kv_view import (
    PYTHON_LOOPS,
    REMOVED,
    STORED,
    ReplicaView,
    loops_for,
)

pytest.importorskip("proxy.core._native", reason="the C extension is not built")

NATIVE = loops_for(True)

KEYS = st.lists(st.integers(0, 11), max_size=9)
# (operation, keys, argument): argument is a deadline for "expect", a stamp bound for "prefix".
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "hold", "release", "expect", "prefix"]),
        KEYS,
        st.integers(-1, 40),
    ),
    max_size=40,
)


class Containers:
    def __init__(self) -> None:
        self.blocks: dict[int, None] = {}
        self.pending: OrderedDict[int, float] = OrderedDict()
        self.freed: dict[int, int] = {}
        self.pins: Counter[int] = Counter()
        self.tick = count()

    def state(self) -> tuple[Any, ...]:
        # list(...) keeps the order; the next stamp shows how many were drawn.
        return (list(self.blocks), list(self.pending.items()), list(self.freed.items()),
                dict(self.pins), next(self.tick))  # fmt: skip


def run(loops: Any, c: Containers, op: str, keys: list[int], arg: int) -> Any:
    if op == "store":
        return loops.store(c.blocks, c.pending, c.freed, c.pins, c.tick, keys)
    if op == "remove":
        return loops.remove(c.blocks, c.pending, c.freed, keys)
    if op == "hold":
        return loops.hold(c.pins, c.freed, c.blocks, keys)
    if op == "release":
        return loops.release(c.pins, c.freed, c.blocks, c.tick, keys)
    if op == "expect":
        return loops.expect(c.blocks, c.pending, keys, float(arg))
    return loops.prefix(c.blocks, c.pending, c.freed, keys, arg)


@settings(max_examples=400, deadline=None)
@given(OPS)
def test_c_loops_equal_the_python_reference(ops: list[tuple[str, list[int], int]]) -> None:
    py, c = Containers(), Containers()
    for op, keys, arg in ops:
        assert run(NATIVE, c, op, keys, arg) == run(PYTHON_LOOPS, py, op, keys, arg), op
        assert c.state() == py.state(), (op, keys, arg)


def test_each_loop_is_exercised_where_its_order_matters() -> None:
    """A recorded sequence whose result depends on the details a mutation would change: a
    release frees last key first, a key pinned twice stays pinned after one release, a stored
    block nobody pins is freed when stored but a pinned one is not, a removal forgets it, a
    re-expected key moves to the end of ``pending``, and the prefix stops at a doomed block."""
    for loops in (PYTHON_LOOPS, NATIVE):
        c = Containers()
        assert loops.expect(c.blocks, c.pending, [1, 2, 3], 5.0) is None
        assert loops.expect(c.blocks, c.pending, [1], 6.0) is None
        assert list(c.pending.items()) == [(2, 5.0), (3, 5.0), (1, 6.0)]
        assert loops.hold(c.pins, c.freed, c.blocks, [1, 2, 3]) == 3
        assert loops.hold(c.pins, c.freed, c.blocks, [1]) == 3 - 2
        assert loops.store(c.blocks, c.pending, c.freed, c.pins, c.tick, [1, 2, 3, 4]) == 3
        assert list(c.freed) == [4] and not c.pending  # 1-3 pinned, 4 nobody's
        loops.release(c.pins, c.freed, c.blocks, c.tick, [1, 2, 3])
        assert list(c.freed) == [4, 3, 2] and c.pins == {1: 1}  # last key first; 1 still held
        loops.release(c.pins, c.freed, c.blocks, c.tick, [1])
        assert list(c.freed) == [4, 3, 2, 1] and not c.pins
        assert loops.remove(c.blocks, c.pending, c.freed, [3]) == 0
        assert list(c.blocks) == [1, 2, 4] and list(c.freed) == [4, 2, 1]
        stamps = c.freed
        # Doomed up to 2's stamp: the prefix 1, 2 stops at 2 (index 1).
        assert loops.prefix(c.blocks, c.pending, c.freed, [1, 2, 4], stamps[2]) == 1
        assert loops.prefix(c.blocks, c.pending, c.freed, [1, 2, 4], -1) == 3
        assert loops.prefix(c.blocks, c.pending, c.freed, [1, 2, 4], stamps[4]) == 2


def batch(op: str, keys: list[int]) -> dict[str, Any]:
    return {"type": STORED if op == "store" else REMOVED, "block_hashes": keys, "medium": "GPU"}


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(0, 30))
def test_views_on_either_loops_agree(ops: list[tuple[str, list[int], int]], cap: int) -> None:
    """ReplicaView on the C loops and on the Python ones, fed the same events, requests and
    lookups, answer the same and end in the same state."""
    views = [ReplicaView(use_native=False), ReplicaView(use_native=True)]
    seq = 1
    for v in views:
        v.apply(0, [0.0, []])
    for token, (op, keys, arg) in enumerate(ops):
        answers = []
        for v in views:
            if op in ("store", "remove"):
                v.apply(seq, [0.0, [batch(op, keys)]])
            elif op in ("hold", "expect"):
                v.expect(keys, float(token))
                v.hold(token, keys, float(token))
            elif op == "release":
                v.release(arg)
            else:
                doomed = v.doomed(cap, 2, float(token))
                answers.append((doomed, v.held_prefix(keys, float(token), doomed)))
        seq += op in ("store", "remove")
        if answers:
            assert answers[0] == answers[1]
        py, c = views
        assert (list(py.blocks), list(py.pending.items()), list(py.freed.items()),
                dict(py.pins), list(py.held)) == (
                list(c.blocks), list(c.pending.items()), list(c.freed.items()),
                dict(c.pins), list(c.held))  # fmt: skip
