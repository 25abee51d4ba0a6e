"""Routing policies: filter (the caller passes only eligible replicas) -> score -> pick.

Policies see plain numbers, never requests or HTTP objects, and are chosen by name from
``POLICIES``. Ties are broken round robin with a counter the policy owns, so a sequence of
decisions is deterministic and testable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Outcome = Literal["affinity", "spilled", "unmatched"]
OUTCOMES: tuple[Outcome, ...] = ("affinity", "spilled", "unmatched")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One eligible replica as the policy sees it."""

    replica: int
    load: float  # in-flight requests through this proxy (+ the replica's own queue if known)
    matched: int  # blocks of this request's *specific* prefix the replica was already sent


@dataclass(frozen=True, slots=True)
class Decision:
    replica: int
    outcome: Outcome
    matched_blocks: int
    blocks: tuple[int, ...] = ()  # the prompt's block keys, set by the router (for extension)


class Policy(Protocol):
    name: str
    uses_prefix: bool

    def choose(self, candidates: Sequence[Candidate]) -> Decision: ...


class _RoundRobinTies:
    def __init__(self) -> None:
        self._turn = 0

    def _pick(self, tied: Sequence[Candidate]) -> Candidate:
        if len(tied) == 1:
            return tied[0]  # no choice made: the rotation only advances on real ties
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        low = min(c.load for c in candidates)
        return self._pick([c for c in candidates if c.load == low])


class PrefixAffinity(_RoundRobinTies):
    """Longest specific prefix wins, unless that replica is more than ``imbalance`` requests
    busier than the least-loaded one; then (and when nothing matches) least-loaded wins."""

    name = "prefix"
    uses_prefix = True

    def __init__(self, imbalance: float) -> None:
        super().__init__()
        if imbalance < 0:
            raise ValueError("imbalance must be >= 0")
        self.imbalance = imbalance

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        best_match = max(c.matched for c in candidates)
        if best_match > 0:
            matching = [c for c in candidates if c.matched == best_match]
            best = self._least_loaded(matching)
            floor = min(c.load for c in candidates)
            if best.load - floor <= self.imbalance:
                return Decision(best.replica, "affinity", best_match)
            spill = self._least_loaded(candidates)
            return Decision(spill.replica, "spilled", spill.matched)
        pick = self._least_loaded(candidates)
        return Decision(pick.replica, "unmatched", 0)


class RoundRobin(_RoundRobinTies):
    """Baseline for benchmarks: ignores prefixes and load."""

    name = "round_robin"
    uses_prefix = False

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return Decision(self._pick(candidates).replica, "unmatched", 0)


class LeastLoaded(_RoundRobinTies):
    """Baseline for benchmarks: vLLM's own data-parallel balancing (load only)."""

    name = "least_loaded"
    uses_prefix = False

    def choose(self, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates")
        return Decision(self._least_loaded(candidates).replica, "unmatched", 0)


POLICIES: dict[str, Callable[[float], Policy]] = {
    "prefix": PrefixAffinity,
    "round_robin": lambda _imbalance: RoundRobin(),
    "least_loaded": lambda _imbalance: LeastLoaded(),
}


def make_policy(name: str, imbalance: float) -> Policy:
    try:
        return POLICIES[name](imbalance)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; one of {sorted(POLICIES)}") from None
