"""The in-process request harness (bench/harness/request_micro.py)."""

from __future__ import annotations

from typing import Any

from bench.harness.request_micro import cold_samples, request_timings


def test_every_stage_of_a_routed_request_runs_once() -> None:
    called: list[str] = []

    def once(name: str, fn: Any) -> str:
        fn()  # the whole request raises unless the data path answered 200
        called.append(name)
        return name

    timings, core = request_timings(once)
    assert timings == called
    assert called[0].startswith("DataPath.respond")
    assert any("hash" in name for name in called) and any("learn" in name for name in called)
    assert core.endswith("router.py")


def test_cold_samples_time_each_routing_stage_hot_and_swept() -> None:
    rows = cold_samples(3)
    names = [name for name, _ in rows]
    assert len(names) == 4 and sum("swept" in n for n in names) == 2
    assert all(len(samples) == 3 and all(s > 0 for s in samples) for _, samples in rows)
