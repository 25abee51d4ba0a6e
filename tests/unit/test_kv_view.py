"""The events view of each replica (proxy/core/kv_view.py): parsing untrusted batches, sequence
gaps and resyncs, bounded memory, and precise matches that plug into the router unchanged."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.extract import RoutingKey
from proxy.core.hashing import Namespace, VllmHasher
from proxy.core.kv_view import (
    CLEARED,
    PENDING_TTL_S,
    REMOVED,
    STORED,
    KvEvent,
    MalformedBatch,
    PreciseMatcher,
    ReplicaView,
    parse_batch,
    parse_event,
)
from proxy.core.policy import PrefixAffinity
from proxy.core.prefix_index import PrefixIndex
from proxy.core.reach import mask_of, prefix_reach
from proxy.core.router import Router

U64 = (1 << 64) - 1


def stored(*keys: int, **extra: Any) -> dict[str, Any]:
    return {"type": STORED, "block_hashes": list(keys), "parent_block_hash": None,
            "token_ids": [], "block_size": 16, "medium": "GPU", **extra}  # fmt: skip


def removed(*keys: int) -> dict[str, Any]:
    return {"type": REMOVED, "block_hashes": list(keys), "medium": "GPU"}


def cleared() -> dict[str, Any]:
    return {"type": CLEARED}


def batch(*events: Any) -> list[Any]:
    return [1795969975.85, list(events), 0]


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (stored(1, 2, U64), KvEvent(STORED, (1, 2, U64))),
        (removed(7), KvEvent(REMOVED, (7,))),
        (cleared(), KvEvent(CLEARED)),
        # Fields at their default are omitted on the wire (msgspec omit_defaults).
        ({"type": STORED, "block_hashes": [3]}, KvEvent(STORED, (3,))),
        # Older vLLM: array-like events, tag first.
        ([STORED, [5, 6], None, [], 16, None, "GPU"], KvEvent(STORED, (5, 6))),
        ([REMOVED, [5], None], KvEvent(REMOVED, (5,))),
        ([CLEARED], KvEvent(CLEARED)),
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: digest bytes, low 64 bits big-endian.
        (stored(bytes(24) + (9).to_bytes(8, "big")), KvEvent(STORED, (9,))),
        # Not routed on: offloaded media, and kinds a newer vLLM may add.
        (stored(1, medium="CPU"), None),
        ({"type": "BlockMoved", "block_hashes": [1]}, None),
    ],
)
def test_events_parse_into_keys(raw: Any, expected: KvEvent | None) -> None:
    assert parse_event(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        None,
        42,
        "BlockStored",
        [],
        [7, [1]],
        {"block_hashes": [1]},
        {"type": 5},
        {"type": STORED},
        {"type": STORED, "block_hashes": 5},
        {"type": STORED, "block_hashes": [-1]},
        {"type": STORED, "block_hashes": [1 << 64]},
        {"type": STORED, "block_hashes": [True]},
        {"type": STORED, "block_hashes": ["0x1"]},
        {"type": STORED, "block_hashes": [b"short"]},
        {"type": REMOVED, "block_hashes": [1.5]},
    ],
)
def test_malformed_events_raise_malformed_batch(raw: Any) -> None:
    with pytest.raises(MalformedBatch):
        parse_event(raw)


@pytest.mark.parametrize(
    "payload",
    [
        batch(stored(1)),
        [0.0, [stored(1)]],  # no data-parallel rank (older vLLM)
        {"ts": 0.0, "events": [stored(1)], "data_parallel_rank": 0},  # map-encoded batch
    ],
)
def test_batch_shapes(payload: Any) -> None:
    assert parse_batch(payload) == [KvEvent(STORED, (1,))]


@pytest.mark.parametrize("payload", [None, 1.0, [1.0], [1.0, "x"], {"ts": 1.0}, b"\x93"])
def test_malformed_batches(payload: Any) -> None:
    with pytest.raises(MalformedBatch):
        parse_batch(payload)


# -- one replica's view -------------------------------------------------------------------------


def live_view(capacity: int = 1000) -> ReplicaView:
    view = ReplicaView(capacity)
    assert view.gap_before(0) is None
    view.apply(0, batch())
    assert view.live
    return view


def test_store_remove_clear() -> None:
    view = live_view()
    view.apply(1, batch(stored(1, 2, 3), stored(2, 3)))  # re-reports are idempotent
    assert set(view.blocks) == {1, 2, 3}
    view.apply(2, batch(removed(3), removed(99)))  # removing an unknown key is harmless
    assert set(view.blocks) == {1, 2}
    view.apply(3, batch(cleared(), stored(4)))
    assert set(view.blocks) == {4} and view.live
    assert (view.batches, view.events, view.next_seq) == (4, 6, 4)


def test_stored_blocks_no_request_pins_count_as_freed_in_arrival_order() -> None:
    # Generated blocks and another client's are evictable from the moment they are stored; the
    # blocks of a request in flight here are not until it is released.
    view = live_view()
    view.hold(token=1, keys=[20, 21])
    view.apply(1, batch(stored(20, 21, 30), stored(31)))
    assert list(view.freed) == [30, 31]  # pinned 20 and 21 are not evictable
    stamps = dict(view.freed)
    view.apply(2, batch(stored(30)))  # a re-report keeps its place and stamp in the LRU order
    assert view.freed == stamps and list(view.freed) == [30, 31]
    view.release(1)
    assert list(view.freed) == [30, 31, 21, 20]  # freed last, first block evicted last


def test_held_prefix_stops_at_the_first_missing_block() -> None:
    view = live_view()
    view.apply(1, batch(stored(10, 11, 12, 14)))
    assert view.held_prefix([10, 11, 12, 13, 14]) == 3
    assert view.held_prefix([11, 12]) == 2
    assert view.held_prefix([13, 10]) == 0
    assert view.held_prefix([]) == 0


def test_a_gap_filled_by_replay_keeps_the_view_live() -> None:
    view = live_view()
    view.apply(1, batch(stored(1)))
    # Batches 2 and 3 were lost; 4 arrives.
    assert view.gap_before(4) == 2
    assert view.gaps == 1
    view.apply(1, batch(stored(666)))  # a replay may start earlier: overlap is ignored
    view.apply(2, batch(stored(2)))
    view.apply(3, batch(removed(1)))
    view.apply(5, batch(stored(777)))  # beyond the gap: comes live later, ignored here
    assert view.close_gap(4)
    view.apply(4, batch(stored(4)))
    assert view.live and set(view.blocks) == {2, 4}


def test_a_gap_without_replay_drops_the_view_until_a_clear() -> None:
    view = live_view()
    view.apply(1, batch(stored(1)))
    assert view.gap_before(5) == 2
    assert not view.close_gap(5)
    assert not view.live and view.dropped == 1 and len(view) == 0
    view.apply(5, batch(stored(5)))
    assert not view.live  # a partial view is never trusted...
    view.apply(6, batch(cleared(), stored(6)))
    assert view.live and set(view.blocks) == {6}  # ...until the cache is known empty


def test_joining_late_asks_for_everything_and_falls_back_without_it() -> None:
    view = ReplicaView(1000)
    assert view.gap_before(40) == 0
    # The replay buffer no longer holds seq 0: nothing applies, the view stays untrusted.
    view.apply(30, batch(stored(1)))
    assert not view.close_gap(40)
    view.apply(40, batch(stored(2)))
    assert not view.live and view.next_seq == 41


def test_joining_late_with_the_whole_history_replayed_is_live() -> None:
    view = ReplicaView(1000)
    assert view.gap_before(2) == 0
    for seq in (0, 1):
        view.apply(seq, batch(stored(seq + 100)))
    assert view.close_gap(2)
    view.apply(2, batch(stored(102)))
    assert view.live and set(view.blocks) == {100, 101, 102}


def test_publisher_restart_at_zero_resets_the_view() -> None:
    view = live_view()
    view.apply(1, batch(stored(1, 2)))
    assert view.gap_before(0) is None
    view.apply(0, batch(stored(3)))
    assert view.live and set(view.blocks) == {3}


def test_numbers_going_backwards_without_zero_drop_and_replay_from_zero() -> None:
    view = live_view()
    for seq in range(1, 10):
        view.apply(seq, batch(stored(seq)))
    assert view.gap_before(4) == 0
    assert not view.live and len(view) == 0


def test_a_malformed_batch_is_counted_skipped_and_drops_the_view() -> None:
    view = live_view()
    view.apply(1, batch(stored(1)))
    assert view.apply(2, batch(stored(2), {"type": STORED, "block_hashes": "x"}))
    assert view.malformed == 1 and not view.live and len(view) == 0
    assert view.next_seq == 3  # numbering carries on: the next batch is no gap
    assert view.gap_before(3) is None


def test_resyncs_and_drops_count_changes_of_trust_only() -> None:
    """/admin/kv_events' resyncs and dropped count the times a view became trusted and stopped
    being trusted: a clear on a live view is no resync, a drop of a dropped view no drop."""
    view = ReplicaView()
    view.apply(0, batch(stored(1)))
    view.apply(1, batch(cleared(), stored(2)))  # already live
    assert (view.resyncs, view.dropped) == (1, 0)
    view.drop()
    view.apply(2, batch(stored(3), {"type": STORED, "block_hashes": "x"}))  # malformed, dropped
    view.forget()
    assert (view.resyncs, view.dropped) == (1, 1)
    view.apply(0, batch(stored(4)))
    assert view.live and (view.resyncs, view.dropped) == (2, 1)


def test_forget_waits_for_a_new_numbering() -> None:
    view = live_view()
    view.apply(1, batch(stored(1)))
    view.forget()
    assert not view.live and view.next_seq is None
    assert view.gap_before(7) == 0


def test_memory_is_bounded_forgetting_the_oldest_blocks() -> None:
    view = live_view(capacity=3)
    view.apply(1, batch(stored(1, 2, 3)))
    view.apply(2, batch(stored(4, 5)))
    assert list(view.blocks) == [3, 4, 5] and view.overflow == 2


def test_untrusted_streams_never_raise() -> None:
    rng = random.Random(7)
    junk: list[Any] = [None, 1, "x", b"y", [], {}, [1.0, None], {"events": 3},
                       [0.0, [{"type": STORED, "block_hashes": [rng.random()]}]]]  # fmt: skip
    view = ReplicaView(100)
    for seq in range(200):
        payload = rng.choice([*junk, batch(stored(rng.randrange(50)))])
        start = view.gap_before(seq)
        if start is not None:
            view.close_gap(seq)
        view.apply(seq, payload)
    assert view.batches == 200 and view.malformed > 0


# -- precise matches ----------------------------------------------------------------------------


def route_randomly(router: Router, rng: random.Random, n: int) -> None:
    prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(5)]
    for _ in range(n):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(80))]
        router.route(RoutingKey("m", tokens, None, None, False, 1), [(r, 0.0) for r in range(3)])


@pytest.mark.parametrize("seed", range(20))
def test_without_live_views_precise_matches_equal_the_routers(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex(64 if seed % 2 else 100_000)  # small: evictions in the index too
    router = Router(VllmHasher(16), index, PrefixAffinity(8))
    route_randomly(router, rng, 60)
    views = {0: ReplicaView(), 1: live_view(), 2: ReplicaView()}
    views[1].drop()
    matcher = PreciseMatcher(views)
    for _ in range(40):
        tokens = [rng.randrange(1000) for _ in range(rng.randrange(200))]
        keys = router.block_keys(RoutingKey("m", tokens, None, None, False, 1))
        replicas = rng.sample(range(3), rng.randrange(1, 4))
        expected = router.specific_matches(keys, replicas)
        assert matcher.specific_matches(index, keys, keys, replicas) == expected


def chain(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_a_live_view_scores_what_the_replica_holds_not_what_it_was_sent() -> None:
    index = PrefixIndex(1000)
    keys = chain(6)
    index.record(keys, 0)  # the proxy sent the prompt to replica 0...
    views = {0: live_view(), 1: live_view()}
    views[1].apply(1, batch(stored(*keys[:4])))  # ...but only replica 1 holds (most of) it
    matcher = PreciseMatcher(views)
    assert matcher.specific_matches(index, keys, keys, [0, 1]) == {0: 0, 1: 4}


def test_views_fall_back_per_replica() -> None:
    index = PrefixIndex(1000)
    keys = chain(6)
    index.record(keys[:5], 0)
    views = {1: live_view()}  # replica 0 publishes nothing
    views[1].apply(1, batch(stored(*keys[:2])))
    matcher = PreciseMatcher(views)
    assert matcher.specific_matches(index, keys, keys, [0, 1]) == {0: 3, 1: 0}


def test_blocks_every_replica_holds_are_common_on_the_precise_view() -> None:
    index = PrefixIndex(1000)
    template, a = chain(3), chain(3, 100)
    views = {0: live_view(), 1: live_view()}
    views[0].apply(1, batch(stored(*template, *a)))
    views[1].apply(1, batch(stored(*template)))
    matcher = PreciseMatcher(views)
    # The template is held everywhere: only replica 0's specific blocks count.
    assert matcher.specific_matches(index, template + a, template + a, [0, 1]) == {0: 3, 1: 0}


def test_branching_from_the_index_still_marks_a_shared_preamble() -> None:
    index = PrefixIndex(1000)
    template, a, b = chain(3), chain(2, 100), chain(2, 200)
    index.record(template + a, 0)
    index.record(template + b, 0)  # two continuations: the template is a shared preamble
    views = {0: live_view(), 1: live_view()}
    views[0].apply(1, batch(stored(*template, *a, *b)))
    matcher = PreciseMatcher(views)
    c = chain(2, 300)
    assert matcher.specific_matches(index, template + c, template + c, [0, 1]) == {0: 0, 1: 0}


def test_multi_turn_continuation_keeps_its_affinity_on_the_precise_view() -> None:
    index = PrefixIndex(1000)
    prompt, turn_a, turn_b = chain(4), chain(2, 100), chain(2, 200)
    index.record(prompt, 1)  # the first turn ended here: a request end, not a template
    index.record(prompt + turn_a, 1)
    index.record(prompt + turn_b, 1)
    views = {0: live_view(), 1: live_view()}
    views[1].apply(1, batch(stored(*prompt, *turn_a, *turn_b)))
    matcher = PreciseMatcher(views)
    keys = prompt + turn_b
    assert matcher.specific_matches(index, keys, keys, [0, 1]) == {0: 0, 1: 6}


def test_when_the_views_find_nothing_specific_the_rollout_goes_home() -> None:
    """A continuation whose own history was evicted everywhere: the views leave only the
    group's prompt, held on both replicas; the index still knows where the rollout ran."""
    index = PrefixIndex(1000)
    prompt, history = chain(3), chain(4, 100)
    index.record(prompt + history, 1)
    views = {0: live_view(), 1: live_view()}
    views[0].apply(1, batch(stored(*prompt)))
    views[1].apply(1, batch(stored(*prompt, *history)))
    views[1].apply(2, batch(removed(*history)))
    matcher = PreciseMatcher(views)
    keys = prompt + history
    assert matcher.specific_matches(index, keys, keys, [0, 1]) == {0: 0, 1: 7}
    assert matcher.reach(index, index.lookup(keys), keys, [0, 1]) == ({0: 0, 1: 7}, 0)
    # The prediction checked against the replica's answer is still what its view holds.
    decision = object()
    matcher.routed(decision, 1)
    assert matcher.outcome(decision) == (3, True)


