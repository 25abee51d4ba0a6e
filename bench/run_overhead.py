"""Proxy overhead: requests/s, added latency and CPU per request of each router in front of fast
fake backends, all in one run.

    python -m bench.run_overhead                  # -> bench/results/overhead.md
    python -m bench.run_overhead --smoke --out /tmp/o

Backends: one nginx serving two fake vLLM replicas (fixed /v1/completions answer, /health,
/v1/models, /server_info, /metrics) on 127.0.0.1. Load: wrk (its own process) posting a TRL-shaped
body with a 512-token token-id prompt. For each target: requests/s at 64 connections, p50/p99
latency at 8 connections (added = minus the direct figure), and the target's CPU time per request
(utime+stime of its process tree from /proc, over the 64-connection run, divided by requests).

Targets: direct (wrk -> backend), rollout-proxy (aiohttp transport, the default, and httpx's own
transport), vllm-router, sglang-router, nginx as a pass-through proxy (the floor for any proxy
process), and a bare uvicorn + aiohttp pass-through (the floor for a Python one).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import (
    REPO,
    ManagedProcess,
    find_tool,
    free_port,
    machine_description,
    managed,
    wait_http,
)
from bench.report import fmt, table
from bench.routers import rust_router_argv

DEFAULT_OUT = REPO / "bench" / "results"
MODEL = "Qwen/Qwen2.5-Math-1.5B"
PROMPT_TOKENS = 512
# Completion answered by the fake backends: 16 tokens with logprobs, the shape TRL reads. Small on
# purpose: the benchmark isolates per-request overhead from body size.
COMPLETION_TOKENS = 16

# Targets from the issue.
TARGET_CPU_US = 120.0


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    kind: str  # direct | proxy | vllm-router | sglang-router | nginx
    env: dict[str, str] = field(default_factory=dict)
    text_prompt: bool = False

    def unavailable(self) -> str | None:
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
            "rollout-proxy, defaults (PROXY_UPSTREAM_TRANSPORT=aiohttp)",
            "proxy",
            {"PROXY_UPSTREAM_TRANSPORT": "aiohttp"},
        ),
        Target(
            "proxy-httpx",
            "rollout-proxy, PROXY_UPSTREAM_TRANSPORT=httpx",
            "proxy",
            {"PROXY_UPSTREAM_TRANSPORT": "httpx"},
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
            "py-floor",
            "bare ASGI app on uvicorn + one aiohttp session, round robin (bench/passthrough.py)",
            "py-floor",
        ),
    )
}


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
    description: str
    status: str = "ok"
    reason: str = ""
    rps_64: float = math.nan
    p50_8_us: float = math.nan
    p99_8_us: float = math.nan
    cpu_us_per_req: float = math.nan
    errors: int = 0
    requests: int = 0


# --------------------------------------------------------------------------------------------
# Payloads and configs.


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


def _fixed_completion() -> str:
    ids = list(range(1000, 1000 + COMPLETION_TOKENS))
    toks = [f"token_id:{t}" for t in ids]
    body = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": "x" * COMPLETION_TOKENS,
                "logprobs": {
                    "text_offset": list(range(COMPLETION_TOKENS)),
                    "token_logprobs": [-0.5] * COMPLETION_TOKENS,
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
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
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


def _nginx_string(s: str) -> str:
    if "'" in s or "$" in s or "\\" in s:
        raise ValueError("fixed answers must not contain quotes, $ or backslashes for nginx")
    return f"'{s}'"


def backend_conf(prefix: Path, ports: Sequence[int]) -> str:
    """nginx config: each port is a fake vLLM replica answering instantly."""
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
        ("/v1/completions", "application/json", _nginx_string(_fixed_completion())),
    ]
    body = "\n".join(
        f"        location = {path} {{ default_type {ctype}; return 200 {answer}; }}"
        for path, ctype, answer in locations
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


WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = io.open("{body_path}"):read("*a")
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
        argv = [sys.executable, "-m", "proxy", "--replicas", ",".join(urls), "--port", str(port)]
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
            "bench.passthrough",
            "--port",
            str(port),
            "--backends",
            ",".join(urls),
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


def measure(
    target: Target,
    backend_ports: Sequence[int],
    backend_proc: ManagedProcess,
    wrk: str,
    tmp: Path,
    log_dir: Path,
    duration_s: float,
    repeats: int,
) -> Measurement:
    m = Measurement(target.name, target.description)
    reason = target.unavailable()
    if reason is not None:
        m.status, m.reason = "skipped", reason
        return m
    body_path = tmp / f"body-{target.name}.json"
    body_path.write_text(json.dumps(completion_request(target.text_prompt)))
    script = tmp / f"wrk-{target.name}.lua"
    script.write_text(WRK_LUA.format(body_path=body_path))
    with contextlib.ExitStack() as stack:
        url, proc = _launch(target, backend_ports, tmp, log_dir, stack)
        watched = proc if proc is not None else backend_proc
        run_wrk(wrk, url, script, 8, 1)  # warm-up: connections, JIT-less caches, pools
        best_rps: WrkResult | None = None
        best_cpu = math.inf
        best_lat: WrkResult | None = None
        for _ in range(repeats):
            cpu0 = watched.cpu_seconds()
            r64 = run_wrk(wrk, url, script, 64, duration_s)
            cpu1 = watched.cpu_seconds()
            m.errors += r64.errors
            m.requests += r64.requests
            if r64.requests:
                best_cpu = min(best_cpu, (cpu1 - cpu0) / r64.requests * 1e6)
            if best_rps is None or r64.rps > best_rps.rps:
                best_rps = r64
            r8 = run_wrk(wrk, url, script, 8, duration_s)
            m.errors += r8.errors
            m.requests += r8.requests
            if best_lat is None or r8.p50_us < best_lat.p50_us:
                best_lat = r8
        if proc is not None and not proc.alive():
            m.status, m.reason = "failed", f"exited during the run; {proc.tail()}"
    assert best_rps is not None and best_lat is not None
    m.rps_64 = best_rps.rps
    m.p50_8_us = best_lat.p50_us
    m.p99_8_us = best_lat.p99_us
    m.cpu_us_per_req = best_cpu
    if m.errors:
        m.reason = f"{m.errors} of {m.requests} requests failed (non-2xx or socket errors)"
    return m


def write_report(
    rows: Sequence[Measurement], out: Path, command: str, duration_s: float, repeats: int
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    direct = next((r for r in rows if r.target == "direct" and r.status == "ok"), None)
    headers = [
        "target",
        "rps @64",
        "rps / direct",
        "p50 @8 (us)",
        "p99 @8 (us)",
        "added p50 (us)",
        "added p99 (us)",
        "CPU / request (us)",
        "errors",
        "what",
    ]
    table_rows = []
    for r in rows:
        if r.status == "skipped":
            table_rows.append([r.target, "skipped: " + r.reason] + ["-"] * 8)
            continue
        ratio = r.rps_64 / direct.rps_64 if direct else math.nan
        add50 = r.p50_8_us - direct.p50_8_us if direct and r.target != "direct" else math.nan
        add99 = r.p99_8_us - direct.p99_8_us if direct and r.target != "direct" else math.nan
        table_rows.append(
            [
                r.target,
                fmt(r.rps_64, 0),
                fmt(ratio, 3),
                fmt(r.p50_8_us, 0),
                fmt(r.p99_8_us, 0),
                fmt(add50, 0),
                fmt(add99, 0),
                fmt(r.cpu_us_per_req, 0),
                f"{r.errors}/{r.requests}",
                r.description,
            ]
        )
    md = ["# Proxy overhead: rollout-proxy vs the alternatives\n\n"]
    md.append(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}`. "
        f"Machine: {machine['nproc']} cores ({machine['cpu']}), {machine['memory']}, shared with "
        "other jobs (best of "
        f"{repeats} runs of {duration_s:.0f} s per figure). wrk (1 thread), the backend nginx "
        "(1 worker) and the target share the cores, so absolute figures are this machine's; "
        "compare ratios.\n\n"
    )
    md.append(table(headers, table_rows))
    ours = next((r for r in rows if r.target == "proxy" and r.status == "ok"), None)
    vr = next((r for r in rows if r.target == "vllm-router" and r.status == "ok"), None)
    md.append("\n## Against the targets\n\n")
    if ours is not None:
        md.append(
            f"- proxy CPU per routed request: {fmt(ours.cpu_us_per_req, 0)} us (target <= "
            f"{TARGET_CPU_US:.0f}: {'met' if ours.cpu_us_per_req <= TARGET_CPU_US else 'MISSED'})\n"
        )
        if vr is not None:
            md.append(
                f"- requests/s at 64 connections: proxy {fmt(ours.rps_64, 0)} vs vllm-router "
                f"{fmt(vr.rps_64, 0)} (target >= vllm-router: "
                f"{'met' if ours.rps_64 >= vr.rps_64 else 'MISSED'})\n"
            )
    floor = next((r for r in rows if r.target == "py-floor" and r.status == "ok"), None)
    if ours is not None and floor is not None:
        md.append(
            "- the Python floor (bare uvicorn + aiohttp, no routing): "
            f"{fmt(floor.cpu_us_per_req, 0)} us CPU/request, {fmt(floor.rps_64, 0)} rps; "
            "rollout-proxy spends "
            f"{fmt(ours.cpu_us_per_req - floor.cpu_us_per_req, 0)} us/request above it "
            "(see overhead_profile.md for where)\n"
        )
    httpx_row = next((r for r in rows if r.target == "proxy-httpx" and r.status == "ok"), None)
    if ours is not None and httpx_row is not None:
        md.append(
            f"- upstream transport: aiohttp (httpx-aiohttp) {fmt(ours.rps_64, 0)} rps, "
            f"{fmt(ours.cpu_us_per_req, 0)} us CPU/request; httpx's own "
            f"{fmt(httpx_row.rps_64, 0)} rps, {fmt(httpx_row.cpu_us_per_req, 0)} us CPU/request\n"
        )
    md.append("\n## Method\n\n")
    md.append(
        f"- Body: TRL's rollout request with a {PROMPT_TOKENS}-token token-id prompt "
        f"(sglang-router gets the same ids as one string: it answers 422 to token-id prompts). "
        f"Answer: a fixed {COMPLETION_TOKENS}-token completion with logprobs from nginx "
        "`return 200`.\n"
        "- requests/s: wrk -t1 -c64; latency: wrk -t1 -c8 (wrk's own percentiles). Added latency "
        "= target minus direct at the same percentile.\n"
        "- CPU / request: utime+stime of the target's whole process tree (/proc/<pid>/stat, all "
        "threads and children) across the 64-connection run, divided by the requests wrk "
        "completed. For direct it is the backend nginx's.\n"
        "- Every figure comes from this one run; failures (non-2xx) are counted in errors.\n"
    )
    (out / "overhead.md").write_text("".join(md))
    raw = {
        "machine": machine,
        "command": command,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    (out / "overhead.json").write_text(json.dumps(raw, indent=1))
    return out / "overhead.md"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_overhead", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="1-second runs, seconds in all")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"from {list(TARGETS)}")
    p.add_argument("--duration", type=float, default=None, help="seconds per wrk run (5)")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure, best kept (2)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    names = [x for x in args.targets.split(",") if x]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {unknown}; known: {list(TARGETS)}")
    duration = args.duration or (1.0 if args.smoke else 5.0)
    repeats = args.repeats or (1 if args.smoke else 2)
    wrk, nginx = find_tool("wrk"), find_tool("nginx")
    if wrk is None or nginx is None:
        print("run_overhead needs wrk and nginx (apt-get install -y nginx wrk)", file=sys.stderr)
        return 2
    log_dir = args.out / "tmp" / "logs"  # bench/results/tmp/ is git-ignored
    rows: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o755)  # nginx workers drop privileges when started as root
        backend_ports = [free_port(), free_port()]
        prefix = tmp / "backend"
        prefix.mkdir()
        (prefix / "nginx.conf").write_text(backend_conf(prefix, backend_ports))
        argv_backend = [
            nginx,
            "-p",
            str(prefix),
            "-c",
            str(prefix / "nginx.conf"),
            "-g",
            "daemon off;",
        ]
        with managed("backend-nginx", argv_backend, log_dir / "overhead-backend.log") as backend:
            for port in backend_ports:
                wait_http(f"http://127.0.0.1:{port}/health", 10, proc=backend)
            for name in names:
                t0 = time.monotonic()
                try:
                    m = measure(
                        TARGETS[name], backend_ports, backend, wrk, tmp, log_dir, duration, repeats
                    )
                except Exception as exc:  # keep measuring the others
                    m = Measurement(name, TARGETS[name].description, "failed", f"{exc}")
                rows.append(m)
                print(
                    f"{name:>14}: {m.status:7} rps@64 {fmt(m.rps_64, 0):>7} p50@8 "
                    f"{fmt(m.p50_8_us, 0):>6} us p99@8 {fmt(m.p99_8_us, 0):>6} us cpu/req "
                    f"{fmt(m.cpu_us_per_req, 0):>5} us errors {m.errors} "
                    f"({time.monotonic() - t0:.0f} s)"
                    + (f" [{m.reason[:200]}]" if m.reason else ""),
                    flush=True,
                )
    command = "python -m bench.run_overhead " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_report(rows, args.out, command.strip(), duration, repeats)
    print(f"wrote {path}")
    return 0 if any(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
