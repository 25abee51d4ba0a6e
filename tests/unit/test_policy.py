"""Routing policies, table-driven."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.core.policy import (
    COLD_START_CONCURRENCY,
    CONCURRENCY_MEMORY_DECISIONS,
    POLICIES,
    Candidate,
    CostBased,
    CostModel,
    PrefixAffinity,
    make_policy,
)


@pytest.mark.parametrize(
    ("candidates", "imbalance", "replica", "outcome"),
    [
        # longest specific match wins
        ([(0, 0, 0), (1, 0, 5)], 8, 1, "affinity"),
        ([(0, 3, 2), (1, 0, 5)], 8, 1, "affinity"),
        # match, but more than `imbalance` ahead of the least loaded: spill to least loaded
        ([(0, 0, 0), (1, 9, 5)], 8, 0, "spilled"),
        # exactly `imbalance` ahead is still affinity
        ([(0, 0, 0), (1, 8, 5)], 8, 1, "affinity"),
        # no match: least loaded
        ([(0, 4, 0), (1, 2, 0), (2, 3, 0)], 8, 1, "unmatched"),
        # equal matches: the less loaded of them
        ([(0, 5, 3), (1, 1, 3), (2, 0, 0)], 8, 1, "affinity"),
        # imbalance 0: affinity only when the matched replica is (one of) the least loaded
        ([(0, 1, 0), (1, 2, 4)], 0, 0, "spilled"),
    ],
)
def test_prefix_affinity_decisions(candidates, imbalance, replica, outcome) -> None:
    policy = PrefixAffinity(imbalance)
    decision = policy.choose([Candidate(*c) for c in candidates])
    assert (decision.replica, decision.outcome) == (replica, outcome)


def test_ties_are_round_robin() -> None:
    policy = PrefixAffinity(8)
    picks = [policy.choose([Candidate(i, 0, 0) for i in range(3)]).replica for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    assert picks[:3] != picks[1:4]


def test_bench_baselines_are_choosable_only_once_registered() -> None:
    from bench.harness.baseline_policies import LeastLoaded, RoundRobin, register

    rr = RoundRobin()
    picks = [rr.choose([Candidate(0, 9, 9), Candidate(1, 0, 0)]).replica for _ in range(4)]
    assert picks == [1, 0, 1, 0]
    assert LeastLoaded().choose([Candidate(0, 3, 9), Candidate(1, 1, 0)]).replica == 1
    assert set(POLICIES) == {"cost", "prefix"}
    register()
    try:
        assert make_policy("round_robin", 8).name == "round_robin"
        assert make_policy("least_loaded", 8).name == "least_loaded"
    finally:
        for name in ("round_robin", "least_loaded"):
            del POLICIES[name]


@pytest.mark.parametrize("name", ["round_robin", "least_loaded"])
def test_a_removed_baseline_is_refused_naming_the_default(name: str) -> None:
    with pytest.raises(ValueError, match=r"use 'cost'.*bench\.harness\.proxy_with_baselines"):
        make_policy(name, 8)


def test_registry_and_errors() -> None:
    assert make_policy("prefix", 8).name == "prefix"
    with pytest.raises(ValueError, match=r"unknown policy 'magic'.*'cost' is the default"):
        make_policy("magic", 8)
    with pytest.raises(ValueError):
        PrefixAffinity(8).choose([])
    with pytest.raises(ValueError):
        PrefixAffinity(-1)


# The cost model's unit prices: one load unit costs 2 * 600 * 0.05 ms = 60 ms of decode
# interference; one new prompt token costs 10 us times (1 + load).
LOAD_UNIT_S = 2 * 600 * 0.05e-3


@pytest.mark.parametrize(
    ("candidate", "expected_s"),
    [
        # idle replica: only its own prefill
        (Candidate(0, 0, 0, 1000), 1000 * 10e-6),
        # a busy replica: the prefill stalls the 3 running requests too, plus decode interference
        (Candidate(0, 3, 0, 1000), 1000 * 10e-6 * 4 + 3 * LOAD_UNIT_S),
        # everything cached: decode interference alone
        (Candidate(0, 5, 40, 0), 5 * LOAD_UNIT_S),
        # a fractional load (the scraped queue) counts as such; negative inputs count as zero
        (Candidate(0, 0.5, 0, 0), 0.5 * LOAD_UNIT_S),
        (Candidate(0, -1, 0, -5), 0.0),
    ],
)
def test_cost_model_prices(candidate: Candidate, expected_s: float) -> None:
    assert CostModel().cost(candidate) == pytest.approx(expected_s)


# (replica, load, matched blocks, new tokens) per candidate -> expected pick and outcome.
@pytest.mark.parametrize(
    ("candidates", "replica", "outcome"),
    [
        # GRPO: a 110-token specific prefix saves ~1 ms per stalled request, far less than one
        # more request's decode interference (60 ms): balance wins.
        ([(0, 1, 7, 38), (1, 0, 0, 150)], 1, "spilled"),
        # ... but between equally loaded replicas the match decides.
        ([(0, 2, 7, 38), (1, 2, 0, 150)], 0, "affinity"),
        # Agentic late turn, 5,600 of 6,000 tokens cached on replica 0, 8 requests running on
        # replica 1: re-prefilling there costs 6,000 * 10 us * 9 = 540 ms; four more requests
        # on replica 0 cost 4 * 64 ms: affinity (0.772 s against 1.02 s).
        ([(0, 12, 350, 400), (1, 8, 0, 6000)], 0, "affinity"),
        # ... nine more (1.092 s against 1.02 s) no longer pay.
        ([(0, 17, 350, 400), (1, 8, 0, 6000)], 1, "spilled"),
        # With nothing running on replica 1, even one more request on replica 0 costs more
        # than prefilling the whole context on an idle replica (68 ms against 60 ms).
        ([(0, 1, 350, 400), (1, 0, 0, 6000)], 1, "spilled"),
        # no match anywhere: the least loaded
        ([(0, 3, 0, 500), (1, 1, 0, 500), (2, 2, 0, 500)], 1, "unmatched"),
        # the deeper of two matches, when loads are equal
        ([(0, 1, 3, 600), (1, 1, 9, 504)], 1, "affinity"),
        # a shallower match on an idle replica beats the deepest match on a busy one
        ([(0, 0, 3, 600), (1, 3, 9, 504), (2, 0, 0, 648)], 0, "spilled"),
    ],
)
def test_cost_based_decisions(
    candidates: list[tuple[int, float, int, int]], replica: int, outcome: str
) -> None:
    decision = CostBased().choose([Candidate(*c) for c in candidates])
    assert (decision.replica, decision.outcome) == (replica, outcome)
    assert decision.matched_blocks == candidates[replica][2]


def test_cost_ties_rotate_and_the_model_is_replaceable() -> None:
    policy = CostBased()
    picks = [policy.choose([Candidate(i, 1, 0, 100) for i in range(3)]).replica for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    # With decode free, only prefill (and the stalls it causes) counts: one new token on a
    # replica with 50 requests (51 us) beats 100 on an idle one (1 ms).
    free_decode = CostBased(CostModel(decode_s_per_seq_step=0.0))
    assert free_decode.choose([Candidate(0, 50, 5, 1), Candidate(1, 0, 0, 100)]).replica == 0
    assert CostBased().choose([Candidate(0, 50, 5, 1), Candidate(1, 0, 0, 100)]).replica == 1


def test_cost_is_the_default_policy() -> None:
    from proxy.settings import Settings

    assert Settings(replicas=["http://127.0.0.1:1"]).policy == "cost"
    assert make_policy("cost", 8).name == "cost"
    assert set(POLICIES) == {"cost", "prefix"}


# The memory term's unit: a request holds its blocks for 600 decode steps of 4 ms + 0.05 ms per
# running sequence.
def _hold_s(slots: float) -> float:
    return 600 * (4e-3 + 0.05e-3 * slots)


@pytest.mark.parametrize(
    ("candidate", "memory_s"),
    [
        # capacity unknown (not scraped): no memory term
        (Candidate(0, 30, 0, 2000, 2000, 0), 0.0),
        # 24,000 tokens hold 9.6 requests of 1,900 + 600 tokens: with 5 there, all fit
        (Candidate(0, 5, 0, 1900, 1900, 24_000), 0.0),
        # with 15 there, 16 - 9.6 = 6.4 wait; a miss allocates 2,500 tokens (its prompt and
        # its output) for 600 steps at a batch of 9.6
        (Candidate(0, 15, 0, 1900, 1900, 24_000), 6.4 * 2500 / 24_000 * _hold_s(9.6)),
        # a hit shares the held prefix: only its 100 new prompt tokens and its output are new
        (Candidate(0, 15, 112, 100, 1900, 24_000), 6.4 * 700 / 24_000 * _hold_s(9.6)),
    ],
)
def test_memory_is_priced_only_where_the_cache_cannot_hold_the_queue(
    candidate: Candidate, memory_s: float
) -> None:
    model = CostModel()
    compute_only = dataclasses.replace(candidate, kv_capacity_tokens=0)
    assert model.cost(candidate) - model.cost(compute_only) == pytest.approx(memory_s)


@pytest.mark.parametrize(
    "model",
    [
        CostModel(),
        CostModel(
            prefill_s_per_token=3e-6,
            decode_s_per_seq_step=0.2e-3,
            expected_output_tokens=250.0,
            decode_step_base_s=9e-3,
        ),
    ],
)
@pytest.mark.parametrize(
    ("candidate", "duplicate_tokens", "projected_waiting"),
    [
        (Candidate(0, 15, 0, 1900, 1900, 24_000), 0, 0.0),
        (Candidate(0, 15, 112, 100, 1900, 24_000), 0, 0.0),
        (Candidate(0, 2.5, 0, 300, 4000, 8_192), 0, 0.0),
        (Candidate(0, -3, 0, -7, -1, 8_192), 0, 0.0),
        (Candidate(1, 0, 0, 1578, 1978, 24_400), 1564, 6.5),
        (Candidate(1, 12, 0, 1578, 1978, 24_400), 1564, 0.5),
    ],
)
def test_cost_inlines_slots_and_hold_seconds_exactly(
    model: CostModel, candidate: Candidate, duplicate_tokens: int, projected_waiting: float
) -> None:
    """``cost`` writes ``slots`` and ``hold_seconds`` inline for speed: its memory term is the
    one those methods define."""
    slots = model.slots(candidate)
    now = (max(candidate.load, 0) + 1 - slots) * (
        max(candidate.new_tokens, 0) + model.expected_output_tokens
    )
    blocked = max(now, projected_waiting * duplicate_tokens, 0.0)
    expected = blocked / candidate.kv_capacity_tokens * model.hold_seconds(slots)
    compute_only = dataclasses.replace(candidate, kv_capacity_tokens=0)
    memory = model.cost(candidate, duplicate_tokens, projected_waiting) - model.cost(
        compute_only, duplicate_tokens, projected_waiting
    )
    assert memory == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_memory_keeps_a_group_together_where_compute_alone_splits_it() -> None:
    """Tight x4's case (bench/results/routing.md): a group member arrives while replica 0, which
    holds the group's 1,500-token prompt, has five requests more than replica 1. Compute alone
    spills: the prefill saved (15 ms per stalled request) is less than five more requests'
    decode interference (1.35 s against 1.28 s). When both caches are full, the copy on
    replica 1 costs memory the requests queued there wait for: affinity."""
    hit = (0, 21, 94, 400)
    miss = (1, 16, 0, 1900)
    compute = CostBased().choose([Candidate(*hit), Candidate(*miss)])
    assert (compute.replica, compute.outcome) == (1, "spilled")
    full = CostBased().choose([Candidate(*hit, 1900, 24_000), Candidate(*miss, 1900, 24_000)])
    assert (full.replica, full.outcome) == (0, "affinity")
    # ... and plenty of memory (an H100's 2.2M tokens) leaves the compute decision alone.
    roomy = CostBased().choose(
        [Candidate(*hit, 1900, 2_240_000), Candidate(*miss, 1900, 2_240_000)]
    )
    assert roomy.replica == 1
    # Memory does not pin a request to a full replica: a replica with room wins.
    idle = CostBased().choose(
        [Candidate(*hit, 1900, 24_000), Candidate(1, 2, 0, 1900, 1900, 24_000)]
    )
    assert (idle.replica, idle.outcome) == (1, "spilled")


def test_an_h100s_cache_never_charges_memory_for_the_benchmarks_roomy_workloads() -> None:
    """grpo and agentic run on 140,000-block replicas (bench/harness/simulator.py: an H100-80GB's KV
    cache for this model): 2.24M tokens hold 254 requests of the longest 8,192-token context plus
    600 expected tokens, more than the 64 rollouts TRL keeps in flight. There the memory term is
    zero and the policy decides exactly as before it existed."""
    model = CostModel()
    for load in range(254):
        roomy = Candidate(0, load, 0, 8192, 8192, 140_000 * 16)
        assert model.cost(roomy) == model.cost(dataclasses.replace(roomy, kv_capacity_tokens=0))


def _learn_concurrency(policy: CostBased, in_flight: int) -> None:
    """One decision with ``in_flight`` requests already spread over two unknown-capacity
    replicas: the policy learns the fleet's concurrency from it."""
    half = in_flight / 2
    policy.choose([Candidate(0, half, 0, 100), Candidate(1, half, 0, 100)])


