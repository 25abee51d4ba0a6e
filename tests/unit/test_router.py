"""Router behaviour on GRPO-shaped traffic, with no event loop and no HTTP."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

import pytest

from proxy.core.extract import RoutingKey
from proxy.core.hashing import MAX_CHAIN_TAILS, FastHasher, Namespace, make_hasher
from proxy.core.policy import Candidate, CostBased, Decision, PrefixAffinity, RoundRobinTies
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router

TEMPLATE = list(range(1000, 1048))  # a 48-token chat template / system prompt (3 blocks)


def make_router(imbalance: float = 8) -> Router:
    return Router(FastHasher(16), PrefixIndex(100_000), PrefixAffinity(imbalance))


def key(tokens: list[int], model: str = "trl-policy-v1") -> RoutingKey:
    return RoutingKey(model, tokens, None, None, False, 1)


def prompt(rng: random.Random, n: int = 120) -> list[int]:
    return TEMPLATE + [rng.randrange(50_000) for _ in range(n)]


class Fleet:
    """In-flight bookkeeping the way the data plane does it."""

    def __init__(self, n: int) -> None:
        self.load = [0] * n

    def loads(self) -> list[tuple[int, float]]:
        return list(enumerate(map(float, self.load)))


def test_group_of_eight_lands_on_one_replica() -> None:
    router, fleet, rng = make_router(), Fleet(2), random.Random(1)
    for _ in range(10):
        p = prompt(rng)
        picks = set()
        for _ in range(8):
            d = router.route(key(p), fleet.loads())
            picks.add(d.replica)
            fleet.load[d.replica] += 1
        assert len(picks) == 1
        fleet.load = [0, 0]


def test_different_prompts_spread() -> None:
    router, fleet, rng = make_router(), Fleet(4), random.Random(2)
    counts = [0] * 4
    for _ in range(40):
        d = router.route(key(prompt(rng)), fleet.loads())
        counts[d.replica] += 1
        fleet.load[d.replica] += 1  # all stay in flight
    assert max(counts) - min(counts) <= 2, counts


def test_template_alone_is_not_affinity_once_warm() -> None:
    router, fleet, rng = make_router(), Fleet(2), random.Random(3)
    # Warm-up: two prompts on two replicas make the template common (rule 2).
    for _ in range(12):
        d = router.route(key(prompt(rng)), fleet.loads())
        fleet.load[d.replica] += 1
    outcomes = []
    for _ in range(20):
        d = router.route(key(prompt(rng)), fleet.loads())
        fleet.load[d.replica] += 1
        outcomes.append(d.outcome)
    assert set(outcomes) == {"unmatched"}


def test_continuation_follows_its_prefix_even_after_branching() -> None:
    router, fleet, rng = make_router(), Fleet(4), random.Random(4)
    for _ in range(8):  # warm the template up across replicas
        d = router.route(key(prompt(rng)), fleet.loads())
        fleet.load[d.replica] += 1
    p = prompt(rng)
    home = router.route(key(p), fleet.loads()).replica
    homes = set()
    for turn in range(8):  # 8 rollouts of the group each continue with a tool call
        completion = [rng.randrange(50_000) for _ in range(40)]
        d = router.route(key(p + completion + [7, 7, 7]), fleet.loads())
        homes.add(d.replica)
        assert d.outcome == "affinity", turn
    assert homes == {home}


def test_new_adapter_version_does_not_match_old_blocks() -> None:
    router, fleet = make_router(), Fleet(2)
    p = prompt(random.Random(5))
    router.route(key(p, "trl-policy-v1"), fleet.loads())
    d = router.route(key(p, "trl-policy-v2"), fleet.loads())
    assert d.outcome == "unmatched"
    assert router.route(key(p, "trl-policy-v2"), fleet.loads()).outcome == "affinity"


def test_affinity_yields_to_imbalance() -> None:
    router, fleet = make_router(imbalance=8), Fleet(2)
    p = prompt(random.Random(6))
    outcomes = []
    for _ in range(30):
        d = router.route(key(p), fleet.loads())
        fleet.load[d.replica] += 1
        outcomes.append(d.outcome)
    assert outcomes.count("spilled") > 0
    assert abs(fleet.load[0] - fleet.load[1]) <= 9


def test_purge_model_and_purge_all() -> None:
    router, fleet = make_router(), Fleet(2)
    p = prompt(random.Random(7))
    router.route(key(p), fleet.loads())
    router.purge_model("trl-policy-v1")
    assert router.route(key(p), fleet.loads()).outcome == "unmatched"
    router.purge_all()
    assert router.route(key(p), fleet.loads()).outcome == "unmatched"


def test_only_eligible_replicas_are_candidates_and_common_is_relative_to_them() -> None:
    router = make_router()
    p = prompt(random.Random(8))
    router.route(key(p), [(3, 0.0)])
    d = router.route(key(p), [(1, 0.0), (3, 0.0)])
    assert d.replica == 3 and d.outcome == "affinity"


def test_last_token_is_never_counted_as_a_hit() -> None:
    router, fleet = make_router(), Fleet(2)
    exact = list(range(32))  # two full blocks: vLLM can reuse at most (32-1)//16 = 1
    router.route(key(exact), fleet.loads())
    matches = router.specific_matches(router.block_keys(key(exact))[:1], [0, 1])
    assert max(matches.values()) <= 1


class LoadOnly(RoundRobinTies):
    """A policy that reads no prefixes (the bench's baselines are such)."""

    name = "load_only"
    uses_prefix = False

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        return Decision(self._least_loaded(candidates).replica, "unmatched", 0)


def test_policies_without_prefixes_skip_hashing() -> None:
    router = Router(FastHasher(16), PrefixIndex(10), LoadOnly())
    router.route(key(list(range(64))), [(0, 0.0), (1, 0.0)])
    assert len(router.index) == 0


@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize(
    "namespace",
    [
        Namespace("m"),
        Namespace("trl-policy-v3", "/adapters/v3", "salt", 0),
        Namespace("trl-policy-v3", "/adapters/v3", None, 7),
    ],
)
def test_extend_equals_hashing_the_whole_sequence(mode: str, namespace: Namespace) -> None:
    hasher = make_hasher(mode, 16)
    tokens = list(range(200))
    whole = hasher.hash_tokens(tokens, namespace)
    head = hasher.hash_tokens(tokens[:64], namespace)
    assert head + (hasher.extend(head[-1], tokens[64:], namespace) or []) == whole
    assert hasher.extend(head[-1], tokens[64:], namespace) is not None


def test_exact_extend_restarts_for_a_chain_it_no_longer_remembers() -> None:
    hasher = make_hasher("exact", 16)
    ns = Namespace("m")
    head = hasher.hash_tokens(list(range(64)), ns)
    for i in range(MAX_CHAIN_TAILS):  # other prompts hashed since
        hasher.hash_tokens([i] * 16, ns)
    assert hasher.extend(head[-1], list(range(64, 96)), ns) is None


def test_completion_is_remembered_so_the_next_turn_matches_it_too() -> None:
    router, fleet, rng = make_router(), Fleet(4), random.Random(9)
    for _ in range(8):
        d = router.route(key(prompt(rng)), fleet.loads())
        fleet.load[d.replica] += 1
    p = prompt(rng, 100)  # 148 tokens: 9 full blocks, 4 tokens of tail
    first = router.route(key(p), fleet.loads())
    completion = [rng.randrange(50_000) for _ in range(300)]
    router.record_completion(key(p), first, completion)
    turn2 = p + completion + [7] * 20
    d = router.route(key(turn2), fleet.loads())
    assert d.replica == first.replica and d.outcome == "affinity"
    assert d.matched_blocks >= (len(p) + len(completion)) // 16 - 4  # beyond the template


@pytest.mark.parametrize("use_native", [False, None], ids=["python", "auto"])
def test_a_continuation_hits_after_the_block_size_is_learned(use_native: bool | None) -> None:
    """The replicas' block size (32 on vLLM's CPU backend) replaces the default 16 after start:
    a completion is then learned in 32-token blocks too, so the next turn matches prompt and
    completion, not just the prompt."""
    router = Router(FastHasher(16, use_native), PrefixIndex(100_000), PrefixAffinity(8))
    router.use_hasher(FastHasher(32, use_native))
    rng = random.Random(12)
    p = array("I", [rng.randrange(50_000) for _ in range(100)])  # 3 full blocks, 4 of tail
    loads = [(0, 0.0), (1, 0.0)]
    first = router.route(key(p), loads)  # type: ignore[arg-type]
    completion = [rng.randrange(50_000) for _ in range(60)]
    router.record_completion(key(p), first, completion)  # type: ignore[arg-type]
    turn2 = [*p, *completion, *range(40)]  # 200 tokens: prompt + completion = 5 full blocks
    d = router.route(key(turn2), loads)
    assert d.replica == first.replica and d.outcome == "affinity"
    assert d.matched_blocks == (len(p) + len(completion)) // 32


def test_a_rollout_finishing_after_a_cache_clearing_pause_is_remembered() -> None:
    router, fleet, rng = make_router(), Fleet(2), random.Random(10)
    p = prompt(rng)
    frozen = router.route(key(p), fleet.loads())
    router.purge_all()  # pause with clear_cache while the rollout was in flight
    router.record_completion(key(p), frozen, [rng.randrange(50_000) for _ in range(64)])
    again = router.route(key(p), fleet.loads())
    assert again.replica == frozen.replica and again.matched_blocks > 0


def test_cost_policy_keeps_a_long_context_only_while_it_pays() -> None:
    router = Router(FastHasher(16), PrefixIndex(100_000), CostBased())
    rng = random.Random(9)
    context = prompt(rng, 4000)
    first = router.route(key(context), [(0, 0.0), (1, 0.0)]).replica
    other = 1 - first
    turn = context + [rng.randrange(50_000) for _ in range(100)]

    def loads(holder: float, rest: float) -> list[tuple[int, float]]:
        return sorted([(first, holder), (other, rest)])

    # Equal queues: re-prefilling 4,000 tokens elsewhere would stall 5 requests; stay.
    stay = router.route(key(turn), loads(4, 4))
    assert (stay.replica, stay.outcome) == (first, "affinity")
    assert stay.matched_blocks == len(context) // 16  # every full block of the first request
    # Four requests more on the holder cost more decode time than the prefill saves: move.
    moved = router.route(key(turn + [7] * 16), loads(8, 4))
    assert (moved.replica, moved.outcome) == (other, "spilled")


def test_cached_namespaces_follow_purges_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Namespaces are reused across requests, yet a purge still changes the key (its epoch is
    part of what the cache is keyed by), and per-request cache salts cannot grow the cache."""
    monkeypatch.setattr("proxy.core.router.MAX_CACHED_NAMESPACES", 4)
    monkeypatch.setattr("proxy.core.hashing.MAX_CACHED_SEEDS", 4)
    router = make_router()
    p = prompt(random.Random(11))
    before = router.block_keys(key(p))
    assert router.namespace(key(p)) is router.namespace(key(p))
    router.purge_model("trl-policy-v1")
    after = router.block_keys(key(p))
    assert after != before
    assert after == FastHasher(16).hash_tokens(p, Namespace("trl-policy-v1", None, None, 1))
    for salt in range(10):
        salted = RoutingKey("trl-policy-v1", p, None, f"salt-{salt}", False, 1)
        expected = FastHasher(16).hash_tokens(
            p, Namespace("trl-policy-v1", None, f"salt-{salt}", 1)
        )
        assert router.block_keys(salted) == expected
    assert len(router._namespaces) <= 4
    assert len(router.hasher._seeds) <= 4  # type: ignore[attr-defined]


@pytest.mark.parametrize(("policy", "learns"), [("cost", True), ("prefix", True), ("load", False)])
def test_only_prefix_aware_policies_learn_completions(policy: str, learns: bool) -> None:
    """The data path skips reading a completion's ids when the router would learn nothing."""
    from proxy.core.policy import make_policy

    chosen = LoadOnly() if policy == "load" else make_policy(policy, 8)
    router = Router(FastHasher(16), PrefixIndex(100_000), chosen)
    assert router.learns_completions is learns
    p = list(range(40))
    decision = router.route(key(p), [(0, 0.0), (1, 0.0)])
    router.record_completion(key(p), decision, list(range(100, 140)))
    # What a follow-up turn matches: learned completions only under prefix-aware policies.
    assert bool(len(router.index)) is learns
