"""Proxy overhead: requests/s, added latency and CPU per request of each router in front of fast
fake backends, all in one run, with ratios to vllm-router's.

    python -m bench.runners.run_overhead                  # -> bench/results/overhead.md
    python -m bench.runners.run_overhead --smoke --out /tmp/o

Backends: one nginx serving two fake vLLM replicas (fixed /v1/completions answer, /health,
/v1/models, /server_info, /metrics) on 127.0.0.1. Load: wrk (its own process) posting TRL-shaped
bodies with 512-token token-id prompts, two workloads: ``repeated`` (one body, every request the
same prompt) and ``distinct64`` (64 distinct prompts cycled: every request hashes a prompt the
router has seen 1/64 as often, closer to a run's rollouts). For each target and workload:
requests/s at 64 connections (``--connections 64,8``: at each count), p50/p99 latency at 1
connection (added = minus the direct figure), and the target's CPU time per request
(utime+stime of its process tree from /proc, over each loaded run, divided by requests).

The machine is shared: every target is started first, then the runs are interleaved (round r
runs every target once, in turn), and each figure is the median over the rounds.

Targets: direct (wrk -> backend), rollout-proxy (defaults; ``proxy-python``: PROXY_NATIVE=off, so
that proxy-python minus proxy is what the compiled primitives save; ``proxy-rr``: round-robin
policy, so that proxy minus proxy-rr is what routing costs), vllm-router, sglang-router, nginx as a
pass-through proxy (the floor for any proxy process), and bare uvicorn pass-throughs with the lean
client and with aiohttp (the floors for a Python one, bench/harness/passthrough.py).
``proxy@LABEL``: the default proxy as another checkout runs it (``BENCH_TREES=LABEL=PATH``,
bench/harness/routers.py; PATH's own ``.venv``), so that a change is measured against its base side
by side, in the same interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.analysis.paired import round_ratios
from bench.analysis.report import fmt, table
from bench.harness.procs import (
    REPO,
    ManagedProcess,
    find_tool,
    machine_description,
    managed,
    wait_http,
)
from bench.harness.routers import rust_router_argv, trees
from fakes.net import free_port

DEFAULT_OUT = REPO / "bench" / "results"
MODEL = "Qwen/Qwen2.5-Math-1.5B"
PROMPT_TOKENS = 512
# Completion answered by the fake backends: 16 tokens with logprobs, the shape TRL reads. Small by
# default, so that the benchmark isolates per-request overhead from body size; --completion-tokens
# gives a rollout-sized answer (the proxy learns every generated id), reported in
# overhead_completion<N>.md beside overhead.md.
DEFAULT_COMPLETION_TOKENS = 16
COMPLETION_TOKENS = DEFAULT_COMPLETION_TOKENS

# Workloads: one body repeated, or this many distinct prompts cycled.
DISTINCT_PROMPTS = 64
BODIES = ("repeated", "distinct64")
# The bar, as ratios to vllm-router's figures in the same run at the first connection count:
# CPU per request at most half of its, requests/s at least 1.5x.
TARGET_CPU_RATIO = 0.5
TARGET_RPS_RATIO = 1.5
# Loaded runs (rps, CPU per request) at these connection counts by default; --connections sets
# others (the first is the one the bar is checked at).
DEFAULT_CONNECTIONS = (64,)


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    kind: str  # direct | proxy | vllm-router | sglang-router | nginx | py-floor
    env: dict[str, str] = field(default_factory=dict)
    text_prompt: bool = False
    args: tuple[str, ...] = ()
    # The module run as the proxy: ``proxy``, or the bench's launcher that adds the baseline
    # policies (bench/harness/proxy_with_baselines.py).
    module: str = "proxy"
    # Another checkout whose proxy runs instead of this one's (``proxy@LABEL``): its own .venv,
    # ``python -P -m proxy`` so that this checkout's proxy/ cannot shadow it.
    tree: Path | None = None

    def unavailable(self) -> str | None:
        if self.tree is not None and not (self.tree / ".venv" / "bin" / "python").is_file():
            return f"{self.tree}/.venv/bin/python not found (run `make setup` in {self.tree})"
        tool = {"vllm-router": "vllm-router", "sglang-router": "sglang-router", "nginx": "nginx"}
        needed = tool.get(self.kind)
        if needed and find_tool(needed) is None:
            return f"`{needed}` not found"
        return None


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("direct", "wrk -> fake backend, no proxy", "direct"),
        Target(
            "proxy",
            "rollout-proxy, defaults (PROXY_NATIVE=auto: the C extension proxy.core._native, "
            "built by make setup)",
            "proxy",
        ),
        Target(
            "proxy-python",
            "rollout-proxy, defaults but PROXY_NATIVE=off: the pure-Python reference of the "
            "primitives (prompt scan, block-chain hashing); proxy minus proxy-python is the C "
            "extension's gain",
            "proxy",
            {"PROXY_NATIVE": "off"},
        ),
        Target(
            "proxy-rr",
            "rollout-proxy, PROXY_POLICY=round_robin: the whole data path (guard, parse, "
            "validation, limits, metrics, answer) without hashing, prefix index, cost policy or "
            "recording completions; proxy minus proxy-rr is what routing costs",
            "proxy",
            {"PROXY_POLICY": "round_robin"},
            module="bench.harness.proxy_with_baselines",
        ),
        Target("vllm-router", "vllm-router --policy cache_aware", "vllm-router"),
        Target(
            "sglang-router",
            "sglang-router --policy cache_aware (prompt as text: it rejects token ids)",
            "sglang-router",
            text_prompt=True,
        ),
        Target("nginx", "nginx pass-through (proxy_pass, upstream keepalive)", "nginx"),
        Target(
            "floor",
            "bare ASGI app on uvicorn + the lean client (proxy/pool.py), round robin",
            "py-floor",
            args=("--client", "lean"),
        ),
        Target(
            "floor-protocol",
            "the same lean relay served from uvicorn's protocol object (proxy/front.py), round "
            "robin: rollout-proxy's architecture with no routing",
            "py-floor",
            args=("--client", "lean", "--front", "protocol"),
        ),
        Target(
            "floor-min",
            "bench/harness/minrelay.py: uvloop + httptools on both sides and nothing else (no "
            "timeouts, "
            "no validation): the least a Python relay costs here",
            "py-floor",
            args=("--front", "min"),
        ),
        Target(
            "floor-min-routed",
            "floor-min + rollout-proxy's routing core (C scan, Router.route with the cost policy, "
            "the completion learned) and nothing else: what routing costs under load",
            "py-floor",
            args=("--front", "min-routed"),
        ),
        Target(
            "floor-aiohttp",
            "bare ASGI app on uvicorn + one aiohttp session, round robin",
            "py-floor",
            args=("--client", "aiohttp"),
        ),
    )
}
DEFAULT_TARGETS = list(TARGETS)


def target(name: str) -> Target:
    """``TARGETS[name]``, or ``proxy@LABEL`` for a checkout named in ``BENCH_TREES``."""
    if name in TARGETS:
        return TARGETS[name]
    base, sep, label = name.partition("@")
    tree = trees().get(label) if sep and base == "proxy" else None
    if tree is None:
        raise KeyError(name)
    return Target(
        name,
        f"rollout-proxy, defaults, as checked out at {tree}",
        "proxy",
        tree=tree,
    )


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    errors: int
    p50_us: float
    p99_us: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else math.nan


@dataclass
class Measurement:
    target: str
    body: str
    description: str
    status: str = "ok"
    reason: str = ""
    rps_64: float = math.nan
    p50_1_us: float = math.nan
    p99_1_us: float = math.nan
    cpu_us_per_req: float = math.nan
    # CPU per request at one connection: there every request waits for all of it (one event
    # loop, one request at a time), so it is the target's own share of the p50 at 1.
    cpu_1_us_per_req: float = math.nan
    errors: int = 0
    requests: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)
    # Per connection count of the loaded runs: {"rps": ..., "cpu_us_per_req": ...} (medians).
    loaded: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def settle(self) -> None:
        """Each figure: the median of its rounds."""
        for name in ("rps_64", "p50_1_us", "p99_1_us", "cpu_us_per_req", "cpu_1_us_per_req"):
            setattr(self, name, self._median(name))
        for name in self.samples:
            figure, at, connections = name.partition("@")
            if at and figure in ("rps", "cpu_us_per_req"):
                self.loaded.setdefault(int(connections), {})[figure] = self._median(name)

    def _median(self, name: str) -> float:
        values = [v for v in self.samples.get(name, []) if math.isfinite(v)]
        return statistics.median(values) if values else math.nan

    def at(self, connections: int, figure: str) -> float:
        return self.loaded.get(connections, {}).get(figure, math.nan)


# --------------------------------------------------------------------------------------------
# Payloads and configs.


def bodies(kind: str, text_prompt: bool) -> list[str]:
    """The workload's request bodies, one JSON document per line (what the wrk script reads)."""
    seeds = range(DISTINCT_PROMPTS) if kind == "distinct64" else range(1)
    return [
        json.dumps(completion_request(text_prompt, seed), separators=(",", ":")) for seed in seeds
    ]


