"""bench.analysis.kv_events_report: the pooled events-vs-index table from several
runs' routing.json."""

from __future__ import annotations

from typing import Any

from bench.analysis.kv_events_report import pooled


def result(router: str, n: int, hits: float, tok_s: float, p99: float) -> dict[str, Any]:
    return {"router": router, "replicas": n, "workload": "tight", "status": "ok",
            "oracle_ratio": hits, "throughput_tok_s": tok_s, "p99_s": p99,
            "router_cpu_ms": 2.0, "added_p50_ms": 10.0,
            "kv_events": {"exact_memo_hits": 3.0, "exact_memo_misses": 1.0}}  # fmt: skip


def test_pooled_means_and_differences_per_fleet_size() -> None:
    runs = [
        {"measured_at": "s0", "results": [result("proxy", 2, 0.90, 4000, 5.0),
                                          result("proxy-events", 2, 0.92, 4200, 5.5)]},
        {"measured_at": "s1", "results": [result("proxy", 2, 0.80, 4000, 5.0),
                                          result("proxy-events", 2, 0.80, 3800, 4.5)]},
    ]  # fmt: skip
    text = pooled(runs)
    assert "| 2 | s0 | 90.0% / 4000 / 5.00 / 2.0 / 10 |" in text
    assert "+2.0 / +5.0% / +10.0% | 75% |" in text  # run s0, memo hits 3 of 4
    # Pooled: hits 85 vs 86 (+1.0), throughput 4000 vs 4000, p99 5.0 vs 5.0.
    assert "**+1.0 / +0.0% / +0.0%**" in text
    assert "pooled, 2 runs" in text