def test_what_a_view_holds_beats_the_index_memory_of_the_rollout() -> None:
    """The fallback is per request and only for a tie: one replica reporting a specific
    prefix decides, wherever the index thinks the rollout ran."""
    index = PrefixIndex(1000)
    prompt, history = chain(3), chain(4, 100)
    index.record(prompt + history, 1)
    views = {0: live_view(), 1: live_view()}
    views[0].apply(1, batch(stored(*prompt, *history[:2])))
    views[1].apply(1, batch(stored(*prompt)))
    matcher = PreciseMatcher(views)
    keys = prompt + history
    assert matcher.specific_matches(index, keys, keys, [0, 1]) == {0: 2, 1: 0}


@pytest.mark.parametrize("sent_to", [[], [0, 1]])
def test_with_nothing_specific_anywhere_the_views_answer_stands(sent_to: list[int]) -> None:
    """Neither source prefers a replica (the index never saw the prompt, or sent it to every
    replica): the views' reach and common depth stand, and load decides."""
    index = PrefixIndex(1000)
    prompt = chain(3)
    for r in sent_to:
        index.record(prompt, r)
    views = {0: live_view(), 1: live_view()}
    for view in views.values():
        view.apply(1, batch(stored(*prompt)))
    matcher = PreciseMatcher(views)
    keys = prompt + chain(2, 100)
    assert matcher.reach(index, index.lookup(keys), keys, [0, 1]) == ({0: 3, 1: 3}, 3)


