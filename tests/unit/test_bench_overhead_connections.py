"""run_overhead's loaded runs at several connection counts: the medians per count, the bar
checked at the first, the report's table, without starting anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.runners import run_overhead


def measured(
    target: str, figures: dict[int, tuple[list[float], list[float]]]
) -> run_overhead.Measurement:
    m = run_overhead.Measurement(target, "repeated", target)
    for c, (rps, cpu) in figures.items():
        for r, u in zip(rps, cpu, strict=True):
            m.add(f"rps@{c}", r)
            m.add(f"cpu_us_per_req@{c}", u)
            if c == 64:
                m.add("rps_64", r)
                m.add("cpu_us_per_req", u)
    m.settle()
    return m


def test_each_connection_count_is_settled_and_the_bar_checked_at_the_first(
    tmp_path: Path,
) -> None:
    ours = measured("proxy", {64: ([900, 1000, 1100], [40, 50, 60]), 8: ([500] * 3, [90] * 3)})
    vr = measured("vllm-router", {64: ([600] * 3, [100] * 3), 8: ([400] * 3, [100] * 3)})
    assert ours.loaded == {
        64: {"rps": 1000, "cpu_us_per_req": 50},
        8: {"rps": 500, "cpu_us_per_req": 90},
    }
    assert ours.rps_64 == 1000
    lines = run_overhead.against_targets([ours, vr], "repeated", [64, 8])
    assert "64 connections" in lines[0] and "CPU <= 0.5x met" in lines[0]
    assert "requests/s >= 1.5x met" in lines[0]  # 1000 / 600 = 1.67x
    assert "8 connections" in lines[1] and "0.90x" in lines[1] and "the bar" not in lines[1]
    path = run_overhead.write_report([ours, vr], tmp_path, "cmd", 5, 3, 3, [64, 8])
    text = path.read_text()
    assert "| proxy | 8 | 500 | 1.25 | 90 | 0.90 |" in text
    assert (
        json.loads((tmp_path / "overhead.json").read_text())["rows"][0]["loaded"]["8"]["rps"] == 500
    )


@pytest.mark.parametrize("bad", ["", "0", "a,8", "64,-1"])
def test_connections_must_be_positive_integers(bad: str) -> None:
    with pytest.raises(SystemExit):
        run_overhead.main(["--connections", bad, "--targets", "proxy"])
