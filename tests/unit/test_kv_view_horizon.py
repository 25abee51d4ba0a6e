"""The eviction horizon of the events views (proxy/core/kv_view.py, ``ReplicaView.doomed``): a
block a replica holds now but will have evicted before a request routed there is admitted does
not count, by the rules vLLM and the simulator follow (FCFS admission reserving the whole context,
LRU eviction of freed blocks, a finished request's blocks freed last block first)."""

from __future__ import annotations

from typing import Any

from proxy.core.kv_view import (
    EXPECTED_OUTPUT_TOKENS,
    OUTPUT_WINDOW,
    PENDING_TTL_S,
    STORED,
    PreciseMatcher,
    ReplicaView,
)
from proxy.core.prefix_index import PrefixIndex

BS = 16
OUT = -(-EXPECTED_OUTPUT_TOKENS // BS)  # output blocks a request reserves on admission


def stored(*keys: int) -> dict[str, Any]:
    return {"type": STORED, "block_hashes": list(keys), "parent_block_hash": None,
            "token_ids": [], "block_size": BS, "medium": "GPU"}  # fmt: skip


def chain(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


class Fleet:
    """Two live replicas behind a matcher, requests routed and answered by hand."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.views = {0: ReplicaView(), 1: ReplicaView()}
        self.seq = {0: 0, 1: 0}
        for r in self.views:
            self.report(r)  # seq 0: a fresh publisher, the view is live and empty
        self.now = 0.0
        self.matcher = PreciseMatcher(self.views, clock=lambda: self.now, block_size=lambda: BS)
        if capacity_blocks is not None:
            self.matcher.capacity_tokens = {0: capacity_blocks * BS, 1: capacity_blocks * BS}
        self.index = PrefixIndex(1000)
        self.decisions: list[object] = []  # alive until answered, as the data path keeps them

    def report(self, replica: int, *events: Any) -> None:
        self.views[replica].apply(self.seq[replica], [0.0, list(events), 0])
        self.seq[replica] += 1

    def reach(self, keys: list[int]) -> dict[int, int]:
        return self.matcher.specific_matches(self.index, keys, keys, [0, 1])

    def route(self, keys: list[int], replica: int) -> object:
        self.reach(keys)
        decision = object()
        self.decisions.append(decision)
        self.matcher.routed(decision, replica)
        return decision


def served_then_queued(capacity_blocks: int | None, queued_new_blocks: int) -> Fleet:
    """Replica 0 served a 10-block prompt (now finished, its blocks freed) and then received a
    request not yet admitted that must allocate ``queued_new_blocks`` prompt blocks."""
    fleet = Fleet(capacity_blocks)
    first = chain(10, 100)
    done = fleet.route(first, 0)
    fleet.report(0, stored(*first))  # admitted: its prompt blocks are cached
    assert fleet.matcher.outcome(done) is not None  # answered: its blocks are freed
    fleet.route(chain(queued_new_blocks, 500), 0)  # waiting: nothing reported yet
    return fleet


def test_blocks_the_queue_evicts_before_admission_do_not_count() -> None:
    # 45 blocks: 10 cached, 35 free; the queued request needs 5 + OUT = 43, so 8 cached blocks go
    # first, the freed prompt's last block first: 2 of its leading blocks remain.
    fleet = served_then_queued(45, 5)
    continuation = chain(10, 100) + chain(4, 900)
    assert fleet.reach(continuation) == {0: 2, 1: 0}
    # Once its whole history is evicted the continuation matches nothing there.
    assert served_then_queued(20, 5).reach(continuation) == {0: 0, 1: 0}


def test_without_a_known_capacity_or_with_room_every_held_block_counts() -> None:
    continuation = chain(10, 100) + chain(4, 900)
    assert served_then_queued(None, 5).reach(continuation) == {0: 10, 1: 0}
    # 10 cached + 43 to allocate fit in 53 blocks: nothing is evicted.
    assert served_then_queued(53, 5).reach(continuation) == {0: 10, 1: 0}
    assert served_then_queued(52, 5).reach(continuation) == {0: 9, 1: 0}


def test_a_request_never_admitted_stops_counting_as_waiting() -> None:
    # Its answer may never come back (retried elsewhere, the client gone): after PENDING_TTL_S
    # it no longer evicts anything in the model.
    fleet = served_then_queued(45, 5)
    continuation = chain(10, 100) + chain(4, 900)
    fleet.now = PENDING_TTL_S - 1.0
    assert fleet.reach(continuation) == {0: 2, 1: 0}
    fleet.now = PENDING_TTL_S + 1.0
    assert fleet.reach(continuation) == {0: 10, 1: 0}


def test_blocks_a_request_in_flight_pins_survive_the_queue() -> None:
    # A group sibling still running on replica 0 pins the shared prompt: no queue evicts it.
    fleet = Fleet(20)
    prompt = chain(10, 100)
    fleet.route(prompt, 0)
    fleet.report(0, stored(*prompt))
    fleet.route(chain(5, 500), 0)  # queued behind it
    assert fleet.reach(prompt + chain(3, 900)) == {0: 10, 1: 0}


def test_an_admitted_request_no_longer_counts_in_the_queue() -> None:
    fleet = served_then_queued(45, 5)
    fleet.report(0, stored(*chain(5, 500)))  # admitted: it allocated (the replica evicts, too)
    # 15 cached + one admitted request's output reservation: 45 - 15 - OUT free, no one waiting.
    assert fleet.reach(chain(10, 100) + chain(4, 900)) == {0: 10, 1: 0}


def test_an_unanswered_decision_is_released_when_its_id_is_reused() -> None:
    view = ReplicaView()
    view.apply(0, [0.0, [stored(1, 2, 3)], 0])
    matcher = PreciseMatcher({0: view}, clock=lambda: 0.0, block_size=lambda: BS)
    matcher.capacity_tokens = {0: 100 * BS}
    decision = object()
    matcher.specific_matches(PrefixIndex(100), [1, 2, 3], [1, 2, 3], [0])
    matcher.routed(decision, 0)
    assert view.pins == {1: 1, 2: 1, 3: 1} and not view.freed
    matcher.routed(decision, 0)  # the same id again: the first request is over
    assert view.pins == {1: 1, 2: 1, 3: 1} and len(view.held) == 1
    matcher.outcome(decision)
    assert view.pins == {} and list(view.freed) == [3, 2, 1]


def test_a_partly_evicted_home_keeps_its_rollout_unless_another_replica_holds_more() -> None:
    # The index sent the rollout's 10 blocks to replica 0; its view still holds 6 of them, the
    # group's first 4 are everywhere. Nothing holds more than the home: it is credited the
    # index's reach, as the index alone would score it (the views would give it 2 blocks).
    fleet = Fleet(None)
    history = chain(10, 100)
    fleet.index.record(history, 0)
    fleet.report(0, stored(*history[:6]))
    fleet.report(1, stored(*history[:4]))
    assert fleet.reach(history + [900]) == {0: 6, 1: 0}
    # Replica 1 really holds more than the home will: the views' answer stands.
    fleet.report(1, stored(*history[4:8]))
    assert fleet.reach(history + [900]) == {0: 0, 1: 2}


def test_the_queue_reserves_the_outputs_the_replicas_actually_generate() -> None:
    # 45 blocks, a queued request needing 5 new prompt blocks: with the cost model's 600 output
    # tokens (38 blocks) it evicts 8 of the freed prompt's blocks (the first test). Once answers
    # show requests generating 160 tokens (10 blocks), it needs 15 of the 35 free: nothing goes.
    fleet = served_then_queued(45, 5)
    continuation = chain(10, 100) + chain(4, 900)
    assert fleet.reach(continuation) == {0: 2, 1: 0}
    for tokens in (100, 220):  # mean 160
        fleet.matcher.observe_output(tokens)
    assert fleet.matcher.output_tokens == 160.0
    assert fleet.reach(continuation) == {0: 10, 1: 0}


def test_the_output_mean_follows_the_last_answers() -> None:
    matcher = PreciseMatcher({}, clock=lambda: 0.0, block_size=lambda: BS)
    assert matcher.output_tokens == EXPECTED_OUTPUT_TOKENS  # before any answer
    for _ in range(OUTPUT_WINDOW):
        matcher.observe_output(100)
    assert matcher.output_tokens == 100.0
    # Past the window the old answers fade: another window of 300s moves the mean most of the way.
    for _ in range(OUTPUT_WINDOW):
        matcher.observe_output(300)
    assert 220 < matcher.output_tokens < 300
