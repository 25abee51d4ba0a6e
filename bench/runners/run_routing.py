"""Routing: the same AsyncGRPO-shaped workload through each router, in front of simulated vLLM
replicas; reports what users feel first (fleet throughput, tail latency, what weight syncs cost),
then prefix-cache hits against an oracle and load imbalance, for each workload and fleet size.

    python -m bench.runners.run_routing            # grpo, 2,4,8,16 replicas -> bench/results/
    python -m bench.runners.run_routing --workload grpo,agentic,tight \\
        --routers proxy,proxy-prefix,proxy-rr,proxy-ll,vllm-router,sglang-router,proxy-events \\
        --events-workloads tight                    # the full matrix, ~30 min quiet
    python -m bench.runners.run_routing --smoke --out /tmp/r   # seconds: 2 replicas, tiny workload

Workloads (``WORKLOADS``): ``grpo`` (short math prompts, long answers: decode-bound), ``agentic``
(multi-turn tool use, contexts of several thousand tokens: prefill matters), ``tight`` (the agentic
shape on replicas whose KV cache holds about a quarter of the working set).

Each (workload, router, replica count) run gets a fresh simulator fleet and a fresh router
process, so no state carries over. See bench/README.md for what every column means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.analysis.kv_events_report import kv_events_section, kv_events_summary
from bench.analysis.report import fmt, pct, percentile, table
from bench.analysis.restart import add_restart_args, restart_after, run_with_restart
from bench.analysis.routing_memory import memory_section, memory_summary, placement_classes
from bench.harness.foreign import add_foreign_args, make_driver
from bench.harness.oracle import oracle_hits, throughput_ceiling
from bench.harness.procs import REPO, ManagedProcess, machine_description, managed
from bench.harness.routers import ROUTERS, RouterSpec, select
from bench.harness.simulator import SimConfig
from bench.harness.workload import (
    WORKLOADS,
    ControlPlane,
    PromptFormat,
    RequestRecord,
    RunTrace,
    Workload,
    WorkloadConfig,
    build_plan,
    completion_body,
    config_dict,
    plan_summary,
    working_set_blocks,
)
from fakes.net import free_port

DEFAULT_OUT = REPO / "bench" / "results"
PROBE_ADAPTER = "bench-control-probe"

# Targets from the issues (ratios within one run).
TARGET_ORACLE_RATIO = 0.98
TARGET_IMBALANCE = 1.10
TARGET_P99_RATIO = 1.05  # proxy p99 <= 1.05 x the best of the others
TARGET_AGENTIC_VS_LL = 1.2  # agentic: proxy throughput >= 1.2 x least_loaded's
# The routers the default proxy must match or beat (the "best of the others").
COMPARED = ("vllm-router", "sglang-router", "proxy-ll", "proxy-rr")
# Every router probes its replicas this often, in simulated seconds: the Rust routers' default
# --health-check-interval-secs (see bench/harness/routers.py for why one period for all).
PROBE_INTERVAL_SIM_S = 60.0


@dataclass
class ControlProbe:
    """What a router does with TRL's control calls, as the replicas behind it see them."""

    load_status: int = 0
    load_replicas: int = 0
    pause_status: int = 0
    pause_replicas: int = 0
    pause_modes: list[str] = field(default_factory=list)
    replicas: int = 0

    @property
    def broadcasts(self) -> bool:
        return (
            self.load_status == 200
            and self.load_replicas == self.replicas
            and self.pause_status == 200
            and self.pause_replicas == self.replicas
            and all(m == "keep" for m in self.pause_modes)
        )

    def describe(self) -> str:
        modes = ",".join(sorted(set(self.pause_modes))) or "-"
        return (
            f"load_lora_adapter -> HTTP {self.load_status}, loaded on "
            f"{self.load_replicas}/{self.replicas}; pause?mode=keep -> HTTP {self.pause_status}, "
            f"paused {self.pause_replicas}/{self.replicas} (mode seen: {modes})"
        )


