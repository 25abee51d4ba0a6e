"""bench/analysis/restart.py: when the mid-run restart happens, and what its report reads from
a dump."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.analysis.restart import after_restart, restart_after, run_with_restart
from bench.harness.workload import RolloutSpec, TurnSpec


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


class FakeDriver:
    """What run_with_restart touches of bench.harness.workload.Driver: answers one request per
    tick."""

    def __init__(self, requests: int) -> None:
        self.base_url = "http://old"
        self.control = SimpleNamespace(targets=["http://old"])
        self.trace = SimpleNamespace(records=[], t_start=0.0)
        self.requests = requests
        self.urls: list[str] = []

    async def run(self, plan: object) -> None:
        self.trace.t_start = time.monotonic()
        for i in range(self.requests):
            await asyncio.sleep(0.001)
            self.urls.append(self.base_url)
            self.trace.records.append(i)


async def test_the_driver_and_its_control_calls_move_to_the_new_router(tmp_path: Path) -> None:
    driver = FakeDriver(40)
    retired: list[bool] = []

    async def restart() -> str:
        return "http://new"

    record = tmp_path / "logs" / "restart-x.json"
    await run_with_restart(
        driver,
        [],
        10,
        restart,
        lambda: retired.append(True),
        record,
        0.5,  # type: ignore[arg-type]
    )
    assert driver.urls[:10] == ["http://old"] * 10 and driver.urls[-1] == "http://new"
    assert driver.control.targets == ["http://new"] and retired == [True]
    assert json.loads(record.read_text())["after_requests"] == 10


async def test_a_router_that_never_comes_up_fails_the_run_and_stops_its_rollouts(
    tmp_path: Path,
) -> None:
    driver = FakeDriver(10_000)

    async def restart() -> str:
        raise TimeoutError("not routing")

    with pytest.raises(TimeoutError):
        await run_with_restart(
            driver,
            [],
            5,
            restart,
            lambda: None,
            tmp_path / "r.json",
            0.5,  # type: ignore[arg-type]
        )
    answered = len(driver.trace.records)
    await asyncio.sleep(0.02)
    assert len(driver.trace.records) == answered < 10_000  # cancelled, not still running