# Tight x4 (bench/results/routing.md): 24,400-token caches, a group's 1,978-token prompt
# (400 of them the common template) and 64 rollouts in flight. (replica, load, matched blocks,
# new tokens, prompt tokens, capacity) of the second member of a group on a fleet that is
# otherwise empty: replica 0 holds the group's prompt (one request running), replica 1 nothing.
HOLDER = (0, 1, 98, 14, 1978, 24_400)
EMPTY = (1, 0, 0, 1578, 1978, 24_400)


def test_a_burst_group_stays_whole_when_the_fleet_will_not_hold_its_contexts() -> None:
    """Compute alone splits the group: a second decode neighbour costs 60 ms, a 1,578-token
    prefill on the idle replica 16 ms. Once the policy has seen 64 requests in flight, the fleet
    (4 x 24,400 tokens) holds 37.9 of their 2,578-token contexts: 26.1 wait for blocks, 6.5 of
    them on each replica, and the copy keeps 1,564 tokens from them for 600 decode steps."""
    idle = [Candidate(r, 0, 0, 1578, 1978, 24_400) for r in (2, 3)]
    fleet = [Candidate(*HOLDER), Candidate(*EMPTY), *idle]
    # Without a concurrency (learned or assumed) only the current queue counts: the copy is free.
    assert CostBased(concurrency=0.0).choose(fleet).outcome == "spilled"
    # The cold-start assumption (TRL's reference 128 in flight) already keeps it whole.
    assert CostBased().choose(fleet).outcome == "affinity"
    policy = CostBased(concurrency=0.0)
    _learn_concurrency(policy, 63)
    excess, capacity = policy._projected_excess(fleet)
    assert capacity == 4 * 24_400
    learned = 64 * (1 - 1 / CONCURRENCY_MEMORY_DECISIONS)  # one decision's decay since
    assert excess == pytest.approx(learned - capacity / 2578)
    decision = policy.choose(fleet)
    assert (decision.replica, decision.outcome) == (0, "affinity")
    # The price of the copy: the projected queue on replica 1 times the copy's share of its
    # cache, for as long as a request holds its blocks.
    model = CostModel()
    waiting = excess / 4
    slots = 24_400 / 2578
    copy = model.cost(Candidate(*EMPTY), 1564, waiting) - model.cost(Candidate(*EMPTY))
    assert copy == pytest.approx(waiting * 1564 / 24_400 * _hold_s(slots))