def test_router_routes_on_the_view_and_remembers_the_prediction() -> None:
    hasher = VllmHasher(16, "sha256", "0")
    router = Router(hasher, PrefixIndex(1000), PrefixAffinity(8))
    views = {0: live_view(), 1: live_view()}
    router.precise = PreciseMatcher(views)
    tokens = list(range(100))
    vllm_keys = hasher.hash_tokens(tokens, Namespace("m"))
    views[1].apply(1, batch(stored(*vllm_keys[:5])))
    request = RoutingKey("m", tokens, None, None, False, 1)
    decision = router.route(request, [(0, 0.0), (1, 2.0)])
    assert (decision.replica, decision.outcome, decision.matched_blocks) == (1, "affinity", 5)
    assert router.precise.outcome(decision) == (5, True)
    assert router.precise.outcome(decision) is None  # read once
    # After an unload purges the name, the index keys change but vLLM's do not. (The sixth
    # block was just sent to replica 1: it counts as held there, see below.)
    router.purge_model("m")
    decision = router.route(request, [(0, 0.0), (1, 2.0)])
    assert decision.replica == 1 and decision.matched_blocks == 6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_group_stays_together_before_its_first_blocks_are_reported() -> None:
    """Events lag routing: the rest of a GRPO group arrives before vLLM reports the first
    rollout's blocks. What the proxy just sent counts as held until confirmed or expired."""
    clock = Clock()
    hasher = VllmHasher(16)
    router = Router(hasher, PrefixIndex(1000), PrefixAffinity(8))
    views = {0: live_view(), 1: live_view()}
    router.precise = PreciseMatcher(views, clock)
    tokens = list(range(100))
    request = RoutingKey("m", tokens, None, None, False, 1)
    loads = [[0, 0.0], [1, 0.0]]
    first = router.route(request, [tuple(x) for x in loads])  # type: ignore[misc]
    loads[first.replica][1] += 1
    for _ in range(7):
        d = router.route(request, [tuple(x) for x in loads])  # type: ignore[misc]
        assert (d.replica, d.outcome) == (first.replica, "affinity")
        loads[d.replica][1] += 1
    keys = hasher.hash_tokens(tokens, Namespace("m"))
    view = views[first.replica]
    assert view.held_prefix(keys[:6], clock.now) == 6 and len(view) == 0
    # Confirmed: the view holds them; a later eviction is believed at once.
    view.apply(1, batch(stored(*keys[:6])))
    assert not view.pending
    view.apply(2, batch(removed(keys[3])))
    assert view.held_prefix(keys[:6], clock.now) == 3
    # Never confirmed (the request never got scheduled): believed for PENDING_TTL_S only.
    other = views[1 - first.replica]
    other.expect(keys[:6], clock.now)
    assert other.held_prefix(keys[:6], clock.now + PENDING_TTL_S - 1) == 6
    assert other.held_prefix(keys[:6], clock.now + PENDING_TTL_S + 1) == 0
    assert not other.pending
    # A cache reset forgets claims too.
    other.expect(keys[:6], clock.now)
    other.apply(1, batch(cleared()))
    assert other.held_prefix(keys[:6], clock.now) == 0


