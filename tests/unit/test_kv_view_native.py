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
    CLEARED,
    PYTHON_LOOPS,
    REMOVED,
    STORED,
    KvEvent,
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


class Event:
    """A typed decoder's event (proxy/kv_events.py): ``kind`` and ``keys`` as attributes."""

    def __init__(self, kind: str, keys: list[int]) -> None:
        self.kind, self.keys = kind, keys


# A batch: stores, removals, clears and kinds routing ignores, in any order.
BATCHES = st.lists(
    st.lists(
        st.tuples(st.sampled_from([STORED, REMOVED, STORED, REMOVED, CLEARED, "Other"]), KEYS),
        max_size=12,
    ),
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(BATCHES, st.integers(0, 3), OPS)
def test_c_batch_apply_equals_the_python_reference(
    batches: list[list[tuple[str, list[int]]]], start: int, pins: list[tuple[str, list[int], int]]
) -> None:
    """view_apply against _apply: from any start, it stops at the same event, counts the same
    confirmations and leaves the same containers, whatever is pinned or pending before."""
    py, c = Containers(), Containers()
    for op, keys, arg in pins:  # some pins, pending keys, freed blocks first
        if op in ("hold", "expect", "store"):
            run(PYTHON_LOOPS, py, op, keys, arg)
            run(NATIVE, c, op, keys, arg)
    for raw in batches:
        events = [Event(k, keys) if i % 2 else KvEvent(k, tuple(keys)) for i, (k, keys) in
                  enumerate(raw)]  # fmt: skip
        got_c = NATIVE.apply(c.blocks, c.pending, c.freed, c.pins, c.tick, events, start)
        got_py = PYTHON_LOOPS.apply(
            py.blocks, py.pending, py.freed, py.pins, py.tick, events, start
        )
        assert got_c == got_py
        assert c.state() == py.state()


def test_batch_apply_stops_at_a_clear_and_refuses_a_negative_start() -> None:
    for loops in (PYTHON_LOOPS, NATIVE):
        c = Containers()
        c.pending[2] = 1.0
        events = [
            KvEvent(STORED, (1, 2)),
            KvEvent(REMOVED, (1,)),
            KvEvent(CLEARED),
            KvEvent(STORED, (3,)),
        ]
        assert loops.apply(c.blocks, c.pending, c.freed, c.pins, c.tick, events, 0) == (1, 2)
        assert list(c.blocks) == [2] and list(c.freed) == [2]
        assert loops.apply(c.blocks, c.pending, c.freed, c.pins, c.tick, events, 3) == (0, 4)
        assert list(c.blocks) == [2, 3]
        assert loops.apply(c.blocks, c.pending, c.freed, c.pins, c.tick, events, 9) == (0, 9)
        with pytest.raises(ValueError):
            loops.apply(c.blocks, c.pending, c.freed, c.pins, c.tick, events, -1)


@settings(max_examples=200, deadline=None)
@given(BATCHES, OPS)
def test_views_on_either_loops_agree_on_whole_batches(
    batches: list[list[tuple[str, list[int]]]], ops: list[tuple[str, list[int], int]]
) -> None:
    """ReplicaView.apply on both loops with batches of many events (clears included) between
    requests routed and answered."""
    views = [ReplicaView(use_native=False), ReplicaView(use_native=True)]
    for v in views:
        v.apply(0, [0.0, []])
    for seq, raw in enumerate(batches, 1):
        payload = [0.0, [{"type": k, "block_hashes": keys} for k, keys in raw]]
        _, keys, arg = ops[seq % len(ops)] if ops else ("hold", [], 0)
        for v in views:
            v.apply(seq, payload)
            v.expect(keys, float(seq))
            v.hold(seq, keys, float(seq))
            v.release(arg)
        py, c = views
        assert (py.predictions_confirmed, py.events, py.resyncs, list(py.blocks),
                list(py.pending.items()), list(py.freed.items()), dict(py.pins)) == (
                c.predictions_confirmed, c.events, c.resyncs, list(c.blocks),
                list(c.pending.items()), list(c.freed.items()), dict(c.pins))  # fmt: skip