def test_roomy_caches_or_unknown_capacity_leave_the_burst_decision_to_compute() -> None:
    """The same group on H100-sized caches (2.24M tokens each: the fleet holds every context)
    or before the capacities are scraped: balance wins, as without the projected term."""
    for capacity in (2_240_000, 0):
        policy = CostBased()  # the cold-start 128 in flight, then 64 learned
        _learn_concurrency(policy, 63)
        fleet = [
            Candidate(*HOLDER[:5], capacity),  # type: ignore[misc]
            Candidate(*EMPTY[:5], capacity),  # type: ignore[misc]
        ]
        assert policy.choose(fleet).replica == 1


def test_a_group_spreads_once_its_holder_is_full() -> None:
    """Tight x16: 8,192-token caches hold 3.2 contexts of 2,578 tokens, so a group of 8 cannot
    stay on one replica without queuing for memory there; once the holder has 3 requests the
    copy is no longer avoidable and balance decides, as without the projected term."""
    small = 8_192
    holder = (0, 2, 98, 14, 1978, small)
    assert (
        CostBased().choose([Candidate(*holder), Candidate(1, 0, 0, 1578, 1978, small)]).replica == 0
    )
    full = (0, 3, 98, 14, 1978, small)
    decision = CostBased().choose([Candidate(*full), Candidate(1, 0, 0, 1578, 1978, small)])
    assert (decision.replica, decision.outcome) == (1, "spilled")


