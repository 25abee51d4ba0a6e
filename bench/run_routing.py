"""Routing quality: the same AsyncGRPO-shaped workload through each router, in front of simulated
vLLM replicas; reports prefix-cache hit rate (against an oracle), load imbalance, throughput and
latency for 2, 4 and 8 replicas.

    python -m bench.run_routing                 # full run -> bench/results/routing.md + PNGs
    python -m bench.run_routing --smoke --out /tmp/r   # seconds: 2 replicas, tiny workload

Each (router, replica count) run gets a fresh simulator fleet and a fresh router process, so no
state carries over. See bench/README.md for what every column means.
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

from bench.kv_events_report import kv_events_section, kv_events_summary
from bench.oracle import oracle_hits
from bench.procs import REPO, ManagedProcess, free_port, machine_description, managed
from bench.report import fmt, pct, percentile, table
from bench.routers import ROUTERS, RouterSpec, select
from bench.simulator import SimConfig
from bench.workload import (
    ControlPlane,
    Driver,
    PromptFormat,
    RunTrace,
    WorkloadConfig,
    build_plan,
    completion_body,
    config_dict,
    plan_summary,
)

DEFAULT_OUT = REPO / "bench" / "results"
PROBE_ADAPTER = "bench-control-probe"

# Targets from the issue (ratios within one run).
TARGET_ORACLE_RATIO = 0.98
TARGET_IMBALANCE = 1.10


@dataclass
class ControlProbe:
    """What a router does with TRL's control calls, measured on the replicas behind it."""

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
    """Send TRL's control calls through the router once and look at every replica."""
    probe = ControlProbe(replicas=len(replica_urls))
    body = {"lora_name": PROBE_ADAPTER, "lora_path": "/tmp/rollout-bench/probe"}
    probe.load_status, _ = await _post(session, router_url + "/v1/load_lora_adapter", body)
    for url in replica_urls:
        models = await _get_json(session, url + "/v1/models")
        if any(m["id"] == PROBE_ADAPTER for m in models["data"]):
            probe.load_replicas += 1
    # Undone through the router first: rollout-proxy keeps a desired state and its health loop
    # would otherwise re-load the adapter and re-pause the replicas mid-run (a deadlock once
    # every rollout slot waits on a frozen replica). Then directly, for routers that did not
    # broadcast.
    await _post(session, router_url + "/v1/unload_lora_adapter", {"lora_name": PROBE_ADAPTER})
    for url in replica_urls:
        await _post(session, url + "/v1/unload_lora_adapter", {"lora_name": PROBE_ADAPTER})
    probe.pause_status, _ = await _post(session, router_url + "/pause?mode=keep")
    for url in replica_urls:
        state = await _get_json(session, url + "/sim/stats?log=0")
        if (await _get_json(session, url + "/is_paused"))["is_paused"]:
            probe.pause_replicas += 1
            probe.pause_modes.append(state["last_pause_mode"] or "?")
    await _post(session, router_url + "/resume")
    for url in replica_urls:
        await _post(session, url + "/resume")
    return probe


_SIM_ID = re.compile(r"^cmpl-sim(\d+)-")


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


def _metrics(
    result: RunResult,
    trace: RunTrace,
    stats: list[dict[str, Any]],
    sim: SimConfig,
    group_size: int,
    dump: Path | None = None,
) -> None:
    """Fill ``result`` from the client's trace and the replicas' counters."""
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
    result.per_replica = [
        {
            k: s[k]
            for k in ("replica", "requests", "busy_s", "seq_s", "queries_tokens", "hit_tokens")
        }
        for s in stats
    ]


