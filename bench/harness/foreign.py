"""A second client for the routing benchmark: requests the router never sees.

The router's index remembers what *it* sent where. A replica also caches what other clients
send it straight (an evaluation job, a second trainer, a retry that bypassed the router), and
those prefixes are invisible to the index but not to the replicas' KV-cache events. This module
makes that happen on purpose, so ``proxy`` (index) and ``proxy-events`` (events) can be compared
where the proxy's memory is wrong and the events are right:

    python -m bench.runners.run_routing --workload agentic --foreign-share 0.25 \\
        --routers proxy,proxy-events

With ``--foreign-share F``, the first turn of every rollout of a share F of the groups (every
round(1/F)-th group from group 0: the same groups for every router) is sent straight to one
replica, picked by group like a client that shards its work by prompt; the rollout's later turns
go through the router as usual. Those continuations repeat the first turn's prompt and
completion, so only a router that knows where the first turn ran can give them their prefix hit.

    python -m bench.harness.foreign --share 0.25 OUT/tmp/logs/requests-*.jsonl

prints, per run, those first continuations' cached tokens as a share of the oracle's hits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.workload import (
    ControlPlane,
    Driver,
    PromptFormat,
    RequestRecord,
    RolloutSpec,
    WorkloadConfig,
)


def add_foreign_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--foreign-share",
        type=float,
        default=0.0,
        help="share of the groups whose first turns a second client sends straight to a "
        "replica, bypassing the router (bench/harness/foreign.py; default 0: none)",
    )


def foreign_groups(groups: int, share: float) -> frozenset[int]:
    """Every round(1/share)-th group, from group 0: ``share`` of them, evenly spread."""
    if not 0.0 <= share <= 1.0:
        raise ValueError("--foreign-share must be within [0, 1]")
    if share == 0.0:
        return frozenset()
    stride = max(1, round(1.0 / share))
    return frozenset(range(0, groups, stride))


class ForeignDriver(Driver):
    """The workload's driver, with the first turns of ``groups`` sent around the router."""

    def __init__(
        self,
        cfg: WorkloadConfig,
        base_url: str,
        control: ControlPlane,
        prompt_format: PromptFormat,
        replica_urls: Sequence[str],
        groups: frozenset[int],
    ) -> None:
        super().__init__(cfg, base_url, control, prompt_format)
        self.groups = groups
        # One plain driver per replica does the sending, so the request, its record and the
        # trace are exactly the router path's (same body, same parsing, same trace).
        self._direct = [Driver(cfg, url, control, prompt_format) for url in replica_urls]

    async def _request(
        self, session: aiohttp.ClientSession, spec: RolloutSpec, turn: int, *rest: Any
    ) -> RequestRecord:
        """Driver._request's arguments (model, path, prompt, max_tokens follow ``turn``)."""
        if turn == 0 and spec.group in self.groups:
            direct = self._direct[spec.group % len(self._direct)]
            return await direct._request(session, spec, turn, *rest)
        return await super()._request(session, spec, turn, *rest)


def make_driver(
    cfg: WorkloadConfig,
    base_url: str,
    control: ControlPlane,
    prompt_format: PromptFormat,
    replica_urls: Sequence[str],
    share: float,
) -> Driver:
    """The run's driver: the plain one, or with a second client for ``share`` of the groups."""
    groups = foreign_groups(cfg.groups, share)
    if not groups:
        return Driver(cfg, base_url, control, prompt_format)
    return ForeignDriver(cfg, base_url, control, prompt_format, replica_urls, groups)


def describe(share: float, groups: int) -> str:
    """One line for a report."""
    n = len(foreign_groups(groups, share))
    if not n:
        return "no second client"
    return (
        f"second client: the first turns of {n}/{groups} groups ({100 * n / groups:.0f}%) sent "
        f"straight to replica (group mod fleet size); every later turn through the router"
    )


def bypassed_continuation_hits(dump: Path, share: float) -> tuple[int, float]:
    """From a run's per-request dump (bench/runners/run_routing.py writes one per run): how many
    first     continuations (turn 1) of the bypassed groups there were, and their cached tokens as a
    share of the oracle's hits on them -- the requests whose prefix only the replicas knew."""
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    rows = [r for r in rows if "rollout" in r]
    groups = foreign_groups(1 + max((r["group"] for r in rows), default=-1), share)
    picked = [r for r in rows if r["turn"] == 1 and r["group"] in groups]
    oracle = sum(r["oracle_hit_tokens"] for r in picked)
    cached = sum(r["cached_tokens"] or 0 for r in picked)
    return len(picked), cached / oracle if oracle else math.nan


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.harness.foreign",
        description="hits of the bypassed groups' first continuations, per run dump",
    )
    p.add_argument("--share", type=float, required=True, help="the run's --foreign-share")
    p.add_argument("dumps", nargs="+", type=Path, help="requests-*.jsonl of a run")
    args = p.parse_args(argv)
    for dump in args.dumps:
        n, rate = bypassed_continuation_hits(dump, args.share)
        print(f"{dump.name}: {n} first continuations of bypassed groups, {rate:.1%} of oracle hits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
