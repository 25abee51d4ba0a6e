"""bench/analysis/tight_continuations.py: where a run's continuations lose their cache."""

from __future__ import annotations

from typing import Any

import pytest

from bench.analysis.tight_continuations import analyse


def _row(
    rollout: int, turn: int, t: float, replica: int, prompt: int, cached: int, oracle: int
) -> dict[str, Any]:
    return {
        "rollout": rollout,
        "group": rollout // 8,
        "turn": turn,
        "t_send": t,
        "t_recv": t + 1.0,
        "prompt_tokens": prompt,
        "completion_tokens": 100,
        "replica": replica,
        "cached_tokens": cached,
        "oracle_hit_tokens": oracle,
    }


def test_losses_are_split_by_where_each_continuation_went_and_its_mates_there() -> None:
    rows = [
        # Group 0: rollouts 0 and 1 on replica 0, rollout 2 copied onto replica 1 (the burst:
        # all sent before any answer).
        _row(0, 0, 0.0, 0, 1000, 0, 0),
        _row(1, 0, 0.1, 0, 1000, 992, 992),
        _row(2, 0, 0.2, 1, 1000, 0, 992),
        # Group 1's only rollout, on replica 1 too: live there, but no mate of group 0's.
        _row(8, 0, 0.3, 1, 1000, 0, 0),
        # Second turns: rollout 0 stays home with 1 mate there, loses 200 of its 1,088;
        # rollout 2 stays home alone, loses all 1,088; rollout 1 moves to replica 1, loses 500.
        _row(0, 1, 1.5, 0, 1200, 888, 1088),
        _row(2, 1, 1.6, 1, 1200, 0, 1088),
        _row(1, 1, 1.7, 1, 1200, 588, 1088),
        _row(8, 1, 1.8, 1, 1200, 1088, 1088),  # home, no mates, nothing lost
        _row(16, 0, 1.9, 0, 1000, 0, 0),  # group 2 starts after the first answer: not the burst
    ]
    a = analyse(rows, kv_tokens=10_000)
    oracle = 992 + 992 + 4 * 1088
    assert a["count"] == {"first": 5, "home": 3, "moved": 1}
    assert a["lost"]["first"] == pytest.approx(992 / oracle)
    assert a["lost"]["home"] == pytest.approx((200 + 1088) / oracle)
    assert a["lost"]["moved"] == pytest.approx(500 / oracle)
    assert a["spread_burst"] == [2, 1]
    assert a["spread_late"] == [1]
    # Rollout 0 had rollout 1 live on replica 0 (its turn 1 not sent yet); rollouts 2 and 8 had
    # none of their group's on replica 1 (each other's do not count).
    assert a["mates_bins"][1]["n"] == 1
    assert a["mates_bins"][1]["lost_in_bin"] == pytest.approx(200 / 1088)
    assert a["mates_bins"][0]["n"] == 2
    assert a["mates_bins"][0]["lost_in_bin"] == pytest.approx(0.5)
