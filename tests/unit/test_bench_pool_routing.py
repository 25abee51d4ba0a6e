"""Pooling routing runs over seeds (bench/analysis/pool_routing.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.analysis.pool_routing import main, paired, pool, render, render_paired, verdicts


def _run(tok_s: dict[str, float], p99: float = 5.0) -> dict[str, object]:
    return {
        "results": [
            {
                "workload": "tight",
                "replicas": 4,
                "router": router,
                "status": "ok",
                "throughput_tok_s": value,
                "p99_s": p99,
                "imbalance_busy": 1.0,
            }
            for router, value in tok_s.items()
        ]
    }


def test_cells_are_averaged_over_seeds_and_judged_by_the_means() -> None:
    # sglang-router wins seed 0 by far and loses the other two: the pooled mean decides.
    runs = [
        _run({"proxy": 5000, "sglang-router": 5500, "vllm-router": 5100}),
        _run({"proxy": 5200, "sglang-router": 4800, "vllm-router": 5100}),
        _run({"proxy": 5100, "sglang-router": 4900, "vllm-router": 5100}),
    ]
    rows = pool(runs)
    means = {r["router"]: r["throughput_tok_s"] for r in rows}
    assert means == {"proxy": 5100, "sglang-router": 5066.666666666667, "vllm-router": 5100}
    (verdict,) = verdicts(rows)
    assert verdict["throughput_ratio"] == 1.0  # vllm-router's 5100, the best pooled
    assert math.isclose(verdict["p99_ratio"], 1.0)
    assert "all met" in render(rows, [verdict], "s0, s1, s2")


def test_a_failed_run_is_left_out_of_its_cell() -> None:
    failed = _run({"proxy": 1.0})
    failed["results"][0]["status"] = "failed"  # type: ignore[index]
    rows = pool([_run({"proxy": 5000}), failed])
    assert [(r["router"], r["seeds"], r["throughput_tok_s"]) for r in rows] == [("proxy", 1, 5000)]


def test_paired_ratios_compare_routers_within_each_run() -> None:
    # The proxy ahead of vllm-router on two seeds of three; least_loaded ran on one seed only.
    runs = [
        _run({"proxy": 5000, "vllm-router": 4000, "proxy-ll": 5000}),
        _run({"proxy": 4000, "vllm-router": 5000}),
        _run({"proxy": 5000, "vllm-router": 5000, "proxy-prefix": 1.0}),  # not an "other"
    ]
    by_other = {p["other"]: p for p in paired(runs)}
    assert set(by_other) == {"vllm-router", "proxy-ll"}
    assert by_other["vllm-router"]["ratios"] == [1.25, 0.8, 1.0]
    assert by_other["vllm-router"]["ahead"] == 2
    assert math.isclose(by_other["vllm-router"]["mean"], (1.25 + 0.8 + 1.0) / 3)
    assert math.isnan(by_other["proxy-ll"]["stdev"])
    assert "2 of 3" in render_paired(paired(runs))


def test_against_pairs_the_proxy_with_a_variant_run_in_the_same_folders(tmp_path: Path) -> None:
    """An A/B of a policy change: the candidate runs as `proxy`, main's rule as another router
    in the same run folder (same seed, same plan), and only that pair is reported."""
    runs = [
        _run({"proxy": 5100, "proxy-base": 5000, "vllm-router": 4000}),
        _run({"proxy": 4900, "proxy-base": 5000, "vllm-router": 4000}),
    ]
    (pair,) = paired(runs, others=("proxy-base",))
    assert (pair["other"], pair["ratios"], pair["ahead"]) == ("proxy-base", [1.02, 0.98], 1)
    for seed, run in enumerate(runs):
        (tmp_path / f"s{seed}").mkdir()
        (tmp_path / f"s{seed}" / "routing.json").write_text(json.dumps(run))
    main(
        [
            str(tmp_path / "ab"),
            str(tmp_path / "s0"),
            str(tmp_path / "s1"),
            "--against",
            "proxy-base",
        ]
    )
    out = json.loads((tmp_path / "ab.json").read_text())
    assert [p["other"] for p in out["paired"]] == ["proxy-base"]
    assert "1.020 / 0.980" in (tmp_path / "ab.md").read_text()
