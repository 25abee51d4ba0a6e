"""What the router hands the policies: the prompt, and each replica's KV capacity once scraped."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.core.extract import RoutingKey
from proxy.core.hashing import FastHasher
from proxy.core.policy import Candidate, Decision, LeastLoaded
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router


class Recording(LeastLoaded):
    name = "recording"
    uses_prefix = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Candidate] = []

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        self.seen = list(candidates)
        return super().choose(candidates)


def test_candidates_carry_the_prompt_and_the_scraped_capacity() -> None:
    policy = Recording()
    router = Router(FastHasher(16), PrefixIndex(1000), policy)
    router.kv_capacity_tokens[1] = 24_000  # replica 0 not scraped yet
    router.route(RoutingKey("m", list(range(100)), None, None, False, 1), [(0, 0.0), (1, 2.0)])
    assert [(c.replica, c.prompt_tokens, c.kv_capacity_tokens) for c in policy.seen] == [
        (0, 100, 0),
        (1, 100, 24_000),
    ]
