"""Baseline routing policies the benchmarks compare the proxy's against (not part of the proxy).

- ``round_robin``: ignores prefixes and load.
- ``least_loaded``: vLLM's own data-parallel balancing (load only).

Neither reads the prefix index (``uses_prefix`` False), so a proxy running one skips hashing and
learning completions: what the data path costs without routing. ``register()`` adds them to
proxy.core.policy.POLICIES; ``python -m bench.harness.proxy_with_baselines`` does that, then runs
the proxy, so ``PROXY_POLICY=round_robin|least_loaded`` works in that process only.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.core.policy import POLICIES, Candidate, Decision, RoundRobinTies


class RoundRobin(RoundRobinTies):
    name = "round_robin"
    uses_prefix = False

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return Decision(self._pick(candidates).replica, "unmatched", 0)


class LeastLoaded(RoundRobinTies):
    name = "least_loaded"
    uses_prefix = False

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return Decision(self._least_loaded(candidates).replica, "unmatched", 0)


def register() -> None:
    """Make the baselines choosable by name in this process (PROXY_POLICY, make_policy)."""
    POLICIES["round_robin"] = lambda _imbalance: RoundRobin()
    POLICIES["least_loaded"] = lambda _imbalance: LeastLoaded()