def test_text_prompts_route_on_the_index_even_with_live_views() -> None:
    """Without a tokenizer a text prompt hashes approximately: vLLM's keys cannot match it."""
    router = Router(VllmHasher(16), PrefixIndex(1000), PrefixAffinity(8))
    router.precise = PreciseMatcher({0: live_view(), 1: live_view()})
    text = RoutingKey("m", None, b"x" * 400, None, False, 1)
    first = router.route(text, [(0, 0.0), (1, 0.0)])
    again = router.route(text, [(0, 0.0), (1, 0.0)])
    assert again.replica == first.replica and again.outcome == "affinity"
    assert router.precise.outcome(first) is None  # no prediction: nothing to check it against


# -- the hash check on adapter and non-root blocks ---------------------------------------------


@pytest.mark.parametrize(("proxy_seed", "confirmed"), [("0", True), (None, False)])
def test_predicted_adapter_blocks_confirm_or_refute_the_hashes(
    proxy_seed: str | None, confirmed: bool
) -> None:
    """An adapter's blocks (salted too) have no root block the proxy can recompute from the
    event (test_kv_events_edge.py says why); the blocks it predicted on a replica settle it:
    reported -> the hashes match; 256 expired unreported, none ever reported -> they differ."""
    clock = Clock()
    replica = VllmHasher(16, "sha256", "0")  # the replicas run with PYTHONHASHSEED=0
    router = Router(VllmHasher(16, "sha256", proxy_seed), PrefixIndex(10_000), PrefixAffinity(8))
    view = live_view(10_000)
    router.precise = PreciseMatcher({0: view}, clock)
    tokens = list(range(300, 300 + 16 * 300))  # 300 blocks: more than the refutation needs
    ns = Namespace("trl-policy-v3", "/adapters/v3", "salt")
    request = RoutingKey(ns.model, tokens, None, ns.cache_salt, False, 1)
    router.route(request, [(0, 0.0)], ns.lora_path)
    # vLLM schedules the request and reports its blocks, the root one aside (as if an earlier
    # request had cached it): every reported block is an adapter block with a parent.
    reported = replica.hash_tokens(tokens, ns)
    view.apply(1, batch(stored(*reported[1:], parent_block_hash=reported[0], lora_name=ns.model)))
    assert view.hashes_match is (True if confirmed else None)
    clock.now += PENDING_TTL_S + 1  # the proxy's other predictions expire unreported
    router.route(request, [(0, 0.0)], ns.lora_path)
    assert view.hashes_match is confirmed
    assert router.precise.live_mask([0]) == (1 if confirmed else 0)