async def run_one(
    spec: RouterSpec,
    n: int,
    wcfg: WorkloadConfig,
    sim: SimConfig,
    log_dir: Path,
    startup_timeout_s: float,
) -> RunResult:
    result = RunResult(spec.name, n, "ok")
    reason = spec.unavailable()
    if reason is not None:
        result.status, result.reason = "skipped", reason
        return result
    plan = build_plan(wcfg)
    tag = f"{spec.name}-{n}"
    sim_argv = [
        sys.executable,
        "-m",
        "bench.simulator",
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
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        env = dict(spec.env)
        if spec.kv_events:
            env["PROXY_KV_EVENTS_ENDPOINTS"] = ",".join(fleet_info.get("kv_events", []))
        router = stack.enter_context(
            managed(spec.name, spec.argv(urls, port), log_dir / f"router-{tag}.log", env)
        )
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
            driver = Driver(wcfg, router_url, ControlPlane(targets, trace), spec.prompt_format)
            await driver.run(plan)
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
    _metrics(result, trace, stats, sim, wcfg.group_size, dump)
    if result.errors:
        result.status = "failed" if result.errors == result.requests else "ok"
        result.reason = (
            f"{result.errors} of {result.requests} requests failed: {result.error_sample}"
        )
    return result


# --------------------------------------------------------------------------------------------
# Report.


def _targets(results: Sequence[RunResult]) -> list[str]:
    """Target lines computed from the measured rows."""
    lines = []
    ours = {r.replicas: r for r in results if r.router == "proxy" and r.status == "ok"}
    for n, r in sorted(ours.items()):
        ok_ratio = r.oracle_ratio >= TARGET_ORACLE_RATIO
        ok_imb = r.imbalance_busy <= TARGET_IMBALANCE
        rust = [
            x
            for x in results
            if x.replicas == n and x.router in ("vllm-router", "sglang-router") and x.status == "ok"
        ]
        above = all(r.hit_rate > x.hit_rate for x in rust)
        rust_txt = ", ".join(f"{x.router} {pct(x.hit_rate)}" for x in rust) or "none ran"
        lines.append(
            f"- {n} replicas: hit rate {pct(r.hit_rate)} = {pct(r.oracle_ratio)} of oracle "
            f"(target >= {pct(TARGET_ORACLE_RATIO, 0)}: {'met' if ok_ratio else 'MISSED'}); "
            f"busy imbalance {fmt(r.imbalance_busy)} (target <= {TARGET_IMBALANCE}: "
            f"{'met' if ok_imb else 'MISSED'}); above the Rust routers ({rust_txt}): "
            f"{'met' if above and rust else ('MISSED' if rust else 'not measured')}"
        )
    return lines


def write_report(
    results: Sequence[RunResult],
    wcfg: WorkloadConfig,
    sim: SimConfig,
    out: Path,
    command: str,
    wall_s: float,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plan = build_plan(wcfg)
    summary = plan_summary(plan)
    machine = machine_description()
    md: list[str] = ["# Routing quality: rollout-proxy vs the alternatives\n\n"]
    md.append(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}` "
        f"({wall_s:.0f} s wall). Machine: {machine['nproc']} cores ({machine['cpu']}), "
        f"{machine['memory']}, Python {machine['python']}. Replicas are simulated "
        "(bench/simulator.py); figures are simulated seconds unless marked real.\n"
    )
    md.append("\n## Results\n\n")
    headers = [
        "router",
        "hit rate",
        "oracle",
        "ratio to oracle",
        "busy imbalance",
        "load imbalance",
        "request spread",
        "throughput (tok/s)",
        "p50 / p99 (s)",
        "replica p50 / p99 (s)",
        "oracle hits lost: first turns / continuations",
        "groups on 1 replica",
        "errors",
        "adapters loaded",
    ]
    for n in sorted({r.replicas for r in results}):
        md.append(f"\n### {n} replicas\n\n")
        rows = []
        for r in (x for x in results if x.replicas == n):
            if r.status == "skipped":
                rows.append([r.router, "skipped: " + r.reason] + ["-"] * (len(headers) - 2))
                continue
            rows.append(
                [
                    r.router,
                    pct(r.hit_rate),
                    pct(r.oracle_rate),
                    pct(r.oracle_ratio),
                    fmt(r.imbalance_busy),
                    fmt(r.imbalance_load),
                    fmt(r.spread),
                    fmt(r.throughput_tok_s, 0),
                    f"{fmt(r.p50_s, 1)} / {fmt(r.p99_s, 1)}",
                    f"{fmt(r.server_p50_s, 1)} / {fmt(r.server_p99_s, 1)}",
                    f"{pct(r.lost_first_turn)} / {pct(r.lost_continuation)}",
                    pct(r.groups_whole, 0),
                    f"{r.errors}/{r.requests}",
                    r.control,
                ]
            )
        md.append(table(headers, rows))
    md.append("\n![routing](routing.png)\n")
    md.append("\n## Against the targets\n\n")
    md.extend(line + "\n" for line in _targets(results) or ["- our proxy did not run\n"])
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
        "same adapters and the comparison measures routing alone. A real TRL run behind such a "
        "router would fail (adapter missing on the other replicas -> 404 on rollouts).\n"
    )
    ours = [r for r in results if r.decisions]
    if ours:
        md.append("\n## rollout-proxy's own routing decisions\n\n")
        rows = []
        for r in ours:
            total = sum(r.decisions.values()) or 1.0
            rows.append(
                [f"{r.router} x{r.replicas}"]
                + [
                    pct(r.decisions.get(k, 0.0) / total)
                    for k in ("affinity", "spilled", "unmatched")
                ]
                + [fmt(r.replicas_per_group, 2)]
            )
        md.append(table(["run", "affinity", "spilled", "unmatched", "replicas per group"], rows))
    md.append(kv_events_section(results))
    failures = [r for r in results if r.status == "failed" or r.errors]
    if failures:
        md.append("\n## Failures\n\n")
        for r in failures:
            md.append(f"- {r.router} x{r.replicas}: {r.reason}\n")
    md.append("\n## Definitions\n\n")
    md.append(
        "- **hit rate**: prefix-cache hit tokens / prompt tokens queried, summed over the "
        "replicas' counters (what `vllm:prefix_cache_hits_total / "
        "vllm:prefix_cache_queries_total` report).\n"
        "- **oracle**: one LRU cache with the whole fleet's capacity (replicas x kv_blocks) that "
        "sees every successful request of the same run at its send time, hits the longest cached "
        "chain of full prompt blocks (vLLM's cap: (len-1)//16 blocks), caches the prompt's blocks "
        "at once and the generated blocks at the reply (as a replica does), and is cleared when "
        "the client "
        "sent `/pause` (vLLM resets the prefix cache on pause unless `clear_cache=false`). It "
        "bounds any router from above (a replica sees each prompt no earlier and holds a share "
        "of the memory) except for one corner: a request queued at a replica across a pause is "
        "cached by the replica after the clear but by the oracle before it, worth well under "
        "1%. **ratio to oracle** = hit rate / oracle.\n"
        "- **busy imbalance**: max / mean over replicas of simulated time spent prefilling or "
        "decoding. **load imbalance**: the same over the time integral of the running batch size "
        "(busy time saturates when every replica always has work; this does not). "
        "**request spread**: max / mean requests per replica.\n"
        "- **throughput**: generated tokens / simulated makespan (first adapter load to last "
        "reply). **p50 / p99**: client-observed request latency in simulated seconds (real / "
        "time_scale: it includes the router's and client's own real time, magnified likewise, "
        "and CPU contention on this shared machine). **replica p50 / p99**: arrival at the "
        "replica to last token, exact in simulated time (queueing, prefill, decode only).\n"
        "- **oracle hits lost**: per request, oracle hit tokens minus the replica's "
        "`usage.prompt_tokens_details.cached_tokens`, summed over first turns and over "
        "multi-turn continuations, as shares of the oracle's hit tokens (they add up to "
        "1 - ratio to oracle, give or take the reordering of requests that arrive together).\n"
        "- **groups on 1 replica**: share of GRPO groups whose G first-turn requests all reached "
        "one replica (read from the replica index each simulated answer carries in its id).\n"
    )
    md.append("\n## Setup\n\n")
    md.append(
        f"Workload (bench/workload.py): {summary['groups']} prompts x G={wcfg.group_size} = "
        f"{summary['rollouts']} rollouts, {summary['planned_requests']} planned requests "
        f"({summary['multi_turn_rollouts']} multi-turn rollouts), {summary['versions']} adapter "
        f"versions (one per {wcfg.rollouts_per_version} rollouts, max_staleness "
        f"{wcfg.max_staleness}), {wcfg.max_inflight} rollouts in flight, median prompt "
        f"{summary['median_prompt_tokens']} tokens with a {wcfg.template_tokens}-token shared "
        f"template, seed {wcfg.seed}.\n\n"
    )
    md.append(
        f"Replica model (bench/simulator.py): KV cache {sim.kv_blocks} blocks x "
        f"{sim.block_size} tokens ({sim.kv_cache_gib:.0f} GiB of Qwen2.5-1.5B KV) per replica, "
        f"{sim.max_num_seqs} batch slots, prefill {sim.prefill_us_per_token} us/token, decode "
        f"step {sim.decode_step_base_ms} ms + {sim.decode_step_per_seq_ms} ms/sequence, "
        f"completions lognormal(median {sim.gen_median_tokens:.0f}, sigma {sim.gen_sigma}), "
        f"time_scale {sim.time_scale}.\n"
    )
    (out / "routing.md").write_text("".join(md))
    raw = {
        "workload": config_dict(wcfg),
        "simulator": dataclasses.asdict(sim),
        "machine": machine,
        "command": command,
        "results": [dataclasses.asdict(r) for r in results],
    }
    (out / "routing.json").write_text(json.dumps(raw, indent=1, default=str))
    _plot(results, out / "routing.png")
    return out / "routing.md"


def _plot(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.status == "ok"]
    routers = list(dict.fromkeys(r.router for r in ran))
    sizes = sorted({r.replicas for r in ran})
    if not routers:
        return
    panels = [
        ("oracle_ratio", "hit rate / oracle", 100.0, "%"),
        ("imbalance_busy", "busy imbalance (max/mean)", 1.0, ""),
        ("throughput_tok_s", "throughput (generated tok/s, simulated)", 1.0, ""),
        ("server_p99_s", "replica-side p99 latency (simulated s)", 1.0, ""),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / len(routers)
    for ax, (attr, title, scale, unit) in zip(axes.flat, panels, strict=True):
        for i, name in enumerate(routers):
            xs, ys = [], []
            for j, n in enumerate(sizes):
                row = next((r for r in ran if r.router == name and r.replicas == n), None)
                if row is not None:
                    xs.append(j + (i - (len(routers) - 1) / 2) * width)
                    ys.append(getattr(row, attr) * scale)
            ax.bar(xs, ys, width=width, label=name)
        ax.set_xticks(range(len(sizes)), [f"{n} replicas" for n in sizes])
        ax.set_title(title + (f" ({unit})" if unit else ""))
        if attr == "oracle_ratio":
            ax.axhline(TARGET_ORACLE_RATIO * 100, color="k", linestyle="--", linewidth=0.8)
            ax.set_ylim(0, 105)
        if attr == "imbalance_busy":
            ax.axhline(TARGET_IMBALANCE, color="k", linestyle="--", linewidth=0.8)
            ax.set_ylim(0.9, None)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(routers), fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run_routing", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny workload, 2 replicas, seconds")
    p.add_argument("--replicas", default=None, help="comma-separated counts (default 2,4,8)")
    p.add_argument(
        "--routers",
        # proxy-events makes every simulator of the run publish events (fair, but costlier):
        # it runs when named.
        default=",".join(n for n, s in ROUTERS.items() if not s.kv_events),
        help=f"comma-separated, from {sorted(ROUTERS)}",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=None, help="prompts (default 128)")
    p.add_argument("--time-scale", type=float, default=None, help="real s per simulated s")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> tuple[WorkloadConfig, SimConfig, list[int]]:
    if args.smoke:
        wcfg = WorkloadConfig(
            seed=args.seed,
            groups=args.groups or 6,
            rollouts_per_version=16,
            max_inflight=16,
            max_tokens=600,
        )
        sim = SimConfig(time_scale=args.time_scale or 0.01, gen_median_tokens=200)
        sizes = [2]
    else:
        wcfg = WorkloadConfig(seed=args.seed, groups=args.groups or 128)
        sim = SimConfig(time_scale=args.time_scale or SimConfig.time_scale)
        sizes = [2, 4, 8]
    if args.kv_blocks is not None:
        sim = dataclasses.replace(sim, kv_blocks=args.kv_blocks)
    if args.replicas:
        sizes = [int(x) for x in args.replicas.split(",")]
        if any(n < 1 for n in sizes):
            raise ValueError("--replicas counts must be >= 1")
    return wcfg, sim, sizes


async def amain(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    wcfg, sim, sizes = configs(args)
    specs = select([x for x in args.routers.split(",") if x])
    if any(s.kv_events for s in specs):
        # Every router of the run faces the same publishing (and so equally loaded) replicas.
        sim = dataclasses.replace(sim, kv_events=True)
    log_dir = args.out / "tmp" / "logs"  # bench/results/tmp/ is git-ignored
    started = time.monotonic()
    results: list[RunResult] = []
    for n in sizes:
        for spec in specs:
            t0 = time.monotonic()
            try:
                r = await run_one(spec, n, wcfg, sim, log_dir, args.startup_timeout)
            except Exception as exc:  # one router failing must not hide the others' numbers
                r = RunResult(spec.name, n, "failed", reason=f"{type(exc).__name__}: {exc}")
            results.append(r)
            print(
                f"{spec.name:>14} x{n}: {r.status:7} hit {pct(r.hit_rate):>6} "
                f"oracle-ratio {pct(r.oracle_ratio):>6} busy-imb {fmt(r.imbalance_busy):>5} "
                f"load-imb {fmt(r.imbalance_load):>5} tok/s {fmt(r.throughput_tok_s, 0):>6} "
                f"p99 {fmt(r.p99_s, 2):>6} errors {r.errors} ({time.monotonic() - t0:.1f} s)"
                + (f"  [{r.reason[:160]}]" if r.reason else ""),
                flush=True,
            )
    command = "python -m bench.run_routing " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_report(results, wcfg, sim, args.out, command.strip(), time.monotonic() - started)
    print(f"wrote {path}")
    return 0 if any(r.status == "ok" for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(amain(argv))


if __name__ == "__main__":
    sys.exit(main())