@dataclass
class RunResult:
    router: str
    replicas: int
    status: str  # ok | skipped | failed
    workload: str = "grpo"
    reason: str = ""
    control: str = ""
    probe: str = ""
    requests: int = 0
    errors: int = 0
    error_sample: str = ""
    hit_rate: float = math.nan
    oracle_rate: float = math.nan
    oracle_ratio: float = math.nan
    imbalance_busy: float = math.nan
    # The same max / mean, over the part of the run before its drain (until the last rollout
    # started), from the client's request intervals per replica; and the drain's share of the
    # makespan. The drain is where few rollouts are left to place: see _busy_before_drain.
    imbalance_before_drain: float = math.nan
    drain_share: float = math.nan
    imbalance_load: float = math.nan
    spread: float = math.nan
    throughput_tok_s: float = math.nan
    requests_per_s: float = math.nan
    p50_s: float = math.nan
    p99_s: float = math.nan
    # Replica-side latency (arrival at the replica to last token), exact in simulated time:
    # free of the router's and client's real-time overhead, which time_scale magnifies.
    server_p50_s: float = math.nan
    server_p99_s: float = math.nan
    makespan_real_s: float = math.nan
    # Weight syncs as TRL sees them (first /pause sent to the last /resume answered), real
    # seconds, and the time each replica spent frozen (mean over replicas, simulated seconds).
    syncs: int = 0
    sync_mean_real_s: float = math.nan
    sync_max_real_s: float = math.nan
    paused_sim_s: float = math.nan
    # Per request: client-observed real latency minus the replica's own (arrival to last token,
    # real = simulated * time_scale): what the router (and client) added, in real milliseconds.
    added_p50_ms: float = math.nan
    added_p99_ms: float = math.nan
    # CPU milliseconds per successful request over the driven run (utime+stime from /proc):
    # the router under test (its whole process tree), the simulated fleet, and the client (the
    # benchmark process). The three share this machine's cores, so the harness's own share says
    # how much room it leaves the router; the router's share is what it would add on a real host.
    router_cpu_ms: float = math.nan
    sim_cpu_ms: float = math.nan
    client_cpu_ms: float = math.nan
    # The throughput a router with perfect affinity and perfect balance could reach (oracle
    # prefill, every replica at the same batch), and this run's share of it.
    ceiling_tok_s: float = math.nan
    ceiling_share: float = math.nan
    # The same ceiling with this run's own prefix hits instead of the oracle's (perfect balance,
    # this router's affinity): the oracle's ceiling over least_loaded's is the most that better
    # affinity alone could buy over least_loaded on these requests.
    ceiling_own_hits_tok_s: float = math.nan
    # Diagnostics: replicas per GRPO group (first turns), and the proxy's own decision counters.
    # Oracle hit tokens missed on first turns and on multi-turn continuations, as shares of the
    # oracle's hits (from each answer's usage.prompt_tokens_details.cached_tokens).
    lost_first_turn: float = math.nan
    lost_continuation: float = math.nan
    groups_whole: float = math.nan
    replicas_per_group: float = math.nan
    decisions: dict[str, float] = field(default_factory=dict)
    kv_events: dict[str, float] = field(default_factory=dict)  # proxy-events: its event views
    per_replica: list[dict[str, Any]] = field(default_factory=list)
    # The replicas' KV memory figures and where requests landed relative to their prefix
    # (bench/analysis/routing_memory.py).
    memory: dict[str, float] = field(default_factory=dict)
    placement: dict[str, dict[str, float]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def _post(session: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, str]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def _wait_ready(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt_format: PromptFormat,
    proc: ManagedProcess,
    timeout_s: float,
) -> None:
    """Ready = a real completion through the router succeeds (not just a /health)."""
    body = completion_body(model, list(range(1, 40)), 1, 1, prompt_format)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited while starting; {proc.tail()}")
        try:
            status, text = await _post(session, url + "/v1/completions", body)
            if status == 200:
                return
            last = f"HTTP {status}: {text[:200]}"
        except aiohttp.ClientError as exc:
            last = repr(exc)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{proc.name} not routing after {timeout_s} s (last: {last}); {proc.tail()}")


async def _probe_control(
    session: aiohttp.ClientSession, router_url: str, replica_urls: Sequence[str]
) -> ControlProbe:
    """Send TRL's control calls through the router once and look at every replica.

    The calls are undone the same way, through the router (then directly on any replica still
    affected): a router that tracks the fleet's desired state, as rollout-proxy does, would
    otherwise re-apply the pause and the probe adapter on its next health round and freeze
    the replicas until the run's first weight sync resumes them."""
    probe = ControlProbe(replicas=len(replica_urls))
    body = {"lora_name": PROBE_ADAPTER, "lora_path": "/tmp/rollout-bench/probe"}
    probe.load_status, _ = await _post(session, router_url + "/v1/load_lora_adapter", body)
    for url in replica_urls:
        models = await _get_json(session, url + "/v1/models")
        if any(m["id"] == PROBE_ADAPTER for m in models["data"]):
            probe.load_replicas += 1
    probe.pause_status, _ = await _post(session, router_url + "/pause?mode=keep")
    for url in replica_urls:
        state = await _get_json(session, url + "/sim/stats?log=0")
        if (await _get_json(session, url + "/is_paused"))["is_paused"]:
            probe.pause_replicas += 1
            probe.pause_modes.append(state["last_pause_mode"] or "?")
    await _post(session, router_url + "/resume")
    await _post(session, router_url + "/v1/unload_lora_adapter", {"lora_name": PROBE_ADAPTER})
    for url in replica_urls:
        if (await _get_json(session, url + "/is_paused"))["is_paused"]:
            await _post(session, url + "/resume")
        models = await _get_json(session, url + "/v1/models")
        if any(m["id"] == PROBE_ADAPTER for m in models["data"]):
            await _post(session, url + "/v1/unload_lora_adapter", {"lora_name": PROBE_ADAPTER})
    return probe


_SIM_ID = re.compile(r"^cmpl-sim(\d+)-")


def _replica_of(record: RequestRecord) -> int | None:
    """The replica that served ``record``, from the id the simulator gives each answer."""
    m = _SIM_ID.match(record.response_id)
    return int(m.group(1)) if m else None


def _group_placement(trace: RunTrace, group_size: int) -> tuple[float, float]:
    """(share of groups whose first turns all hit one replica, mean replicas per group), from the
    replica index the simulator writes into each answer's id."""
    where: dict[int, set[int]] = {}
    for r in trace.ok_records:
        m = _SIM_ID.match(r.response_id)
        if r.turn == 0 and m is not None:
            where.setdefault(r.rollout // group_size, set()).add(int(m.group(1)))
    if not where:
        return math.nan, math.nan
    sizes = [len(v) for v in where.values()]
    return sum(1 for n in sizes if n == 1) / len(sizes), statistics.fmean(sizes)


async def _proxy_decisions(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """rollout_proxy_routing_decisions_total by outcome (empty for other routers)."""
    try:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(
        r'^rollout_proxy_routing_decisions_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M
    ):
        out[m.group(1)] = float(m.group(2))
    return out


def _dump_requests(
    path: Path, trace: RunTrace, per_request: Sequence[int], sim: SimConfig, group_size: int
) -> None:
    """One JSON line per successful request, for digging into where hits were lost."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec, oracle in zip(trace.ok_records, per_request, strict=True):
            m = _SIM_ID.match(rec.response_id)
            row = {
                "rollout": rec.rollout,
                "group": rec.rollout // group_size,
                "turn": rec.turn,
                "model": rec.model,
                "t_send": (rec.t_send - trace.t_start) / sim.time_scale,
                "t_recv": (rec.t_recv - trace.t_start) / sim.time_scale,
                "prompt_tokens": len(rec.prompt),
                "completion_tokens": len(rec.completion),
                "replica": int(m.group(1)) if m else None,
                "x_proxy_replica": rec.replica_header,
                "cached_tokens": rec.cached_tokens,
                "oracle_hit_tokens": oracle,
            }
            f.write(json.dumps(row) + "\n")
        for t in trace.cache_clears:
            f.write(json.dumps({"cache_clear_at": (t - trace.t_start) / sim.time_scale}) + "\n")


def _added_latency_ms(trace: RunTrace, stats: list[dict[str, Any]], sim: SimConfig) -> list[float]:
    """Per successful request: client-observed real latency minus the replica's own real time
    on it (matched through the replica index and request number in the answer's id)."""
    served: dict[tuple[int, int], float] = {}
    for s in stats:
        for row in s.get("log", []):
            served[(s["replica"], row[7])] = (row[3] - row[0]) * sim.time_scale
    added: list[float] = []
    for r in trace.ok_records:
        m = _SIM_ID.match(r.response_id)
        if m is None:
            continue
        number = int(r.response_id[m.end() :])
        replica_s = served.get((int(m.group(1)), number))
        if replica_s is not None:
            added.append((r.t_recv - r.t_send - replica_s) * 1e3)
    return added


def _union_seconds(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total = 0.0
    covered_to = lo
    for a, b in clipped:
        if b > covered_to:
            total += b - max(a, covered_to)
            covered_to = b
    return total


def _busy_before_drain(trace: RunTrace) -> tuple[float, float]:
    """(busy imbalance before the drain, the drain's share of the makespan).

    Once the last rollout has started, TRL has nothing left to send but the remaining turns of
    the rollouts in flight: a replica holding one of the last long rollouts stays busy while the
    others go idle, whichever router placed it (spreading a rollout's sequential turns over idle
    replicas would not end it sooner). Busy time per replica here is the union of its requests'
    client-side intervals (send to answer), so it includes the hop; replicas never used count
    as idle."""
    by_replica: dict[int, list[tuple[float, float]]] = {}
    starts: list[float] = []
    for r in trace.ok_records:
        m = _SIM_ID.match(r.response_id)
        if m is not None:
            by_replica.setdefault(int(m.group(1)), []).append((r.t_send, r.t_recv))
        if r.turn == 0:
            starts.append(r.t_send)
    if not by_replica or not starts:
        return math.nan, math.nan
    drain_from = max(starts)
    n = max(by_replica) + 1
    busy = [_union_seconds(by_replica.get(i, []), trace.t_start, drain_from) for i in range(n)]
    mean = statistics.fmean(busy)
    makespan = trace.t_end - trace.t_start
    share = (trace.t_end - drain_from) / makespan if makespan > 0 else math.nan
    return (max(busy) / mean if mean > 0 else math.nan), share


def _set_ceiling(
    result: RunResult,
    prompts: Sequence[int],
    completions: Sequence[int],
    oracle_hits: Sequence[int],
    own_hits: Sequence[int],
    wcfg: WorkloadConfig,
    sim: SimConfig,
) -> None:
    def ceiling(hits: Sequence[int]) -> float:
        return throughput_ceiling(
            prompts,
            completions,
            hits,
            replicas=result.replicas,
            concurrency=wcfg.max_inflight,
            sim=sim,
        )

    result.ceiling_tok_s = ceiling(oracle_hits)
    if result.ceiling_tok_s > 0:
        result.ceiling_share = result.throughput_tok_s / result.ceiling_tok_s
    result.ceiling_own_hits_tok_s = ceiling(own_hits)


def _ceiling_from_dump(result: RunResult, dump: Path, w: Workload) -> None:
    """Recompute a finished run's ceiling from its per-request dump (same inputs as the run)."""
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    rows = [r for r in rows if "prompt_tokens" in r]
    _set_ceiling(
        result,
        [r["prompt_tokens"] for r in rows],
        [r["completion_tokens"] for r in rows],
        [r["oracle_hit_tokens"] for r in rows],
        [r["cached_tokens"] or 0 for r in rows],
        w.workload,
        w.sim_for(result.replicas),
    )


def _metrics(
    result: RunResult,
    trace: RunTrace,
    stats: list[dict[str, Any]],
    sim: SimConfig,
    wcfg: WorkloadConfig,
    dump: Path | None = None,
) -> None:
    """Fill ``result`` from the client's trace and the replicas' counters."""
    group_size = wcfg.group_size
    ok = trace.ok_records
    result.requests = len(trace.records)
    result.errors = len(trace.errors)
    if trace.errors:
        result.error_sample = trace.errors[0].error or ""
    queries = sum(s["queries_tokens"] for s in stats)
    hits = sum(s["hit_tokens"] for s in stats)
    result.hit_rate = hits / queries if queries else math.nan
    oracle = oracle_hits(
        ok,
        trace.cache_clears,
        capacity_blocks=sim.kv_blocks * len(stats),
        block_size=sim.block_size,
    )
    result.oracle_rate = oracle.hit_rate
    if dump is not None:
        _dump_requests(dump, trace, oracle.per_request, sim, group_size)
    if oracle.hit_tokens and all(r.cached_tokens is not None for r in ok):
        first = sum(
            o - (r.cached_tokens or 0)
            for r, o in zip(ok, oracle.per_request, strict=True)
            if r.turn == 0
        )
        cont = sum(
            o - (r.cached_tokens or 0)
            for r, o in zip(ok, oracle.per_request, strict=True)
            if r.turn > 0
        )
        result.lost_first_turn = first / oracle.hit_tokens
        result.lost_continuation = cont / oracle.hit_tokens
    result.oracle_ratio = result.hit_rate / oracle.hit_rate if oracle.hit_rate else math.nan
    busy = [s["busy_s"] for s in stats]
    load = [s["seq_s"] for s in stats]
    reqs = [s["requests"] for s in stats]
    if statistics.fmean(busy) > 0:
        result.imbalance_busy = max(busy) / statistics.fmean(busy)
    if statistics.fmean(load) > 0:
        result.imbalance_load = max(load) / statistics.fmean(load)
    if statistics.fmean(reqs) > 0:
        result.spread = max(reqs) / statistics.fmean(reqs)
    makespan_sim = (trace.t_end - trace.t_start) / sim.time_scale
    result.makespan_real_s = trace.t_end - trace.t_start
    generated = sum(len(r.completion) for r in ok)
    result.throughput_tok_s = generated / makespan_sim if makespan_sim > 0 else math.nan
    result.requests_per_s = len(ok) / makespan_sim if makespan_sim > 0 else math.nan
    lat = [(r.t_recv - r.t_send) / sim.time_scale for r in ok]
    result.p50_s = percentile(lat, 50)
    result.p99_s = percentile(lat, 99)
    # log rows: arrival, admitted, first_token, finished, prompt_len, hit_tokens, gen_len
    server = [row[3] - row[0] for s in stats for row in s.get("log", [])]
    result.server_p50_s = percentile(server, 50)
    result.server_p99_s = percentile(server, 99)
    result.groups_whole, result.replicas_per_group = _group_placement(trace, group_size)
    result.imbalance_before_drain, result.drain_share = _busy_before_drain(trace)
    durations = [end - start for start, end in trace.syncs]
    result.syncs = len(durations)
    if durations:
        result.sync_mean_real_s = statistics.fmean(durations)
        result.sync_max_real_s = max(durations)
    result.paused_sim_s = statistics.fmean(s.get("paused_s", 0.0) for s in stats)
    added = _added_latency_ms(trace, stats, sim)
    result.added_p50_ms = percentile(added, 50)
    result.added_p99_ms = percentile(added, 99)
    _set_ceiling(
        result,
        [len(r.prompt) for r in ok],
        [len(r.completion) for r in ok],
        oracle.per_request,
        [r.cached_tokens or 0 for r in ok],
        wcfg,
        sim,
    )
    per_replica_keys = (
        "replica",
        "requests",
        "busy_s",
        "seq_s",
        "queries_tokens",
        "hit_tokens",
        "prefilled_tokens",
        "evictions",
        "recomputed_tokens",
        "kv_block_s",
        "mem_blocked_s",
        "waiting_s",
        "max_waiting",
    )
    result.per_replica = [{k: s[k] for k in per_replica_keys if k in s} for s in stats]
    result.memory = memory_summary(stats, makespan_sim)
    served_by = [_replica_of(r) for r in ok]
    result.placement = placement_classes(ok, served_by, oracle.per_request, group_size)


async def run_one(
    spec: RouterSpec,
    n: int,
    workload: Workload,
    log_dir: Path,
    startup_timeout_s: float,
    probe_interval_sim_s: float | None = PROBE_INTERVAL_SIM_S,
    foreign_share: float = 0.0,
    restart_at: float = 0.0,
) -> RunResult:
    """One router on ``n`` replicas. ``probe_interval_sim_s`` None: each router's own default."""
    wcfg, sim = workload.workload, workload.sim_for(n)
    result = RunResult(spec.name, n, "ok", workload=workload.name)
    reason = spec.unavailable()
    if reason is not None:
        result.status, result.reason = "skipped", reason
        return result
    plan = build_plan(wcfg)
    tag = f"{workload.name}-{spec.name}-{n}"
    probe_real = None if probe_interval_sim_s is None else probe_interval_sim_s * sim.time_scale
    sim_argv = [
        sys.executable,
        "-m",
        "bench.harness.simulator",
        "--replicas",
        str(n),
        "--config",
        json.dumps(dataclasses.asdict(sim)),
    ]
    timeout = aiohttp.ClientTimeout(total=30)
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(
            managed(f"simulator-{tag}", sim_argv, log_dir / f"sim-{tag}.log", capture_stdout=True)
        )
        fleet_info = fleet.read_json_line(startup_timeout_s)
        ports = fleet_info["ports"]
        assert isinstance(ports, list)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        env = spec.environment(probe_real)
        if spec.kv_events:
            endpoints = fleet_info.get("kv_events", [])
            assert isinstance(endpoints, list)
            env["PROXY_KV_EVENTS_ENDPOINTS"] = ",".join(map(str, endpoints))

        def start_router(log_name: str) -> tuple[ManagedProcess, str]:
            port = free_port()
            argv = spec.argv(urls, port, probe_real)
            proc = stack.enter_context(managed(spec.name, argv, log_dir / log_name, env))
            return proc, f"http://127.0.0.1:{port}"

        router, router_url = start_router(f"router-{tag}.log")
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await _wait_ready(
                session, router_url, sim.model, spec.prompt_format, router, startup_timeout_s
            )
            probe = await _probe_control(session, router_url, urls)
            result.probe = probe.describe()
            for url in urls:
                await _post(session, url + "/sim/reset")
            targets = [router_url] if probe.broadcasts else urls
            result.control = "through router" if probe.broadcasts else "direct to replicas"
            trace = RunTrace()
            control = ControlPlane(targets, trace)
            driver = make_driver(wcfg, router_url, control, spec.prompt_format, urls, foreign_share)
            cpu_before = (router.cpu_seconds(), fleet.cpu_seconds(), time.process_time())
            old_router = router

            async def restart() -> str:  # --restart-at (bench/analysis/restart.py)
                nonlocal router, router_url, cpu_before
                router, router_url = start_router(f"router-{tag}-restarted.log")
                await _wait_ready(
                    session, router_url, sim.model, spec.prompt_format, router, startup_timeout_s
                )
                # Router CPU: the old process's until now plus the new one's from now.
                spent = old_router.cpu_seconds() - cpu_before[0]
                cpu_before = (router.cpu_seconds() - spent, *cpu_before[1:])
                return router_url

            after = restart_after(plan, restart_at)
            record = log_dir / f"restart-{tag}.json"
            await run_with_restart(
                driver, plan, after, restart, old_router.stop, record, sim.time_scale
            )
            cpu_used = (router.cpu_seconds(), fleet.cpu_seconds(), time.process_time())
            stats = [await _get_json(session, url + "/sim/stats") for url in urls]
            if spec.tool is None:
                result.decisions = await _proxy_decisions(session, router_url)
            if spec.kv_events:
                result.kv_events = await kv_events_summary(session, router_url)
        if not router.alive():
            result.status, result.reason = (
                "failed",
                f"router exited during the run; {router.tail()}",
            )
    dump = log_dir / f"requests-{tag}.jsonl"
    _metrics(result, trace, stats, sim, wcfg, dump)
    served = len(trace.ok_records)
    if served:
        result.router_cpu_ms, result.sim_cpu_ms, result.client_cpu_ms = (
            (after - before) * 1e3 / served
            for before, after in zip(cpu_before, cpu_used, strict=True)
        )
    if result.errors:
        result.status = "failed" if result.errors == result.requests else "ok"
        result.reason = (
            f"{result.errors} of {result.requests} requests failed: {result.error_sample}"
        )
    return result


# --------------------------------------------------------------------------------------------
# Report.


def _cell(results: Sequence[RunResult], workload: str, n: int) -> dict[str, RunResult]:
    return {
        r.router: r
        for r in results
        if r.workload == workload and r.replicas == n and r.status == "ok"
    }


def _verdict(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def _targets(results: Sequence[RunResult]) -> tuple[list[list[str]], list[str]]:
    """Per (workload, fleet size): the default proxy against the best of the others, and
    closing notes for every missed target."""
    rows: list[list[str]] = []
    notes: list[str] = []
    cells = sorted({(r.workload, r.replicas) for r in results}, key=lambda c: (c[0], c[1]))
    for workload, n in cells:
        cell = _cell(results, workload, n)
        ours = cell.get("proxy")
        others = [cell[name] for name in COMPARED if name in cell]
        if ours is None or not others:
            continue
        best_tput = max(others, key=lambda r: r.throughput_tok_s)
        best_p99 = min(others, key=lambda r: r.p99_s)
        tput_ratio = ours.throughput_tok_s / best_tput.throughput_tok_s
        p99_ratio = ours.p99_s / best_p99.p99_s
        ll = cell.get("proxy-ll")
        ll_ratio = ours.throughput_tok_s / ll.throughput_tok_s if ll else math.nan
        checks = [tput_ratio >= 1.0, p99_ratio <= TARGET_P99_RATIO]
        checks.append(ours.imbalance_busy <= TARGET_IMBALANCE)
        agentic = workload == "agentic"
        if agentic:
            checks.append(ll_ratio >= TARGET_AGENTIC_VS_LL)
        rows.append(
            [
                workload,
                str(n),
                fmt(ours.throughput_tok_s, 0),
                f"{best_tput.router} {fmt(best_tput.throughput_tok_s, 0)}",
                fmt(tput_ratio, 3),
                f"{fmt(ours.p99_s, 1)} / {best_p99.router} {fmt(best_p99.p99_s, 1)}",
                fmt(p99_ratio, 3),
                fmt(ll_ratio, 3) + (f" (target {TARGET_AGENTIC_VS_LL})" if agentic else ""),
                fmt(ours.imbalance_busy),
                pct(ours.ceiling_share),
                "all met" if all(checks) else "**missed**",
            ]
        )
        where = f"{workload} x{n}"
        if tput_ratio < 1.0:
            notes.append(
                f"{where}: throughput {fmt(ours.throughput_tok_s, 0)} tok/s is "
                f"{pct(1 - tput_ratio)} below {best_tput.router}'s "
                f"{fmt(best_tput.throughput_tok_s, 0)} (ceiling {fmt(ours.ceiling_tok_s, 0)}; "
                f"proxy {pct(ours.ceiling_share)} of it, {best_tput.router} "
                f"{pct(best_tput.ceiling_share)})."
            )
        if p99_ratio > TARGET_P99_RATIO:
            notes.append(
                f"{where}: p99 {fmt(ours.p99_s, 2)} s is {fmt(p99_ratio, 3)}x {best_p99.router}'s "
                f"{fmt(best_p99.p99_s, 2)} s (replica-side p99 {fmt(ours.server_p99_s, 2)} s vs "
                f"{fmt(best_p99.server_p99_s, 2)} s; added real latency p99 "
                f"{fmt(ours.added_p99_ms, 1)} ms vs {fmt(best_p99.added_p99_ms, 1)} ms)."
            )
        if ours.imbalance_busy > TARGET_IMBALANCE:
            notes.append(
                f"{where}: busy imbalance {fmt(ours.imbalance_busy)} > 1.10; before the drain "
                f"(the last {pct(ours.drain_share)} of the run, after the last rollout started) "
                f"{fmt(ours.imbalance_before_drain)}"
                + (
                    f", least_loaded {fmt(ll.imbalance_busy)} ({fmt(ll.imbalance_before_drain)})."
                    if ll
                    else "."
                )
            )
        if agentic and not ll_ratio >= TARGET_AGENTIC_VS_LL:
            notes.append(
                f"{where}: {fmt(ll_ratio, 3)}x least_loaded's throughput against a "
                f"{TARGET_AGENTIC_VS_LL}x target; the ceiling (perfect affinity and balance) is "
                + (
                    f"{fmt(ours.ceiling_tok_s / ll.throughput_tok_s, 3)}x least_loaded's, and the "
                    f"proxy reaches {pct(ours.ceiling_share)} of it. Better affinity itself is "
                    f"worth at most {fmt(ours.ceiling_tok_s / ll.ceiling_own_hits_tok_s, 3)}x "
                    "least_loaded here (that ceiling over the same with least_loaded's own hits): "
                    "the rest of the ceiling's lead is syncs, ramp-up, drain and real delays, "
                    "which no placement removes."
                    if ll
                    else "unknown (least_loaded did not run)."
                )
            )
    return rows, notes


def _contention_lines(results: Sequence[RunResult]) -> list[str]:
    """How much of the spread between routers in a cell the real added latency explains: per
    workload, the correlation over runs of (added p50 - cell mean) with (throughput / cell
    mean)."""
    lines: list[str] = []
    for workload in dict.fromkeys(r.workload for r in results):
        xs: list[float] = []
        ys: list[float] = []
        for n in sorted({r.replicas for r in results if r.workload == workload}):
            cell = list(_cell(results, workload, n).values())
            if len(cell) < 2:
                continue
            mean_added = statistics.fmean(r.added_p50_ms for r in cell)
            mean_tput = statistics.fmean(r.throughput_tok_s for r in cell)
            xs += [r.added_p50_ms - mean_added for r in cell]
            ys += [r.throughput_tok_s / mean_tput for r in cell]
        if len(xs) >= 3 and len(set(xs)) > 1 and len(set(ys)) > 1:
            r = statistics.correlation(xs, ys)
            lines.append(
                f"- `{workload}`: r = {r:.2f} over {len(xs)} runs between a run's added real "
                "latency per request (p50, minus its cell's mean) and its throughput (over its "
                "cell's mean).\n"
            )
    if not lines:
        return []
    return [
        "\nHow much of the spread between routers within a cell is real time (router hop, CPU "
        "contention on the shared machine) rather than routing, magnified by 1/time_scale:\n\n",
        *lines,
    ]


def _sim_seconds(real_s: float, sim: SimConfig) -> str:
    return fmt(real_s / sim.time_scale, 2)


def _result_rows(results: Sequence[RunResult], sim: SimConfig) -> list[list[str]]:
    rows = []
    for r in results:
        if r.status == "skipped":
            rows.append([r.router, "skipped: " + r.reason] + ["-"] * (len(RESULT_HEADERS) - 2))
            continue
        rows.append(
            [
                r.router,
                fmt(r.throughput_tok_s, 0),
                pct(r.ceiling_share),
                f"{fmt(r.p50_s, 1)} / {fmt(r.p99_s, 1)}",
                f"{fmt(r.server_p50_s, 1)} / {fmt(r.server_p99_s, 1)}",
                f"{fmt(r.added_p50_ms, 1)} / {fmt(r.added_p99_ms, 1)} "
                f"({_sim_seconds(r.added_p50_ms / 1e3, sim)} / "
                f"{_sim_seconds(r.added_p99_ms / 1e3, sim)})",
                f"{r.syncs}: {fmt(r.sync_mean_real_s * 1e3, 0)} / "
                f"{fmt(r.sync_max_real_s * 1e3, 0)} ({_sim_seconds(r.sync_mean_real_s, sim)} / "
                f"{_sim_seconds(r.sync_max_real_s, sim)})",
                fmt(r.paused_sim_s, 2),
                f"{fmt(r.router_cpu_ms, 2)} / {fmt(r.sim_cpu_ms, 2)} / {fmt(r.client_cpu_ms, 2)}",
                r.control,
                f"{fmt(r.imbalance_busy)} ({fmt(r.imbalance_before_drain)})",
                f"{pct(r.hit_rate)} ({pct(r.oracle_ratio)})",
                f"{r.errors}/{r.requests}",
            ]
        )
    return rows


RESULT_HEADERS = [
    "router",
    "throughput (tok/s)",
    "of ceiling",
    "p50 / p99 (s)",
    "replica p50 / p99 (s)",
    "added per request p50 / p99: real ms (sim s)",
    "syncs: mean / max real ms (sim s)",
    "paused per replica (sim s)",
    "CPU ms per request: router / simulator / client",
    "control calls",
    "busy imbalance (before the drain)",
    "hit rate (of oracle)",
    "errors",
]


def write_report(
    results: Sequence[RunResult],
    workloads: Sequence[Workload],
    out: Path,
    command: str,
    wall_s: float,
    probe_interval_sim_s: float | None,
    machine: dict[str, Any] | None = None,
    measured_at: str | None = None,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = machine or machine_description()
    measured_at = measured_at or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    md: list[str] = ["# Routing: rollout-proxy vs the alternatives\n\n"]
    probes = (
        "each router's own default probe period"
        if probe_interval_sim_s is None
        else f"every router probing its replicas every {probe_interval_sim_s:g} simulated s"
    )
    md.append(
        f"Measured {measured_at} with `{command}` "
        f"({wall_s:.0f} s wall), one run per cell, {probes}. Machine: {machine['nproc']} cores "
        f"({machine['cpu']}), {machine['memory']}, Python {machine['python']}, shared with other "
        "jobs. Replicas are simulated (bench/harness/simulator.py); figures are simulated seconds "
        "unless marked real. `proxy` is rollout-proxy with its default policy "
        "(`cost`); `proxy-prefix`, `proxy-rr`, `proxy-ll` the same process with "
        "`PROXY_POLICY=prefix|round_robin|least_loaded`.\n"
    )
    target_rows, notes = _targets(results)
    if target_rows:
        md.append("\n## Against the targets\n\n")
        md.append(
            "Throughput and p99 of `proxy` against the best of vllm-router, sglang-router, "
            "least_loaded (`proxy-ll`) and round_robin (`proxy-rr`) in the same cell; targets: "
            f"throughput ratio >= 1, p99 ratio <= {TARGET_P99_RATIO}, busy imbalance <= "
            f"{TARGET_IMBALANCE}, agentic throughput >= {TARGET_AGENTIC_VS_LL}x least_loaded's. "
            "**of ceiling**: share of the throughput of a router with perfect affinity and "
            "perfect balance (Definitions).\n\n"
        )
        md.append(
            table(
                [
                    "workload",
                    "replicas",
                    "proxy tok/s",
                    "best other tok/s",
                    "ratio",
                    "proxy p99 / best other p99 (s)",
                    "p99 ratio",
                    "/ least_loaded tok/s",
                    "busy imbalance",
                    "of ceiling",
                    "verdict",
                ],
                target_rows,
            )
        )
        if notes:
            md.append("\nMissed targets, with the figures:\n\n")
            md.extend(f"- {line}\n" for line in notes)
    md.extend(_contention_lines(results))
    md.append("\n![routing](routing.png)\n")
    for w in workloads:
        ran = [r for r in results if r.workload == w.name]
        if not ran:
            continue
        md.append(f"\n## Workload `{w.name}`: {w.description}\n")
        for n in sorted({r.replicas for r in ran}):
            sim = w.sim_for(n)
            kv = ""
            if w.kv_share is not None:
                kv = (
                    f" KV cache {sim.kv_blocks} blocks per replica = "
                    f"{pct(w.kv_fraction(n), 0)} of the working set across the fleet."
                )
            md.append(f"\n### {n} replicas\n\n{kv}\n\n" if kv else f"\n### {n} replicas\n\n")
            md.append(table(RESULT_HEADERS, _result_rows([r for r in ran if r.replicas == n], sim)))
    md.append("\n## Control calls through each router\n\n")
    seen: dict[str, str] = {}
    for r in results:
        if r.status != "skipped" and r.router not in seen:
            seen[r.router] = r.probe
    md.append(
        table(
            ["router", "what reached the replicas (probe, first replica count)"], list(seen.items())
        )
    )
    md.append(
        "\nWhere a router does not broadcast TRL's `/v1/load_lora_adapter` and "
        "`/pause?mode=keep` to every replica, the driver sends the sync sequence to every replica "
        'directly for that router\'s runs ("direct to replicas" above), so all routers serve the '
        "same adapters. The sync columns show what that difference costs: a sync through "
        "rollout-proxy crosses one more hop and waits for every replica's answer before the "
        "next call. A real TRL run behind such a router would fail (adapter missing on the other "
        "replicas -> 404 on rollouts).\n"
    )
    ours = [r for r in results if r.decisions]
    if ours:
        md.append("\n## rollout-proxy's own routing decisions\n\n")
        rows = []
        for r in ours:
            total = sum(r.decisions.values()) or 1.0
            rows.append(
                [f"{r.workload} {r.router} x{r.replicas}"]
                + [
                    pct(r.decisions.get(k, 0.0) / total)
                    for k in ("affinity", "spilled", "unmatched")
                ]
                + [fmt(r.replicas_per_group, 2)]
            )
        md.append(table(["run", "affinity", "spilled", "unmatched", "replicas per group"], rows))
    md.append(memory_section(results))
    md.append(kv_events_section(results))
    failures = [r for r in results if r.status == "failed" or r.errors]
    if failures:
        md.append("\n## Failures\n\n")
        for r in failures:
            md.append(f"- {r.workload} {r.router} x{r.replicas}: {r.reason}\n")
    md.append(DEFINITIONS)
    md.append("\n## Setup\n\n")
    for w in workloads:
        md.append(_setup_line(w))
    (out / "routing.md").write_text("".join(md))
    raw = {
        "workloads": {
            w.name: {
                "workload": config_dict(w.workload),
                "simulator": dataclasses.asdict(w.sim),
                "kv_share": w.kv_share,
            }
            for w in workloads
        },
        "probe_interval_sim_s": probe_interval_sim_s,
        "machine": machine,
        "command": command,
        "measured_at": measured_at,
        "wall_s": wall_s,
        "results": [dataclasses.asdict(r) for r in results],
    }
    (out / "routing.json").write_text(json.dumps(raw, indent=1, default=str))
    _plot(results, [w.name for w in workloads], out / "routing.png")
    return out / "routing.md"


def _setup_line(w: Workload) -> str:
    wcfg, sim = w.workload, w.sim
    summary = plan_summary(build_plan(wcfg))
    return (
        f"- `{w.name}` (bench/harness/workload.py): {summary['groups']} prompts x "
        f"G={wcfg.group_size} = "
        f"{summary['rollouts']} rollouts, {summary['planned_requests']} planned requests "
        f"({summary['multi_turn_rollouts']} multi-turn rollouts), {summary['versions']} adapter "
        f"versions (one per {wcfg.rollouts_per_version} rollouts, max_staleness "
        f"{wcfg.max_staleness}), {wcfg.max_inflight} rollouts in flight, median first prompt "
        f"{summary['median_prompt_tokens']} tokens ({wcfg.template_tokens}-token shared "
        f"template), seed {wcfg.seed}. Replicas: KV cache "
        + (
            f"{pct(w.kv_share, 0)} of the working set ({working_set_blocks(wcfg, sim)} blocks)"
            if w.kv_share is not None
            else f"{sim.kv_blocks} blocks x {sim.block_size} tokens ({sim.kv_cache_gib:.0f} GiB)"
        )
        + f", {sim.max_num_seqs} batch slots, prefill {sim.prefill_us_per_token} us/token, "
        f"decode step {sim.decode_step_base_ms} ms + {sim.decode_step_per_seq_ms} ms/sequence, "
        f"completions lognormal(median {sim.gen_median_tokens:.0f}, sigma {sim.gen_sigma}), "
        f"max_model_len {sim.max_model_len}, time_scale {sim.time_scale}.\n"
    )


DEFINITIONS = """
## Definitions

- **throughput**: generated tokens / simulated makespan (first adapter load to last reply).
  **of ceiling**: throughput / the ceiling, the throughput of a router with perfect affinity and
  perfect balance on the same requests: every replica prefills only what the oracle below
  could not hit and runs the same batch the whole time (TRL's rollouts in flight shared evenly,
  bounded by batch slots and by how many average requests its KV cache holds); syncs, ramp-up
  and drain are left out, so no router reaches it (bench/harness/oracle.py).
- **p50 / p99**: client-observed request latency in simulated seconds (real / time_scale: it
  includes the router's and client's own real time, magnified likewise, and CPU contention on
  this shared machine). **replica p50 / p99**: arrival at the replica to last token, exact in
  simulated time (queueing, prefill, decode, time frozen by a pause).
- **added per request**: per request, client-observed real latency minus the replica's real
  time on it (simulated x time_scale), p50 / p99 over requests, in real milliseconds; in brackets
  what the simulation makes of it (real / time_scale, simulated seconds). It is the router's
  hop and CPU time, plus the harness's own real time, the same for every router: the
  simulator parsing the request and serializing the answer, its timer waking late, the client
  parsing the answer, and all of them queueing for this machine's two cores.
- **CPU ms per request**: CPU time (user + system, from /proc) over the driven run divided by
  the successful requests, for the router under test (process tree), the simulated fleet and
  the client. The router's figure is what it costs a real host per request; the simulator's and
  client's are the harness's load on the cores the router needs.
- **syncs**: TRL's weight syncs (`/pause?mode=keep`, `/v1/load_lora_adapter`, `/resume`), how
  many, and their mean / max duration as the client saw it (first call sent to the last answer),
  real milliseconds and (simulated seconds). **paused per replica**: simulated seconds each
  replica spent frozen by `/pause` until `/resume` (mean over replicas): the simulated load time
  of the adapter (0.3 s) plus whatever real time the calls took, magnified 1/time_scale times.
- **hit rate**: prefix-cache hit tokens / prompt tokens queried, summed over the replicas'
  counters. **of oracle**: hit rate / the oracle's, one LRU cache with the whole fleet's capacity
  that sees every successful request at its send time, caches prompts at once and completions at
  the reply, and is cleared by every `/pause` (vLLM resets the prefix cache on pause).
- **busy imbalance**: max / mean over replicas of simulated time spent prefilling or decoding.
  In brackets, the same before the drain: from the start to the moment the last rollout
  started (after it TRL only sends the remaining turns of the rollouts in flight, so a replica
  holding one of the last long rollouts stays busy while the others idle, whoever placed it),
  over each replica's requests as the client saw them (send to answer).
"""


def _plot(results: Sequence[RunResult], workloads: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.status == "ok"]
    shown = [w for w in workloads if any(r.workload == w for r in ran)]
    routers = list(dict.fromkeys(r.router for r in ran))
    if not routers or not shown:
        return
    panels = [
        ("throughput_tok_s", "throughput (tok/s, simulated)"),
        ("p99_s", "p99 latency (s, simulated)"),
        ("added_p50_ms", "added per request p50 (real ms)"),
    ]
    fig, axes = plt.subplots(len(shown), 3, figsize=(18, 3.6 * len(shown)), squeeze=False)
    width = 0.8 / len(routers)
    for row, workload in enumerate(shown):
        sizes = sorted({r.replicas for r in ran if r.workload == workload})
        for col, (attr, title) in enumerate(panels):
            ax = axes[row][col]
            for i, name in enumerate(routers):
                xs, ys = [], []
                for j, n in enumerate(sizes):
                    hit = [
                        x for x in ran if (x.workload, x.router, x.replicas) == (workload, name, n)
                    ]
                    if hit:
                        xs.append(j + (i - (len(routers) - 1) / 2) * width)
                        ys.append(getattr(hit[0], attr))
                ax.bar(xs, ys, width=width, label=name)
            ax.set_xticks(range(len(sizes)), [f"{n} replicas" for n in sizes])
            ax.set_title(f"{workload}: {title}")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(routers), fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.runners.run_routing", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny workload, 2 replicas, seconds")
    p.add_argument(
        "--workload", default="grpo", help=f"comma-separated, from {', '.join(WORKLOADS)}"
    )
    p.add_argument("--replicas", default=None, help="comma-separated counts (default 2,4,8,16)")
    p.add_argument(
        "--routers",
        # proxy-events makes every simulator of the run publish events (fair, but costlier):
        # it runs when named.
        default=",".join(n for n, s in ROUTERS.items() if not s.kv_events),
        help=f"comma-separated, from {sorted(ROUTERS)}",
    )
    p.add_argument(
        "--events-workloads",
        default=None,
        help="comma-separated workloads where proxy-events runs (its replicas publish KV "
        "events, which costs CPU; default: every workload of the run)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=None, help="prompts (default: the workload's)")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="rollouts in flight, TRL's max_inflight_tasks (default: the workload's, "
        "bench/harness/workload.py; TRL's reference run keeps 128). A tight workload's caches stay "
        "its "
        "share of the working set, which grows with it",
    )
    p.add_argument("--time-scale", type=float, default=None, help="real s per simulated s")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument(
        "--probe-interval",
        default=str(PROBE_INTERVAL_SIM_S),
        help="every router's health-probe period in simulated s, or 'own' for each router's "
        f"own default in real s (default {PROBE_INTERVAL_SIM_S:g}, see bench/harness/routers.py)",
    )
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument(
        "--report-from",
        type=Path,
        default=None,
        help="rewrite routing.md/.png in --out from this routing.json instead of running",
    )
    p.add_argument("--wall-s", type=float, default=None, help="with --report-from: wall time")
    p.add_argument("--measured-at", default=None, help="with --report-from: when it ran")
    add_foreign_args(p)
    add_restart_args(p)
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> tuple[list[Workload], list[int]]:
    names = [x for x in args.workload.split(",") if x]
    unknown = [x for x in names if x not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    if args.max_inflight is not None and args.max_inflight < 1:
        raise ValueError("--max-inflight must be >= 1")
    chosen: list[Workload] = []
    for name in names:
        base = WORKLOADS[name]
        wcfg, sim = base.workload, base.sim
        if args.smoke:
            wcfg = dataclasses.replace(
                wcfg,
                groups=args.groups or 6,
                rollouts_per_version=16,
                max_inflight=16,
                max_tokens=min(wcfg.max_tokens, 600),
            )
            sim = dataclasses.replace(
                sim, gen_median_tokens=min(sim.gen_median_tokens, 200.0), time_scale=0.01
            )
        elif args.groups:
            wcfg = dataclasses.replace(wcfg, groups=args.groups)
        if args.max_inflight is not None:
            wcfg = dataclasses.replace(wcfg, max_inflight=args.max_inflight)
        wcfg = dataclasses.replace(wcfg, seed=args.seed)
        if args.time_scale:
            sim = dataclasses.replace(sim, time_scale=args.time_scale)
        kv_share = base.kv_share
        if args.kv_blocks is not None:
            sim, kv_share = dataclasses.replace(sim, kv_blocks=args.kv_blocks), None
        chosen.append(dataclasses.replace(base, workload=wcfg, sim=sim, kv_share=kv_share))
    sizes = [2] if args.smoke else [2, 4, 8, 16]
    if args.replicas:
        sizes = [int(x) for x in args.replicas.split(",")]
        if any(n < 1 for n in sizes):
            raise ValueError("--replicas counts must be >= 1")
    return chosen, sizes


def events_workloads(args: argparse.Namespace, workloads: Sequence[Workload]) -> set[str]:
    """The workloads where routers on KV-cache events (``proxy-events``) run: all by default."""
    names = {w.name for w in workloads}
    if args.events_workloads is None:
        return names
    chosen = {x for x in args.events_workloads.split(",") if x}
    if not chosen <= names:
        raise ValueError(
            f"--events-workloads {sorted(chosen - names)} not among --workload {sorted(names)}"
        )
    return chosen


def probe_interval(args: argparse.Namespace) -> float | None:
    if args.probe_interval == "own":
        return None
    value = float(args.probe_interval)
    if value <= 0:
        raise ValueError("--probe-interval must be > 0 (or 'own')")
    return value


def rerender(
    raw_path: Path, out: Path, wall_s: float | None = None, measured_at: str | None = None
) -> Path:
    """Write routing.md/.png/.json again from a run's routing.json (report changes without
    rerunning the matrix; ceilings are recomputed from the per-request dumps next to it when
    present). ``wall_s`` and ``measured_at`` fill in JSON written before it stored them."""
    raw = json.loads(raw_path.read_text())
    workloads = [
        Workload(
            name,
            WORKLOADS[name].description,
            WorkloadConfig(**spec["workload"]),
            SimConfig(**spec["simulator"]),
            spec["kv_share"],
        )
        for name, spec in raw["workloads"].items()
    ]
    results = [RunResult(**r) for r in raw["results"]]
    command = raw["command"]
    if "--report-from" not in command:
        command += (
            f"` (report rewritten by `python -m bench.runners.run_routing --report-from {raw_path}`"
        )
        command += ", ceilings recomputed from the per-request dumps)"
    by_name = {w.name: w for w in workloads}
    logs = raw_path.parent / "tmp" / "logs"
    for r in results:
        dump = logs / f"requests-{r.workload}-{r.router}-{r.replicas}.jsonl"
        if r.status == "ok" and dump.exists():
            _ceiling_from_dump(r, dump, by_name[r.workload])
    wall = wall_s if wall_s is not None else raw.get("wall_s", math.nan)
    return write_report(
        results,
        workloads,
        out,
        command,
        wall,
        raw["probe_interval_sim_s"],
        machine=raw["machine"],
        measured_at=measured_at or raw.get("measured_at") or "(time not recorded)",
    )


async def amain(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.report_from is not None:
        print(f"wrote {rerender(args.report_from, args.out, args.wall_s, args.measured_at)}")
        return 0
    workloads, sizes = configs(args)
    interval = probe_interval(args)
    specs = select([x for x in args.routers.split(",") if x])
    events_in = events_workloads(args, workloads)
    if any(s.kv_events for s in specs):
        # Every router of a workload with event routers faces the same publishing (and so
        # equally loaded) replicas; the other workloads' replicas publish nothing.
        workloads = [
            dataclasses.replace(w, sim=dataclasses.replace(w.sim, kv_events=True))
            if w.name in events_in
            else w
            for w in workloads
        ]
    log_dir = args.out / "tmp" / "logs"  # bench/results/tmp/ is git-ignored
    started = time.monotonic()
    results: list[RunResult] = []
    for workload in workloads:
        for n in sizes:
            for spec in specs:
                if spec.kv_events and workload.name not in events_in:
                    continue
                t0 = time.monotonic()
                try:
                    r = await run_one(
                        spec,
                        n,
                        workload,
                        log_dir,
                        args.startup_timeout,
                        interval,
                        args.foreign_share,
                        args.restart_at,
                    )
                except Exception as exc:  # one router failing must not hide the others' numbers
                    r = RunResult(
                        spec.name,
                        n,
                        "failed",
                        workload=workload.name,
                        reason=f"{type(exc).__name__}: {exc}",
                    )
                results.append(r)
                print(
                    f"{workload.name:>8} {spec.name:>14} x{n:<2}: {r.status:7} "
                    f"tok/s {fmt(r.throughput_tok_s, 0):>6} p99 {fmt(r.p99_s, 2):>6} "
                    f"busy-imb {fmt(r.imbalance_busy):>5} hit/oracle {pct(r.oracle_ratio):>6} "
                    f"sync {fmt(r.sync_mean_real_s * 1e3, 0):>5} ms "
                    f"added {fmt(r.added_p50_ms, 1):>5} ms errors {r.errors} "
                    f"({time.monotonic() - t0:.1f} s)"
                    + (f"  [{r.reason[:160]}]" if r.reason else ""),
                    flush=True,
                )
    command = "python -m bench.runners.run_routing " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    path = write_report(
        results, workloads, args.out, command.strip(), time.monotonic() - started, interval
    )
    print(f"wrote {path}")
    return 0 if any(r.status == "ok" for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(amain(argv))


if __name__ == "__main__":
    sys.exit(main())
