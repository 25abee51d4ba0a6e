"""A router restart in the middle of a routing run: the proxy's memory is lost, the replicas'
KV-cache events are not.

The index (``proxy``) remembers what the proxy sent where; a restarted proxy starts with an
empty one, so every rollout in flight loses its affinity until its next turn is routed again.
The events router (``proxy-events``) subscribes afresh and rebuilds each replica's view from
vLLM's replay socket (every buffered batch from sequence 0, see proxy/kv_events.py), so it
should route the next turns as if nothing happened:

    python -m bench.runners.run_routing --workload tight --routers proxy,proxy-events \\
        --restart-at 0.5

With ``--restart-at F``, once a share F of the plan's requests have been answered, a second
router process (the same command, a new port) is started and waited for until it routes; every
later request and control call goes to it, and the first one is then stopped (SIGTERM: it
finishes what it holds). Nothing fails or is retried; the restart only wipes the router's state.
The new process takes a few real seconds to start and route (2.9-4.9 s on the shared 2-core
machine), so the switch comes later than F: the requests after it are counted from the
switch, whose time each run writes to ``restart-<workload>-<router>-<n>.json`` next to its dump.

    python -m bench.analysis.restart OUT/tmp/logs

prints, per run, the hits of the requests sent after the restart as a share of the oracle's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from bench.harness.workload import Driver, RolloutSpec


def add_restart_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--restart-at",
        type=float,
        default=0.0,
        help="restart the router once this share of the plan's requests were answered "
        "(bench/analysis/restart.py; default 0: never)",
    )


def restart_after(plan: Sequence[RolloutSpec], share: float) -> int:
    """Answered requests after which to restart (0: never)."""
    if not 0.0 <= share < 1.0:
        raise ValueError("--restart-at must be within [0, 1)")
    total = sum(len(spec.turns) for spec in plan)
    return max(1, round(share * total)) if share > 0 else 0


async def run_with_restart(
    driver: Driver,
    plan: Sequence[RolloutSpec],
    after: int,
    restart: Callable[[], Awaitable[str]],
    retire: Callable[[], None],
    record: Path,
    time_scale: float,
) -> None:
    """``driver.run(plan)``; once ``after`` requests were answered, ``restart()`` (start the new
    router, return its URL once it routes), point the driver and its control plane at it, then
    ``retire()`` the old one (in a thread: it waits for the process). Writes when the switch
    happened, in simulated seconds from the run's start (the dumps' unit), to ``record``."""
    run = asyncio.create_task(driver.run(plan))
    try:
        if after and await _answered(driver, after, run):
            url = await restart()
            if driver.control.targets == [driver.base_url]:  # the router broadcasts control
                driver.control.targets = [url]
            driver.base_url = url
            at = (time.monotonic() - driver.trace.t_start) / time_scale
            line = json.dumps({"restarted_at": at, "after_requests": after}) + "\n"
            await asyncio.to_thread(_write, record, line)
            await asyncio.to_thread(retire)
    except BaseException:
        # A new router that never came up fails this run; its rollouts must not go on
        # running into the next one (the runner's event loop outlives a run).
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        raise
    await run


async def _answered(driver: Driver, n: int, run: asyncio.Task[object]) -> bool:
    """Wait until ``n`` requests were answered (True) or the run ended first (False). Polled
    every 20 real ms: a few requests' worth at the benchmark's rate, and no hook in the driver."""
    while not run.done():
        if len(driver.trace.records) >= n:
            return True
        await asyncio.sleep(0.02)
    return False


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def after_restart(dump: Path) -> tuple[int, float, float]:
    """(requests sent after the restart, their cached tokens as a share of the oracle's hits,
    the same for the first turn each rollout sent after it) from a run's per-request dump and
    the ``restart-*.json`` next to it; NaN when the run did not restart."""
    marker = dump.with_name(dump.name.replace("requests-", "restart-", 1)).with_suffix(".json")
    if not marker.exists():
        return 0, math.nan, math.nan
    at = json.loads(marker.read_text())["restarted_at"]
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    later = sorted((r for r in rows if "rollout" in r and r["t_send"] >= at), key=_sent)
    first: dict[int, dict[str, float]] = {}
    for r in later:
        first.setdefault(r["rollout"], r)
    return len(later), _ratio(later), _ratio(list(first.values()))


def _sent(row: dict[str, float]) -> float:
    return row["t_send"]


def _ratio(rows: Sequence[dict[str, float]]) -> float:
    oracle = sum(r["oracle_hit_tokens"] for r in rows)
    return sum(r["cached_tokens"] or 0 for r in rows) / oracle if oracle else math.nan


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.analysis.restart",
        description="hits after a mid-run router restart, per run of a --restart-at run",
    )
    p.add_argument("logs", type=Path, help="OUT/tmp/logs of a run_routing --restart-at run")
    args = p.parse_args(argv)
    print("run | requests after | hits of oracle after | first turn after, hits of oracle")
    for dump in sorted(args.logs.glob("requests-*.jsonl")):
        n, later, first = after_restart(dump)
        name = dump.stem.removeprefix("requests-")
        print(f"{name} | {n} | {100 * later:.1f}% | {100 * first:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
