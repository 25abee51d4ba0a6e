"""The second client of the routing benchmark (bench/harness/foreign.py): which groups bypass
the router."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.harness.foreign import (
    ForeignDriver,
    bypassed_continuation_hits,
    describe,
    foreign_groups,
    make_driver,
)
from bench.harness.workload import ControlPlane, Driver, RunTrace, WorkloadConfig
from bench.runners.run_routing import _parse_args


@pytest.mark.parametrize(
    ("groups", "share", "expected"),
    [
        (12, 0.0, set()),
        (12, 0.25, {0, 4, 8}),
        (12, 0.5, set(range(0, 12, 2))),
        (12, 1.0, set(range(12))),
        (10, 0.3, {0, 3, 6, 9}),  # every round(1/0.3) = 3rd group
        (1, 0.25, {0}),
    ],
)
def test_foreign_groups_are_an_even_share(groups: int, share: float, expected: set[int]) -> None:
    assert foreign_groups(groups, share) == expected


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="foreign-share"):
        foreign_groups(12, share)


def test_the_driver_bypasses_the_router_only_when_asked() -> None:
    cfg = WorkloadConfig(groups=8)
    control = ControlPlane(["http://router"], RunTrace())
    replicas = ["http://a", "http://b"]
    plain = make_driver(cfg, "http://router", control, "ids", replicas, 0.0)
    assert type(plain) is Driver
    second = make_driver(cfg, "http://router", control, "ids", replicas, 0.5)
    assert isinstance(second, ForeignDriver) and second.groups == {0, 2, 4, 6}
    # Both write into the run's one trace, whichever way a request went.
    assert all(d.trace is control.trace for d in (second, *second._direct))
    assert _parse_args(["--foreign-share", "0.25"]).foreign_share == 0.25
    assert _parse_args([]).foreign_share == 0.0
    assert describe(0.25, 12).startswith("second client: the first turns of 3/12 groups (25%)")
    assert describe(0.0, 12) == "no second client"


def test_bypassed_continuation_hits_read_from_a_run_dump(tmp_path: Path) -> None:
    rows = [  # groups 0..3, share 0.5: groups 0 and 2 were bypassed
        {"rollout": 0, "group": 0, "turn": 0, "cached_tokens": 0, "oracle_hit_tokens": 0},
        {"rollout": 0, "group": 0, "turn": 1, "cached_tokens": 300, "oracle_hit_tokens": 400},
        {"rollout": 9, "group": 2, "turn": 1, "cached_tokens": 100, "oracle_hit_tokens": 400},
        {"rollout": 9, "group": 2, "turn": 2, "cached_tokens": 0, "oracle_hit_tokens": 900},
        {"rollout": 5, "group": 1, "turn": 1, "cached_tokens": 0, "oracle_hit_tokens": 800},
        {"rollout": 13, "group": 3, "turn": 1, "cached_tokens": None, "oracle_hit_tokens": 0},
        {"cache_clear_at": 1.5},
    ]
    dump = tmp_path / "requests-tight-proxy-4.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bypassed_continuation_hits(dump, 0.5) == (2, 0.5)
    n, rate = bypassed_continuation_hits(dump, 0.0)
    assert n == 0 and math.isnan(rate)
