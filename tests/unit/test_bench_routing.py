"""The routing runner's pure parts: workload selection, per-request overhead, the target table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.harness.routers import ROUTERS, rust_router_argv, select, trees
from bench.harness.simulator import SimConfig
from bench.harness.workload import RequestRecord, RunTrace
from bench.runners.run_routing import (
    RunResult,
    _added_latency_ms,
    _busy_before_drain,
    _parse_args,
    _setup_line,
    _targets,
    _union_seconds,
    configs,
    events_workloads,
    probe_interval,
)


def test_workloads_and_fleet_sizes_are_selectable() -> None:
    workloads, sizes = configs(_parse_args(["--workload", "grpo,agentic,tight"]))
    assert [w.name for w in workloads] == ["grpo", "agentic", "tight"]
    assert sizes == [2, 4, 8, 16]
    workloads, sizes = configs(
        _parse_args(["--workload", "tight", "--replicas", "4", "--groups", "3"])
    )
    assert sizes == [4] and workloads[0].workload.groups == 3 and workloads[0].kv_share == 0.25
    # An explicit cache size replaces the tight share.
    (w,), _ = configs(_parse_args(["--workload", "tight", "--kv-blocks", "4096"]))
    assert w.kv_share is None and w.sim_for(8).kv_blocks == 4096
    (smoke,), sizes = configs(_parse_args(["--smoke"]))
    assert sizes == [2] and smoke.workload.groups == 6 and smoke.sim.time_scale == 0.01
    with pytest.raises(ValueError, match="unknown workload"):
        configs(_parse_args(["--workload", "chat"]))


def test_max_inflight_is_selectable_and_recorded() -> None:
    """--max-inflight sets TRL's max_inflight_tasks for the run (default: the workload's), the
    Setup line says it, and a tight cache stays its share of the (grown) working set."""
    (default,), _ = configs(_parse_args(["--workload", "tight"]))
    (w,), _ = configs(_parse_args(["--workload", "tight", "--max-inflight", "128"]))
    assert default.workload.max_inflight == 64 and w.workload.max_inflight == 128
    assert "128 rollouts in flight" in _setup_line(w)
    assert "64 rollouts in flight" in _setup_line(default)
    assert w.sim_for(4).kv_blocks == pytest.approx(2 * default.sim_for(4).kv_blocks, abs=1)
    (smoke,), _ = configs(_parse_args(["--smoke", "--max-inflight", "4"]))
    assert smoke.workload.max_inflight == 4
    with pytest.raises(ValueError, match="--max-inflight"):
        configs(_parse_args(["--max-inflight", "0"]))


def test_event_routers_run_in_the_workloads_named() -> None:
    args = _parse_args(["--workload", "grpo,tight"])
    workloads, _ = configs(args)
    assert events_workloads(args, workloads) == {"grpo", "tight"}
    args = _parse_args(["--workload", "grpo,tight", "--events-workloads", "tight"])
    assert events_workloads(args, workloads) == {"tight"}
    args = _parse_args(["--workload", "grpo", "--events-workloads", "tight"])
    with pytest.raises(ValueError, match="not among --workload"):
        events_workloads(args, configs(args)[0])


def test_probe_interval_is_simulated_seconds_or_each_routers_own() -> None:
    assert probe_interval(_parse_args([])) == 60.0
    assert probe_interval(_parse_args(["--probe-interval", "own"])) is None
    with pytest.raises(ValueError):
        probe_interval(_parse_args(["--probe-interval", "0"]))
    # One period for everyone: the proxy through its setting, the Rust routers by flag.
    assert ROUTERS["proxy"].environment(6.0) == {"PROXY_HEALTH_INTERVAL_S": "6"}
    assert ROUTERS["proxy-ll"].environment(None) == {"PROXY_POLICY": "least_loaded"}
    argv = rust_router_argv("vllm-router", "vr", ["http://a"], 1, 0.3)
    assert argv[-2:] == ["--health-check-interval-secs", "1"]
    assert "--health-check-interval-secs" not in rust_router_argv("vllm-router", "vr", [], 1)


def test_another_checkouts_proxy_runs_from_its_own_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """proxy@LABEL: BENCH_TREES names the checkout; its venv's python runs `-P -m proxy`, so
    the working directory's proxy/ cannot shadow the other tree's."""
    monkeypatch.setenv("BENCH_TREES", f"base={tmp_path}")
    (spec,) = select(["proxy@base"])
    assert (
        spec.unavailable()
        == f"{tmp_path}/.venv/bin/python not found (run `make setup` in {tmp_path})"
    )
    argv = spec.argv(["http://a"], 9)
    assert argv[:4] == [f"{tmp_path}/.venv/bin/python", "-P", "-m", "proxy"]
    assert spec.environment(6.0) == {"PROXY_HEALTH_INTERVAL_S": "6"}
    assert ROUTERS["proxy"].argv(["http://a"], 9)[1:3] == ["-m", "proxy"]  # this checkout's
    (events,) = select(["proxy-events@base"])
    assert events.kv_events and events.tree == tmp_path
    assert events.environment(None) == {"PROXY_KV_EVENTS": "true"}
    assert events.argv(["http://a"], 9)[:4] == argv[:4]
    with pytest.raises(ValueError, match="BENCH_TREES=LABEL=PATH"):
        select(["proxy@other"])
    with pytest.raises(ValueError, match="not LABEL=PATH"):
        trees("base")


def _record(rid: str, t_send: float, t_recv: float) -> RequestRecord:
    return RequestRecord(0, 0, "m", "/p", t_send, t_recv, [1], [2], 200, response_id=rid)


def test_added_latency_is_client_time_minus_the_replicas() -> None:
    sim = SimConfig(time_scale=0.5)
    trace = RunTrace()
    trace.records = [
        _record("cmpl-sim0-1", 10.0, 12.0),  # replica: 3 simulated s = 1.5 real -> 500 ms added
        _record("cmpl-sim1-1", 10.0, 11.0),  # replica: 1 simulated s = 0.5 real -> 500 ms
        _record("cmpl-sim1-2", 10.0, 12.5),  # replica: 4 simulated s = 2 real -> 500 ms
        _record("not-from-the-simulator", 0.0, 1.0),  # skipped
    ]
    # log rows: arrival, admitted, first_token, finished, prompt, hits, generated, number
    stats = [
        {"replica": 0, "log": [[5.0, 5.0, 5.0, 8.0, 1, 0, 1, 1]]},
        {"replica": 1, "log": [[1.0, 1.0, 1.0, 2.0, 1, 0, 1, 1], [0.0, 0, 0, 4.0, 1, 0, 1, 2]]},
    ]
    assert _added_latency_ms(trace, stats, sim) == pytest.approx([500.0, 500.0, 500.0])


def _row(router: str, tok_s: float, p99: float, workload: str = "agentic") -> RunResult:
    return RunResult(
        router,
        8,
        "ok",
        workload=workload,
        throughput_tok_s=tok_s,
        p99_s=p99,
        imbalance_busy=1.05,
        ceiling_tok_s=10_000.0,
        ceiling_share=tok_s / 10_000.0,
    )


def test_targets_compare_the_default_proxy_with_the_best_of_the_others() -> None:
    results = [
        _row("proxy", 6000, 10.0),
        _row("proxy-prefix", 9000, 1.0),  # not a comparison target
        _row("proxy-ll", 5500, 9.0),
        _row("proxy-rr", 5000, 12.0),
        _row("vllm-router", 5800, 9.8),
    ]
    rows, notes = _targets(results)
    (row,) = rows
    assert row[:5] == ["agentic", "8", "6000", "vllm-router 5800", "1.034"]
    assert row[7].startswith("1.091")
    assert row[6] == "1.111"  # 10.0 / 9.0 > 1.05: missed
    assert row[-1] == "**missed**"
    assert any("p99 10.00 s is 1.111x proxy-ll's" in n for n in notes)
    # 6000 / 5500 = 1.09 < 1.2 on agentic: the note gives the ceiling instead.
    assert any("1.091x least_loaded's" in n and "60.0% of it" in n for n in notes)
    assert not any("throughput 6000" in n for n in notes)


def test_targets_met_and_cells_without_the_proxy_are_skipped() -> None:
    results = [_row("proxy", 6000, 9.0, "grpo"), _row("proxy-ll", 5500, 9.0, "grpo")]
    results.append(_row("proxy-ll", 1, 1, "tight"))
    rows, notes = _targets(results)
    assert len(rows) == 1 and rows[0][-1] == "all met" and notes == []
    assert math.isnan(RunResult("x", 2, "ok").throughput_tok_s)


def _turn(rid: str, turn: int, t_send: float, t_recv: float) -> RequestRecord:
    return RequestRecord(0, turn, "m", "/p", t_send, t_recv, [1], [2], 200, response_id=rid)


def test_busy_imbalance_before_the_drain_ignores_the_last_rollouts_tail() -> None:
    trace = RunTrace(t_start=0.0, t_end=20.0)
    trace.records = [
        # Until the last rollout starts at t=10, both replicas are busy 0-10 (overlaps count once).
        _turn("cmpl-sim0-1", 0, 0.0, 6.0),
        _turn("cmpl-sim0-2", 0, 4.0, 10.0),
        _turn("cmpl-sim1-1", 0, 0.0, 10.0),
        # The last rollout starts on replica 1 and its turns keep it busy alone until t=20.
        _turn("cmpl-sim1-2", 0, 10.0, 15.0),
        _turn("cmpl-sim1-3", 1, 15.0, 20.0),
    ]
    imbalance, drain_share = _busy_before_drain(trace)
    assert imbalance == pytest.approx(1.0) and drain_share == pytest.approx(0.5)
    # A replica idle before the drain pulls the mean down.
    trace.records[0:2] = [_turn("cmpl-sim0-1", 0, 0.0, 2.0), _turn("cmpl-sim0-2", 0, 8.0, 10.0)]
    imbalance, _ = _busy_before_drain(trace)
    assert imbalance == pytest.approx(10.0 / 7.0)
    assert _union_seconds([(0.0, 3.0), (1.0, 2.0), (5.0, 9.0)], 0.0, 8.0) == pytest.approx(6.0)
