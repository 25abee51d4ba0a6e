"""What the router hands the policies: the prompt, what each replica would prefill, and each
replica's KV capacity once scraped."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.core.extract import RoutingKey
from proxy.core.hashing import FastHasher, Namespace, VllmHasher
from proxy.core.kv_view import PreciseMatcher, ReplicaView
from proxy.core.policy import Candidate, Decision, RoundRobinTies
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router


class Recording(RoundRobinTies):
    name = "recording"
    uses_prefix = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Candidate] = []

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        self.seen = list(candidates)
        return Decision(self._least_loaded(candidates).replica, "unmatched", 0)


def test_candidates_carry_the_prompt_and_the_scraped_capacity() -> None:
    policy = Recording()
    router = Router(FastHasher(16), PrefixIndex(1000), policy)
    router.kv_capacity_tokens[1] = 24_000  # replica 0 not scraped yet
    router.route(RoutingKey("m", list(range(100)), None, None, False, 1), [(0, 0.0), (1, 2.0)])
    assert [(c.replica, c.prompt_tokens, c.kv_capacity_tokens) for c in policy.seen] == [
        (0, 100, 0),
        (1, 100, 24_000),
    ]


TEMPLATE = list(range(1000, 1032))  # a 32-token shared preamble: 2 blocks of 16


def _warm_template_on_replica_0(router: Router) -> None:
    """Two different prompts after the template, both on replica 0: the template branches, so
    it becomes the common preamble (router.py rule 2) although replica 1 was never sent it."""
    for tail in (list(range(50)), list(range(100, 150))):
        router.route(RoutingKey("m", TEMPLATE + tail, None, None, False, 1), [(0, 0.0)])


def test_the_index_prices_the_common_preamble_as_held_everywhere() -> None:
    """Without events the index cannot tell "evicted" from "not yet sent", and a common preamble
    is priced as held on every replica: otherwise each new prompt sharing it would follow the
    first replica that was sent it, however idle the others are."""
    policy = Recording()
    router = Router(FastHasher(16), PrefixIndex(1000), policy)
    _warm_template_on_replica_0(router)
    tokens = TEMPLATE + list(range(200, 264))  # 96 tokens: 6 blocks, 5 matchable
    router.route(RoutingKey("m", tokens, None, None, False, 1), [(0, 0.0), (1, 0.0)])
    # Neither holds anything specific; only replica 0 was sent the 2-block preamble.
    assert [(c.replica, c.matched, c.new_tokens) for c in policy.seen] == [
        (0, 0, 96 - 32),
        (1, 0, 96 - 32),
    ]


def test_a_replica_whose_events_report_the_preamble_evicted_is_charged_its_prefill() -> None:
    hasher = VllmHasher(16)
    policy = Recording()
    router = Router(hasher, PrefixIndex(1000), policy)
    views = {0: ReplicaView(), 1: ReplicaView()}
    for view in views.values():
        view.apply(0, {"events": []})  # live, empty
    router.precise = PreciseMatcher(views)
    _warm_template_on_replica_0(router)
    tokens = TEMPLATE + list(range(200, 264))
    keys = hasher.hash_tokens(tokens, Namespace("m"))
    # Replica 0 stored the preamble, then evicted its second block; replica 1 holds all of it.
    views[0].apply(1, {"events": [{"type": "BlockStored", "block_hashes": keys[:2]}]})
    views[0].apply(2, {"events": [{"type": "BlockRemoved", "block_hashes": keys[1:2]}]})
    views[1].apply(1, {"events": [{"type": "BlockStored", "block_hashes": keys[:2]}]})
    router.route(RoutingKey("m", tokens, None, None, False, 1), [(0, 0.0), (1, 0.0)])
    assert [(c.replica, c.matched, c.new_tokens) for c in policy.seen] == [
        (0, 0, 96 - 16),
        (1, 0, 96 - 32),
    ]