def test_the_learned_concurrency_follows_a_drop_within_the_memory_window() -> None:
    assert CostBased().concurrency == COLD_START_CONCURRENCY
    policy = CostBased(concurrency=0.0)
    _learn_concurrency(policy, 63)
    assert policy.concurrency == 64
    for _ in range(CONCURRENCY_MEMORY_DECISIONS):
        _learn_concurrency(policy, 7)
    # (1 - 1/N)^N ~ 1/e of the peak, never below what is in flight now
    assert 8 < policy.concurrency < 64 * 0.37
    for _ in range(8 * CONCURRENCY_MEMORY_DECISIONS):
        _learn_concurrency(policy, 7)
    assert policy.concurrency == pytest.approx(8, abs=0.1)


# A late-turn continuation on tight x8's caches (763 blocks: 12,208 tokens): its 5,000-token
# prompt (5,600-token contexts, 2.18 slots) is held by replica 0 but for the last turn's 700
# tokens; the other seven replicas hold only the 400-token template. (replica, load, matched
# blocks, new tokens, prompt tokens, capacity).
CAPACITY = 12_208
CONTEXT_SLOTS = CAPACITY / (5000 + 600)


def _continuation_fleet(holder_load: float, other_load: float) -> list[Candidate]:
    return [
        Candidate(0, holder_load, 268, 700, 5000, CAPACITY),
        *(Candidate(r, other_load, 0, 4600, 5000, CAPACITY) for r in range(1, 8)),
    ]