def test_too_few_unconfirmed_predictions_refute_nothing() -> None:
    clock = Clock()
    view = live_view()
    matcher = PreciseMatcher({0: view}, clock)
    view.expect(chain(100), clock.now)  # a prompt sent, its request failed before scheduling
    clock.now += PENDING_TTL_S + 1
    assert view.held_prefix(chain(100), clock.now) == 0
    assert view.predictions_expired == 100 and view.hashes_match is None
    assert matcher.live_mask([0]) == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reaches=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    sent=st.lists(st.integers(0, 10), min_size=5, max_size=5),
    live=st.lists(st.booleans(), min_size=5, max_size=5),
    prompt=st.integers(0, 10),
)
def test_precise_reach_holds_each_live_replica_exactly_up_to_its_view(
    reaches: list[int], sent: list[int], live: list[bool], prompt: int
) -> None:
    """Per depth, a live replica counts as holding the block iff its view's held run passes
    that depth; other replicas as the index says. Reference: that definition, depth by depth."""
    replicas = list(range(len(reaches)))
    keys = chain(prompt, 1000)
    index = PrefixIndex(1000)
    views = {}
    for r in replicas:
        index.record(keys[: sent[r]], r)
        view = views[r] = live_view()
        view.apply(1, batch(stored(*chain(reaches[r], 1000))))
        if not live[r]:
            view.drop()
    matcher = PreciseMatcher(views)
    values = index.lookup(keys)
    got = matcher.reach(index, values, keys, replicas)
    live_mask = matcher.live_mask(replicas)
    held_by_view = {r: min(reaches[r], prompt) for r in replicas}
    depth_limit = max([len(values)] + [held_by_view[r] for r in replicas if live_mask >> r & 1])
    held = index.held(values, mask_of(replicas) & ~live_mask) + [0] * (depth_limit - len(values))
    for depth in range(depth_limit):
        for r in replicas:
            if live_mask >> r & 1 and held_by_view[r] > depth:
                held[depth] |= 1 << r
    branching = index.branching(values) + [False] * (depth_limit - len(values))
    reach, common = prefix_reach(held, branching, mask_of(replicas), replicas)
    if got != (reach, common):
        # Only the rollout-home rule may answer otherwise: nothing specific on the views (the
        # index scores), or the index's home holds the views' longest run and is credited the
        # index's longer reach, every other replica keeping the views' (round 7).
        index_reach = prefix_reach(index.held(values, mask_of(replicas)), index.branching(values),
                                   mask_of(replicas), replicas)  # fmt: skip
        if not any(d > common for d in reach.values()):
            assert got == index_reach
        else:
            got_reach, got_common = got
            assert got_common == common
            (home,) = [r for r in replicas if got_reach[r] != reach[r]]
            assert got_reach[home] == index_reach[0][home] == max(index_reach[0].values())
            assert reach[home] == max(reach.values()) < got_reach[home]
