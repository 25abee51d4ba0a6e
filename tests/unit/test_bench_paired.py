"""bench/analysis/paired.py: ratios taken within each round, pooled over runs, and the report
line run_overhead writes from them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.analysis import paired
from bench.runners import run_overhead


def run(rounds: dict[str, list[float]], vllm: list[float]) -> dict[str, object]:
    """run_overhead's JSON for one workload: each target's CPU per request at 64, by round."""
    rows = [
        {"target": t, "body": "repeated", "status": "ok", "samples": {"cpu_us_per_req@64": v}}
        for t, v in rounds.items()
    ]
    rows.append(
        {"target": "vllm-router", "body": "repeated", "samples": {"cpu_us_per_req@64": vllm}}
    )
    return {"rows": rows}


def test_a_slow_round_moves_both_sides_and_cancels_out() -> None:
    # Half of vllm-router's CPU in every round but the last, where only the proxy ran slow. The
    # ratio of the medians (150 / 100) is set by the one disturbed round; paired, it is one
    # round out of three.
    ours = [50.0, 150.0, 150.0]
    vr = [100.0, 300.0, 100.0]
    (p,) = paired.paired([run({"proxy": ours}, vr)], ["cpu_us_per_req@64"])
    assert (p.body, p.target, p.figure) == ("repeated", "proxy", "cpu_us_per_req@64")
    assert p.ratios == (0.5, 0.5, 1.5) and p.median == 0.5


def test_runs_are_pooled_and_unusable_rounds_give_no_ratio() -> None:
    first = run({"proxy": [40.0, math.nan]}, [100.0, 100.0])
    second = run({"proxy": [60.0, 70.0, 80.0]}, [100.0, 0.0])  # vllm-router ran 2 rounds
    (p,) = paired.paired([first, second], ["cpu_us_per_req@64"])
    assert p.ratios == (0.4, 0.6)
    assert (p.low, p.median, p.high) == (0.4, 0.5, 0.6)
    assert paired.describe(p) == "0.50 (0.40-0.60, 2 rounds)"


def test_the_command_reads_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "overhead.json"
    path.write_text(json.dumps(run({"proxy": [50.0, 60.0]}, [100.0, 100.0])))
    assert paired.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "repeated    proxy" in out and "cpu_us_per_req@64" in out and "0.55 (0.50-0.60" in out


def test_the_report_gives_the_paired_ratios_beside_the_medians() -> None:
    ours = run_overhead.Measurement("proxy", "repeated", "proxy")
    vr = run_overhead.Measurement("vllm-router", "repeated", "vllm-router")
    for mine, theirs, rps in ((50, 100, 1000), (150, 300, 1000)):
        ours.add("cpu_us_per_req@64", mine)
        ours.add("rps@64", rps)
        vr.add("cpu_us_per_req@64", theirs)
        vr.add("rps@64", 500)
    ours.settle()
    vr.settle()
    (line,) = run_overhead.against_targets([ours, vr], "repeated", [64])
    assert "paired by round: CPU 0.50x (0.50-0.50), requests/s 2.00x (2.00-2.00)" in line


def test_a_tree_is_paired_against_another_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two trees and vllm-router in the same rounds: --reference divides by the other tree.
    path = tmp_path / "overhead.json"
    path.write_text(
        json.dumps(run({"proxy": [60.0, 120.0], "proxy@base": [50.0, 100.0]}, [100.0, 200.0]))
    )
    assert paired.main(["--reference", "proxy@base", str(path)]) == 0
    out = capsys.readouterr().out
    assert "repeated    proxy            cpu_us_per_req@64    x proxy@base: 1.20 (1.20-1.20" in out
    assert "vllm-router      cpu_us_per_req@64    x proxy@base: 2.00 (2.00-2.00" in out
    with pytest.raises(SystemExit):
        paired.main(["--reference", "proxy@nowhere", str(path)])