def _wait_s(load: float) -> float:
    """This request's own FCFS wait for blocks on a replica with ``load`` in flight."""
    return max(load + 1 - CONTEXT_SLOTS, 0.0) * _hold_s(CONTEXT_SLOTS) / CONTEXT_SLOTS


def test_a_lone_saturated_holder_is_charged_the_wait_beyond_the_fleets_and_a_turnover() -> None:
    """x8's tail (bench/results/kv_events.md): the holder has ~9x its cache in flight while
    the rest of the fleet queues ~3x. Without the own-wait term the held prefix wins (its
    memory term charges only the 700 new tokens and the output, a copy elsewhere the whole
    context); with it, the request goes where it will not wait for a whole cache's turnover
    more than anywhere else."""
    fleet = _continuation_fleet(holder_load=20, other_load=7)
    policy = CostBased(concurrency=0.0)
    charges = policy._own_wait_beyond_fleet(fleet)
    assert charges is not None
    mean = (_wait_s(20) + 7 * _wait_s(7)) / 8
    assert charges[0] == pytest.approx(_wait_s(20) - mean - _hold_s(CONTEXT_SLOTS))
    assert charges[1:] == [0.0] * 7
    model = CostModel()
    without = [model.cost(c) for c in fleet]
    assert without.index(min(without)) == 0  # the pile-up the term exists to stop
    decision = policy.choose(fleet)
    assert (decision.replica != 0, decision.outcome) == (True, "spilled")


def test_a_uniformly_full_fleet_or_a_queue_within_a_turnover_charges_no_own_wait() -> None:
    """Every replica equally far past its cache: joining any queue displaces another request,
    so nothing is charged and affinity stays. A holder within one cache turnover of the
    fleet's queue (two requests more on 2.18 slots; a group landing together) is not charged
    either."""
    for holder_load, other_load in ((20, 20), (9, 7)):
        fleet = _continuation_fleet(holder_load, other_load)
        policy = CostBased(concurrency=0.0)
        assert policy._own_wait_beyond_fleet(fleet) == [0.0] * 8
        decision = policy.choose(fleet)
        assert (decision.replica, decision.outcome) == (0, "affinity")


def test_roomy_or_unknown_caches_have_no_own_wait_term() -> None:
    """No replica makes the request wait for memory (an H100's cache), or a capacity is not
    scraped yet: the term is absent and the decision is the cost model's alone."""
    fleet = _continuation_fleet(20, 7)
    roomy = [dataclasses.replace(c, kv_capacity_tokens=2_240_000) for c in fleet]
    assert CostBased()._own_wait_beyond_fleet(roomy) is None
    fleet[2] = dataclasses.replace(fleet[2], kv_capacity_tokens=0)
    assert CostBased()._own_wait_beyond_fleet(fleet) is None
