"""Routing policies, table-driven."""

from __future__ import annotations

import pytest

from proxy.core.policy import Candidate, LeastLoaded, PrefixAffinity, RoundRobin, make_policy


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


def test_baselines() -> None:
    rr = RoundRobin()
    assert [rr.choose([Candidate(0, 9, 9), Candidate(1, 0, 0)]).replica for _ in range(4)] == [
        1,
        0,
        1,
        0,
    ]
    ll = LeastLoaded()
    assert ll.choose([Candidate(0, 3, 9), Candidate(1, 1, 0)]).replica == 1


def test_registry_and_errors() -> None:
    assert make_policy("prefix", 8).name == "prefix"
    assert make_policy("round_robin", 8).name == "round_robin"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic", 8)
    with pytest.raises(ValueError):
        PrefixAffinity(8).choose([])
    with pytest.raises(ValueError):
        PrefixAffinity(-1)