def completion_request(text_prompt: bool, seed: int = 0) -> dict[str, object]:
    rng = random.Random(seed)
    ids = [rng.randrange(151_936) for _ in range(PROMPT_TOKENS)]
    return {
        "model": MODEL,
        "prompt": " ".join(map(str, ids)) if text_prompt else ids,
        "max_tokens": COMPLETION_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": 1234567,
    }


def _fixed_completion(tokens: int | None = None) -> str:
    """The backend's answer: ``tokens`` generated ids (the module's COMPLETION_TOKENS when None,
    as older checkouts' drivers set it) with their logprobs."""
    n = COMPLETION_TOKENS if tokens is None else tokens
    ids = list(range(1000, 1000 + n))
    toks = [f"token_id:{t}" for t in ids]
    body = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": "x" * n,
                "logprobs": {
                    "text_offset": list(range(n)),
                    "token_logprobs": [-0.5] * n,
                    "tokens": toks,
                    "top_logprobs": [{t: -0.5} for t in toks],
                },
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": ids,
            }
        ],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": n,
            "total_tokens": PROMPT_TOKENS + n,
        },
    }
    return json.dumps(body, separators=(",", ":"))


def _fake_models() -> str:
    return json.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": MODEL,
                    "object": "model",
                    "owned_by": "vllm",
                    "root": MODEL,
                    "parent": None,
                    "max_model_len": 4096,
                }
            ],
        },
        separators=(",", ":"),
    )


