"""bench/restart.py: when the mid-run restart happens, and what its report reads from a dump."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.restart import after_restart, restart_after
from bench.workload import RolloutSpec, TurnSpec


def plan(turns_per_rollout: list[int]) -> list[RolloutSpec]:
    return [
        RolloutSpec(i, 0, i, 0, (1, 2), tuple(TurnSpec(seed=t, max_tokens=8) for t in range(n)))
        for i, n in enumerate(turns_per_rollout)
    ]


def test_restart_point_counts_every_turn_of_the_plan() -> None:
    p = plan([4, 3, 3])  # 10 requests
    assert restart_after(p, 0.0) == 0  # never
    assert restart_after(p, 0.5) == 5
    assert restart_after(p, 0.01) == 1  # at least one answer first
    with pytest.raises(ValueError):
        restart_after(p, 1.0)


def row(rollout: int, turn: int, t_send: float, cached: int, oracle: int) -> str:
    return json.dumps(
        {"rollout": rollout, "turn": turn, "t_send": t_send, "cached_tokens": cached,
         "oracle_hit_tokens": oracle}
    )  # fmt: skip


def test_hits_after_the_restart_and_each_rollouts_first_turn_after_it(tmp_path: Path) -> None:
    dump = tmp_path / "requests-tight-proxy-2.jsonl"
    lines = [
        row(0, 0, 1.0, 0, 0),  # before the restart: not counted
        row(0, 1, 12.0, 100, 400),  # rollout 0's first request after it
        row(1, 1, 11.0, 300, 300),  # rollout 1's
        row(0, 2, 20.0, 500, 500),
        json.dumps({"cache_clear_at": 15.0}),
    ]
    dump.write_text("\n".join(lines) + "\n")
    assert math.isnan(after_restart(dump)[1])  # no marker: the run did not restart
    (tmp_path / "restart-tight-proxy-2.json").write_text(json.dumps({"restarted_at": 10.0}))
    n, later, first = after_restart(dump)
    assert n == 3
    assert later == pytest.approx(900 / 1200)
    assert first == pytest.approx(400 / 700)
