"""The routing benchmark's memory view: the replicas' counters and where requests landed."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.analysis.routing_memory import drain_critical_path, memory_summary, placement_classes
from bench.harness.simulator import SimConfig
from bench.harness.workload import RequestRecord


def _req(rollout: int, turn: int, t_send: float, prompt: int, cached: int) -> RequestRecord:
    return RequestRecord(
        rollout, turn, "m", "/p", t_send, t_send + 1, [0] * prompt, [1], 200, cached_tokens=cached
    )


def test_requests_are_classed_by_where_their_prefix_went() -> None:
    group = 2  # rollouts 0, 1 form group 0; rollout 2 is group 1
    records = [
        _req(0, 0, 0.0, 100, 0),  # group 0's first: replica 0
        _req(1, 0, 0.1, 100, 80),  # with its group on replica 0
        _req(2, 0, 0.2, 100, 0),  # group 1's first: replica 1
        _req(0, 1, 1.0, 200, 100),  # rollout 0 stays on replica 0
        _req(1, 1, 1.1, 200, 0),  # rollout 1 moves to replica 1
        _req(2, 1, 1.2, 200, 0),  # served by no known replica: not counted
    ]
    served_by = [0, 0, 1, 0, 1, None]
    oracle = [0, 96, 0, 192, 192, 192]
    # Out of send order on purpose: the classes follow the send times.
    order = [3, 0, 4, 1, 5, 2]
    classes = placement_classes(
        [records[i] for i in order],
        [served_by[i] for i in order],
        [oracle[i] for i in order],
        group,
    )
    assert {c: v["requests"] for c, v in classes.items()} == {
        "first-of-group": 2,
        "with-group": 1,
        "new-replica": 0,
        "stayed": 1,
        "moved": 1,
    }
    assert classes["with-group"]["hit_rate"] == 0.8
    assert classes["with-group"]["of_oracle"] == 80 / 96
    assert classes["stayed"]["hit_rate"] == 0.5
    assert classes["moved"]["of_oracle"] == 0.0
    assert math.isnan(classes["new-replica"]["hit_rate"])


def test_memory_summary_is_fleet_wide_and_per_second() -> None:
    replica = {
        "kv_blocks": 100,
        "kv_block_s": 500.0,  # 50 blocks held on average over 10 s
        "mem_blocked_s": 2.0,
        "waiting_s": 30.0,
        "busy_s": 8.0,
        "seq_s": 40.0,
        "prefill_s": 2.0,
        "prefilled_tokens": 1000,
        "recomputed_tokens": 250,
        "evictions": 20,
        "requests": 10,
    }
    idle = dict(replica, kv_block_s=0.0, mem_blocked_s=0.0, waiting_s=0.0, evictions=0)
    m = memory_summary([replica, idle], elapsed_sim_s=10.0)
    assert m["kv_usage"] == 0.25
    assert m["mem_blocked_share"] == 0.1
    assert m["queue_mean"] == 1.5
    assert m["batch_mean"] == 5.0
    assert m["prefill_share"] == 0.25
    assert m["evictions_per_request"] == 1.0
    assert m["recompute_share"] == 0.25
    assert memory_summary([], 10.0) == {}


def test_idle_attribution_separates_placement_from_the_tail() -> None:
    from bench.analysis.routing_memory import idle_attribution

    # Two replicas over 10 s. 0-4 s: two requests on replica 0, replica 1 idle: movable.
    # 4-6 s: one request on each: nobody idle. 6-10 s: one request left, on replica 1, and
    # replica 0 idle with nothing to move: tail.
    intervals = [(0, 0.0, 4.0), (0, 0.0, 6.0), (1, 4.0, 10.0)]
    idle = idle_attribution(intervals, 2)
    assert math.isclose(idle["movable"], 4 / 20)
    assert math.isclose(idle["tail"], 4 / 20)
    # The same requests spread from the start: no movable idle, the same tail.
    spread = idle_attribution([(1, 0.0, 4.0), (0, 0.0, 6.0), (1, 4.0, 10.0)], 2)
    assert spread["movable"] == 0.0
    assert math.isclose(spread["tail"], 4 / 20)
    assert math.isnan(idle_attribution([], 2)["tail"])


def _row(rollout: int, turn: int, t_send: float, t_recv: float, out: int) -> dict[str, Any]:
    return {
        "rollout": rollout,
        "turn": turn,
        "t_send": t_send,
        "t_recv": t_recv,
        "prompt_tokens": 1100,
        "cached_tokens": 100,  # 1,000 tokens prefilled: 10 ms at 10 us/token
        "completion_tokens": out,
        "replica": 0,
    }


def test_the_drain_is_measured_against_its_longest_rollout_done_alone() -> None:
    # Rollout 1 starts last (t=2): the drain runs from there to the last answer (t=12).
    # Rollout 0's remaining request (half of it after t=2) and rollout 1's two requests, each
    # of 1,000 prefilled tokens and 200 decoded at 4.05 ms a step: 0.82 s alone apiece.
    rows = [
        _row(0, 0, 0.0, 1.0, 200),
        _row(0, 1, 1.0, 3.0, 200),
        _row(1, 0, 2.0, 6.0, 200),
        _row(1, 1, 6.0, 12.0, 200),
        {"cache_clear_at": 5.0},  # dumps end with these lines: not requests
    ]
    got = drain_critical_path(rows, SimConfig())
    alone = 1000 * 10e-6 + 200 * 4.05e-3
    assert got["drain_s"] == pytest.approx(10.0)
    assert got["drain_share"] == pytest.approx(10.0 / 12.0)
    assert got["alone_s"] == pytest.approx(2 * alone)  # rollout 1, not rollout 0's half
    assert got["drain_over_alone"] == pytest.approx(10.0 / (2 * alone))