def _fake_server_info() -> str:
    return json.dumps(
        {
            "vllm_config": {
                "cache_config": {"block_size": 16},
                "parallel_config": {"data_parallel_size": 1},
                "lora_config": {"max_loras": 6, "max_lora_rank": 1},
            }
        },
        separators=(",", ":"),
    )


# nginx reads a config string into a 4 KiB buffer.
NGINX_MAX_STRING = 4000


def _nginx_string(s: str) -> str:
    if "'" in s or "$" in s or "\\" in s:
        raise ValueError("fixed answers must not contain quotes, $ or backslashes for nginx")
    return f"'{s}'"


def backend_conf(prefix: Path, ports: Sequence[int], tokens: int | None = None) -> str:
    """nginx config: each port is a fake vLLM replica answering instantly, with ``tokens``
    generated ids (``_fixed_completion``)."""
    metrics_text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 0.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",prefix_caching_hash_algo="sha256"} 1.0\n'
    )
    # nginx double-quoted strings understand \" and \n escapes.
    metrics = metrics_text.replace('"', '\\"').replace("\n", "\\n")
    locations = [
        ("/health", "text/plain", "''"),
        ("/v1/models", "application/json", _nginx_string(_fake_models())),
        ("/server_info", "application/json", _nginx_string(_fake_server_info())),
        ("/metrics", "text/plain", f'"{metrics}"'),
    ]
    body = "\n".join(
        f"        location = {path} {{ default_type {ctype}; return 200 {answer}; }}"
        for path, ctype, answer in locations
    )
    answer = _fixed_completion(tokens)
    if len(answer) < NGINX_MAX_STRING:
        body += (
            "\n        location = /v1/completions { default_type application/json; "
            f"return 200 {_nginx_string(answer)}; }}"
        )
    else:
        # Too long for one config string: served from a file. nginx refuses POST on a static
        # file (405) and error_page answers with the file instead, as GET (an internal redirect).
        (prefix / "completion.json").write_text(answer)
        body += (
            "\n        location = /v1/completions { default_type application/json; "
            f"alias {prefix / 'completion.json'}; error_page 405 =200 $uri; }}"
        )
    servers = []
    for port in ports:
        servers.append(
            f"""
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
{body}
        location / {{ default_type application/json; return 200 '{{}}'; }}
    }}"""
        )
    return _nginx_main(prefix, "\n".join(servers))


@contextlib.contextmanager
def nginx_backend(
    nginx: str, prefix: Path, log_path: Path, tokens: int | None = None
) -> Iterator[tuple[ManagedProcess, list[int]]]:
    """The benchmarks' backend for the block: one nginx serving two fake replicas
    (``backend_conf``, ``tokens`` generated ids) from ``prefix``, which it creates; nginx workers
    drop privileges when started as root, so ``prefix``'s parents must be world-readable.
    Yields the process and the two ports, both answering."""
    ports = [free_port(), free_port()]
    prefix.mkdir()
    (prefix / "nginx.conf").write_text(backend_conf(prefix, ports, tokens))
    argv = [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"]
    with managed("backend-nginx", argv, log_path) as proc:
        for port in ports:
            wait_http(f"http://127.0.0.1:{port}/health", 10, proc=proc)
        yield proc, ports


def passthrough_conf(prefix: Path, port: int, backends: Sequence[int]) -> str:
    upstream = "\n".join(f"        server 127.0.0.1:{p};" for p in backends)
    server = f"""
    upstream replicas {{
{upstream}
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}"""
    return _nginx_main(prefix, server)


def _nginx_main(prefix: Path, servers: str) -> str:
    # One worker: the machine has 2 cores shared by wrk, the backend and the target; a single
    # worker keeps the backend from taking both.
    return f"""
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    client_body_buffer_size 64k;
{servers}
}}
"""


# Bodies: one JSON document per line of {body_path}, cycled; requests are formatted once.
WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local prepared = {{}}
local next_one = 0
init = function(args)
  for line in io.lines("{body_path}") do
    if #line > 0 then prepared[#prepared + 1] = wrk.format(nil, nil, nil, line) end
  end
end
request = function()
  next_one = next_one % #prepared + 1
  return prepared[next_one]
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"errors\\":%d,"
    .. "\\"p50_us\\":%d,\\"p99_us\\":%d}}\\n",
    summary.requests, summary.duration,
    e.status + e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def run_wrk(
    wrk: str, url: str, script: Path, connections: int, duration_s: float, threads: int = 1
) -> WrkResult:
    argv = [
        wrk,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url + "/v1/completions",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60)
    m = re.search(r"^WRKJSON (\{.*\})$", out.stdout, re.M)
    if m is None:
        raise RuntimeError(f"wrk printed no summary: {out.stdout[-500:]} {out.stderr[-500:]}")
    data = json.loads(m.group(1))
    return WrkResult(
        data["requests"], data["duration_us"] / 1e6, data["errors"], data["p50_us"], data["p99_us"]
    )


# --------------------------------------------------------------------------------------------


def _launch(
    target: Target,
    backend_ports: Sequence[int],
    tmp: Path,
    log_dir: Path,
    stack: contextlib.ExitStack,
) -> tuple[str, ManagedProcess | None]:
    """Start ``target`` in front of the backends; returns its URL and process (None: direct)."""
    urls = [f"http://127.0.0.1:{p}" for p in backend_ports]
    if target.kind == "direct":
        return urls[0], None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"overhead-{target.name}.log"
    if target.kind == "proxy":
        python = [sys.executable]
        if target.tree is not None:
            # -P: the other checkout's proxy, not this working directory's proxy/
            python = [str(target.tree / ".venv" / "bin" / "python"), "-P"]
        argv = [*python, "-m", target.module, "--replicas", ",".join(urls), "--port", str(port)]
        proc = stack.enter_context(managed(target.name, argv, log, target.env))
    elif target.kind in ("vllm-router", "sglang-router"):
        exe = find_tool(target.kind)
        assert exe is not None
        argv = rust_router_argv(target.kind, exe, urls, port)
        proc = stack.enter_context(managed(target.name, argv, log))
    elif target.kind == "py-floor":
        argv = [
            sys.executable,
            "-m",
            "bench.harness.passthrough",
            "--port",
            str(port),
            "--backends",
            ",".join(urls),
            *target.args,
        ]
        proc = stack.enter_context(managed(target.name, argv, log))
    elif target.kind == "nginx":
        exe = find_tool("nginx")
        assert exe is not None
        prefix = tmp / "passthrough"
        prefix.mkdir()
        conf = prefix / "nginx.conf"
        conf.write_text(passthrough_conf(prefix, port, backend_ports))
        argv = [exe, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"]
        proc = stack.enter_context(managed(target.name, argv, log))
    else:
        raise ValueError(f"unknown target kind {target.kind!r}")
    body = json.dumps(completion_request(target.text_prompt)).encode()
    wait_http(url + "/v1/completions", 60, proc=proc, method="POST", body=body)
    return url, proc


@dataclass
class Running:
    """A started target: its URL, process (None: direct) and one wrk script per workload."""

    target: Target
    url: str
    proc: ManagedProcess | None
    scripts: dict[str, Path]


def start_targets(
    names: Sequence[str],
    body_kinds: Sequence[str],
    backend_ports: Sequence[int],
    tmp: Path,
    log_dir: Path,
    stack: contextlib.ExitStack,
) -> tuple[dict[str, Running], dict[tuple[str, str], Measurement]]:
    """Start every target up front (idle ones cost nothing), so that runs can interleave."""
    running: dict[str, Running] = {}
    rows: dict[tuple[str, str], Measurement] = {}
    for name in names:
        spec = target(name)
        for kind in body_kinds:
            rows[(name, kind)] = Measurement(name, kind, spec.description)
        reason = spec.unavailable()
        if reason is None:
            try:
                url, proc = _launch(spec, backend_ports, tmp, log_dir, stack)
            except Exception as exc:  # keep measuring the others
                reason = f"did not start: {exc}"
        if reason is not None:
            for kind in body_kinds:
                rows[(name, kind)].status = "skipped" if "not found" in reason else "failed"
                rows[(name, kind)].reason = reason
            continue
        scripts = {}
        for kind in body_kinds:
            body_path = tmp / f"body-{name}-{kind}.jsonl"
            body_path.write_text("\n".join(bodies(kind, spec.text_prompt)) + "\n")
            script = tmp / f"wrk-{name}-{kind}.lua"
            script.write_text(WRK_LUA.format(body_path=body_path))
            scripts[kind] = script
        running[name] = Running(spec, url, proc, scripts)
    return running, rows


def run_round(
    run: Running,
    kind: str,
    m: Measurement,
    backend_proc: ManagedProcess,
    wrk: str,
    duration_s: float,
    latency_s: float,
    connections: Sequence[int] = DEFAULT_CONNECTIONS,
) -> None:
    """One round for one target and workload: each loaded run (rps, CPU per request; 64
    connections by default), then 1 connection (latency)."""
    watched = run.proc if run.proc is not None else backend_proc
    script = run.scripts[kind]
    for c in connections:
        cpu0 = watched.cpu_seconds()
        loaded = run_wrk(wrk, run.url, script, c, duration_s)
        cpu1 = watched.cpu_seconds()
        m.errors += loaded.errors
        m.requests += loaded.requests
        m.add(f"rps@{c}", loaded.rps)
        cpu = (cpu1 - cpu0) / loaded.requests * 1e6 if loaded.requests else math.nan
        m.add(f"cpu_us_per_req@{c}", cpu)
        if c == 64:
            m.add("rps_64", loaded.rps)
            m.add("cpu_us_per_req", cpu)
    cpu1 = watched.cpu_seconds()
    r1 = run_wrk(wrk, run.url, script, 1, latency_s)
    cpu2 = watched.cpu_seconds()
    if r1.requests:
        m.add("cpu_1_us_per_req", (cpu2 - cpu1) / r1.requests * 1e6)
    m.errors += r1.errors
    m.requests += r1.requests
    m.add("p50_1_us", r1.p50_us)
    m.add("p99_1_us", r1.p99_us)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def against_targets(
    rows: Sequence[Measurement], kind: str, connections: Sequence[int] = DEFAULT_CONNECTIONS
) -> list[str]:
    """The bar for one workload (at the first connection count; the others reported beside
    it), as report lines."""
    by = {r.target: r for r in rows if r.body == kind and r.status == "ok"}
    ours, vr, direct = by.get("proxy"), by.get("vllm-router"), by.get("direct")
    lines: list[str] = []
    if ours is None or vr is None:
        return ["- needs both `proxy` and `vllm-router` rows\n"]
    for i, c in enumerate(connections):
        cpu, vr_cpu = ours.at(c, "cpu_us_per_req"), vr.at(c, "cpu_us_per_req")
        rps, vr_rps = ours.at(c, "rps"), vr.at(c, "rps")
        cpu_ratio, rps_ratio = _ratio(cpu, vr_cpu), _ratio(rps, vr_rps)
        line = (
            f"- {c} connections: CPU per request proxy {fmt(cpu, 0)} us vs vllm-router "
            f"{fmt(vr_cpu, 0)} us = {fmt(cpu_ratio, 2)}x; requests/s {fmt(rps, 0)} vs "
            f"{fmt(vr_rps, 0)} = {fmt(rps_ratio, 2)}x"
        )
        if i == 0:
            line += (
                f" (the bar: CPU <= {TARGET_CPU_RATIO}x {_verdict(cpu_ratio <= TARGET_CPU_RATIO)}"
                f", requests/s >= {TARGET_RPS_RATIO}x {_verdict(rps_ratio >= TARGET_RPS_RATIO)})"
            )
        # The same ratios taken within each round (bench/analysis/paired.py says why).
        cpu_rounds = round_ratios(
            ours.samples.get(f"cpu_us_per_req@{c}", []), vr.samples.get(f"cpu_us_per_req@{c}", [])
        )
        rps_rounds = round_ratios(ours.samples.get(f"rps@{c}", []), vr.samples.get(f"rps@{c}", []))
        if cpu_rounds and rps_rounds:
            line += (
                f"; paired by round: CPU {fmt(statistics.median(cpu_rounds), 2)}x "
                f"({fmt(min(cpu_rounds), 2)}-{fmt(max(cpu_rounds), 2)}), requests/s "
                f"{fmt(statistics.median(rps_rounds), 2)}x "
                f"({fmt(min(rps_rounds), 2)}-{fmt(max(rps_rounds), 2)})"
            )
        lines.append(line + "\n")
    if direct is not None:
        ours_add = ours.p50_1_us - direct.p50_1_us
        vr_add = vr.p50_1_us - direct.p50_1_us
        lines.append(
            f"- added p50 at 1 connection: proxy {fmt(ours_add, 0)} us vs vllm-router "
            f"{fmt(vr_add, 0)} us\n"
        )
    floor = by.get("floor")
    if floor is not None:
        lines.append(
            f"- the lean Python floor (bare uvicorn + the lean client, no routing): "
            f"{fmt(floor.cpu_us_per_req, 0)} us CPU/request; rollout-proxy spends "
            f"{fmt(ours.cpu_us_per_req - floor.cpu_us_per_req, 0)} us/request above it "
            "(overhead_profile.md says where)\n"
        )
    return lines


def loaded_table(
    rows: Sequence[Measurement], vr: Measurement | None, connections: Sequence[int]
) -> str:
    """Each target's loaded runs, one row per connection count, with ratios to vllm-router."""
    headers = ["target", "connections", "rps", "rps / vllm-router", "CPU / request (us)"]
    headers.append("CPU / vllm-router")
    out = []
    for r in rows:
        for c in connections:
            rps, cpu = r.at(c, "rps"), r.at(c, "cpu_us_per_req")
            vr_rps = vr.at(c, "rps") if vr else math.nan
            vr_cpu = vr.at(c, "cpu_us_per_req") if vr else math.nan
            out.append(
                [r.target, str(c), fmt(rps, 0), fmt(_ratio(rps, vr_rps), 2), fmt(cpu, 0)]
                + [fmt(_ratio(cpu, vr_cpu), 2)]
            )
    return table(headers, out)


def write_report(
    rows: Sequence[Measurement],
    out: Path,
    command: str,
    duration_s: float,
    latency_s: float,
    repeats: int,
    connections: Sequence[int] = DEFAULT_CONNECTIONS,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    headers = [
        "target",
        "rps @64",
        "rps / vllm-router",
        "p50 @1 (us)",
        "p99 @1 (us)",
        "added p50 @1 (us)",
        "CPU / request (us)",
        "CPU / vllm-router",
        "CPU / request @1 (us)",
        "errors",
        "what",
    ]
    md = ["# Proxy overhead: rollout-proxy vs the alternatives\n\n"]
    md.append(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}`. "
        f"Machine: {machine['nproc']} cores ({machine['cpu']}), {machine['memory']}, shared with "
        f"other jobs. Every target ran in each of {repeats} interleaved rounds ({duration_s:.0f} s "
        f"at {' and '.join(map(str, connections))} connections, {latency_s:.0f} s at 1); each "
        "figure is the median of its rounds. "
        "wrk (1 thread), the backend nginx (1 worker) and the target share the cores, so "
        "absolute figures are this machine's; compare ratios.\n"
    )
    kinds = [k for k in BODIES if any(r.body == k for r in rows)]
    for kind in kinds:
        these = [r for r in rows if r.body == kind]
        direct = next((r for r in these if r.target == "direct" and r.status == "ok"), None)
        vr = next((r for r in these if r.target == "vllm-router" and r.status == "ok"), None)
        table_rows = []
        for r in these:
            if r.status != "ok":
                table_rows.append([r.target, f"{r.status}: {r.reason}"] + ["-"] * 9)
                continue
            add50 = r.p50_1_us - direct.p50_1_us if direct and r.target != "direct" else math.nan
            table_rows.append(
                [
                    r.target,
                    fmt(r.rps_64, 0),
                    fmt(_ratio(r.rps_64, vr.rps_64) if vr else math.nan, 2),
                    fmt(r.p50_1_us, 0),
                    fmt(r.p99_1_us, 0),
                    fmt(add50, 0),
                    fmt(r.cpu_us_per_req, 0),
                    fmt(_ratio(r.cpu_us_per_req, vr.cpu_us_per_req) if vr else math.nan, 2),
                    fmt(r.cpu_1_us_per_req, 0),
                    f"{r.errors}/{r.requests}",
                    r.description,
                ]
            )
        title = (
            "one body repeated"
            if kind == "repeated"
            else f"{DISTINCT_PROMPTS} distinct prompts cycled"
        )
        md.append(f"\n## Workload `{kind}`: {title}\n\n")
        md.append(table(headers, table_rows))
        md.append("\nLoaded runs at each connection count:\n\n")
        md.append(loaded_table([r for r in these if r.status == "ok"], vr, connections))
        md.append("\nAgainst the bar:\n\n")
        md.extend(against_targets(rows, kind, connections))
    md.append("\n## Method\n\n")
    md.append(
        f"- Bodies: TRL's rollout request with a {PROMPT_TOKENS}-token token-id prompt; "
        f"`repeated` sends one body, `distinct64` cycles {DISTINCT_PROMPTS} distinct prompts "
        "(sglang-router gets the same ids as one string: it answers 422 to token-id prompts). "
        f"Answer: a fixed {COMPLETION_TOKENS}-token completion with logprobs from nginx "
        "(`return 200`, or a file when longer than a config string).\n"
        f"- requests/s: wrk -t1 -c{'/'.join(map(str, connections))}; latency: wrk -t1 -c1 (wrk's "
        "own percentiles). Added latency "
        "= target minus direct at the same percentile.\n"
        "- CPU / request: utime+stime of the target's whole process tree (/proc/<pid>/stat, all "
        "threads and children) across each loaded run, divided by the requests wrk "
        "completed. For direct it is the backend nginx's. CPU / request @1: the same across "
        "the 1-connection run, where each request waits for all of it.\n"
        "- Every figure comes from this one run; failures (non-2xx) are counted in errors.\n"
    )
    name = "overhead"
    if COMPLETION_TOKENS != DEFAULT_COMPLETION_TOKENS:
        name = f"overhead_completion{COMPLETION_TOKENS}"
    (out / f"{name}.md").write_text("".join(md))
    raw = {
        "machine": machine,
        "command": command,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    return out / f"{name}.md"


def measure_all(
    names: Sequence[str],
    body_kinds: Sequence[str],
    wrk: str,
    nginx: str,
    log_dir: Path,
    duration_s: float,
    latency_s: float,
    repeats: int,
    connections: Sequence[int] = DEFAULT_CONNECTIONS,
) -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o755)  # nginx workers drop privileges when started as root
        with (
            nginx_backend(nginx, tmp / "backend", log_dir / "overhead-backend.log") as (
                backend,
                backend_ports,
            ),
            contextlib.ExitStack() as stack,
        ):
            running, rows = start_targets(names, body_kinds, backend_ports, tmp, log_dir, stack)
            for kind in body_kinds:
                for run in running.values():  # warm-up: connections, pools, caches
                    with contextlib.suppress(Exception):
                        run_wrk(wrk, run.url, run.scripts[kind], 8, 1)
                for round_no in range(1, repeats + 1):
                    for name, run in running.items():
                        m = rows[(name, kind)]
                        if m.status != "ok":
                            continue
                        try:
                            run_round(
                                run, kind, m, backend, wrk, duration_s, latency_s, connections
                            )
                        except Exception as exc:
                            m.status, m.reason = "failed", str(exc)
                        last = {k: v[-1] for k, v in m.samples.items() if v}
                        print(
                            f"{kind:>10} round {round_no} {name:>14}: "
                            + "".join(
                                f"rps@{c} {fmt(last.get(f'rps@{c}', math.nan), 0):>7} "
                                f"cpu/req@{c} "
                                f"{fmt(last.get(f'cpu_us_per_req@{c}', math.nan), 0):>5} us "
                                for c in connections
                            )
                            + f"p50@1 {fmt(last.get('p50_1_us', math.nan), 0):>6} us "
                            f"@1 {fmt(last.get('cpu_1_us_per_req', math.nan), 0):>5} us"
                            + (f" [{m.reason[:200]}]" if m.reason else ""),
                            flush=True,
                        )
            for name, run in running.items():
                if run.proc is not None and not run.proc.alive():
                    for kind in body_kinds:
                        rows[(name, kind)].status = "failed"
                        rows[(name, kind)].reason = f"exited during the run; {run.proc.tail()}"
    for m in rows.values():
        m.settle()
        if m.errors and m.status == "ok":
            m.reason = f"{m.errors} of {m.requests} requests failed (non-2xx or socket errors)"
    return [rows[(n, k)] for k in body_kinds for n in names]


def main(argv: Sequence[str] | None = None) -> int:
    global COMPLETION_TOKENS
    p = argparse.ArgumentParser(prog="python -m bench.runners.run_overhead", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="1-second runs, seconds in all")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help=f"from {list(TARGETS)}")
    p.add_argument("--bodies", default=",".join(BODIES), help=f"from {list(BODIES)}")
    p.add_argument("--duration", type=float, default=None, help="seconds per loaded run (5)")
    p.add_argument(
        "--connections",
        default=",".join(map(str, DEFAULT_CONNECTIONS)),
        help="connection counts of the loaded runs, the bar checked at the first (64)",
    )
    p.add_argument("--latency", type=float, default=None, help="seconds per 1-conn run (3)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds, median (3)")
    p.add_argument(
        "--completion-tokens",
        type=int,
        default=COMPLETION_TOKENS,
        help=f"generated ids in the backend's answer ({COMPLETION_TOKENS}; the recipe's rollouts "
        "have ~600, each learned by the proxy and relayed with its logprobs)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.completion_tokens < 1:
        p.error("--completion-tokens: a positive integer")
    COMPLETION_TOKENS = args.completion_tokens  # read by the answer, the bodies and the report
    names = [x for x in args.targets.split(",") if x]
    unknown = []
    for n in names:
        try:
            target(n)
        except KeyError:
            unknown.append(n)
    if unknown:
        p.error(
            f"unknown target(s) {unknown}; known: {list(TARGETS)} and proxy@LABEL for each "
            "BENCH_TREES=LABEL=PATH"
        )
    kinds = [x for x in args.bodies.split(",") if x]
    if not kinds or any(k not in BODIES for k in kinds):
        p.error(f"--bodies: one or more of {list(BODIES)}")
    try:
        connections = [int(x) for x in args.connections.split(",") if x]
    except ValueError:
        connections = []
    if not connections or any(c < 1 for c in connections):
        p.error("--connections: one or more positive integers, comma-separated")
    duration = args.duration or (1.0 if args.smoke else 5.0)
    latency = args.latency or (1.0 if args.smoke else 3.0)
    repeats = args.repeats or (1 if args.smoke else 3)
    wrk, nginx = find_tool("wrk"), find_tool("nginx")
    if wrk is None or nginx is None:
        print("run_overhead needs wrk and nginx (apt-get install -y nginx wrk)", file=sys.stderr)
        return 2
    log_dir = args.out / "tmp" / "logs"  # bench/results/tmp/ is git-ignored
    rows = measure_all(names, kinds, wrk, nginx, log_dir, duration, latency, repeats, connections)
    command = "python -m bench.runners.run_overhead " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    path = write_report(rows, args.out, command.strip(), duration, latency, repeats, connections)
    print(f"wrote {path}")
    return 0 if any(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
