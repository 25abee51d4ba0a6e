"""Where the proxy's CPU goes per routed request: py-spy samples of rollout-proxy under wrk load
in front of the fake nginx backends of ``run_overhead``.

    python -m bench.runners.profile_proxy                    # -> bench/results/overhead_profile.md
    python -m bench.runners.profile_proxy --env PROXY_LOG_LEVEL=warning --out /tmp/p

The collapsed stacks are kept in ``<out>/tmp/logs/overhead_profile.raw``. Needs nginx, wrk and
py-spy (``.venv-bench/bin/pip install py-spy``). py-spy pauses the process to
sample it (100 Hz), so throughput under profiling is a little lower than in run_overhead; the
shares are what matter.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from bench.analysis.report import table
from bench.harness.procs import REPO, find_tool, managed, wait_http
from bench.runners import run_overhead
from bench.runners.run_overhead import BODIES, WRK_LUA, bodies, nginx_backend
from fakes.net import free_port

DEFAULT_OUT = REPO / "bench" / "results"
# Text above this line in an existing report is kept when the profile is re-run (the per-request
# accounting written from other measurements, which a profile alone cannot give).
KEEP_ABOVE = "<!-- bench.profile_proxy: the profile below is regenerated, the text above kept -->"

# Inclusive-time buckets, first match wins (checked against every frame of a stack).
BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # With --native: C frames. A socket syscall or a collection is where the sample was, whoever
    # called it (on loopback a send also runs the receiver's TCP stack, in the sender's context).
    ("socket write/read syscalls (libc, with --native)", ("write (libc", "read (libc")),
    ("cyclic garbage collector (with --native)", ("gc_collect",)),
    ("logging (log records, formatting, stream writes)", ("logging/",)),
    ("prometheus_client (metrics updates)", ("prometheus_client/",)),
    ("httpx / httpx-aiohttp / aiohttp client (upstream call)", ("httpx", "aiohttp/client")),
    ("lean upstream client (proxy/pool.py)", ("proxy/pool",)),
    ("JSON / body handling in proxy.core.extract", ("proxy/core/extract", "json/", "orjson")),
    ("hashing + prefix index + policy (proxy.core)", ("proxy/core/",)),
    ("FastAPI / Starlette request handling", ("fastapi/", "starlette/")),
    (
        "data path: guard, parse, retry loop, answer (hotpath, dataplane, security)",
        ("proxy/front", "proxy/hotpath", "proxy/dataplane", "proxy/security", "proxy/relay"),
    ),
    ("uvicorn HTTP server (httptools protocol)", ("uvicorn/",)),
    ("asyncio event loop and socket transports", ("asyncio/",)),
)


def parse_raw(text: str) -> tuple[Counter[str], Counter[str], int]:
    """(self samples by leaf frame, inclusive samples by frame, total samples)."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return self_c, incl, total


def buckets(text: str) -> tuple[Counter[str], int]:
    out: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        # The innermost bucket on the stack owns the sample (logging inside a handler is logging).
        label = "other (asyncio loop, GC, interpreter)"
        for frame in reversed(stack.split(";")):
            hit = next((b for b, keys in BUCKETS if any(k in frame for k in keys)), None)
            if hit is not None:
                label = hit
                break
        out[label] += n
    return out, total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.runners.profile_proxy", description=__doc__)
    p.add_argument("--duration", type=int, default=15, help="seconds sampled (15)")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the proxy")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--native", action="store_true", help="sample C frames too (syscalls, GC, orjson)"
    )
    p.add_argument("--body", choices=BODIES, default="distinct64", help="workload (distinct64)")
    p.add_argument(
        "--lines", action="store_true", help="keep line numbers (functions split by line)"
    )
    p.add_argument(
        "--completion-tokens",
        type=int,
        default=run_overhead.DEFAULT_COMPLETION_TOKENS,
        help="generated ids in the backend's answer (run_overhead's option)",
    )
    args = p.parse_args(argv)
    run_overhead.COMPLETION_TOKENS = args.completion_tokens  # backend_conf's answer
    tools = {t: find_tool(t) for t in ("nginx", "wrk", "py-spy")}
    missing = [t for t, path in tools.items() if path is None]
    if missing:
        print(f"profile_proxy needs {', '.join(missing)}", file=sys.stderr)
        return 2
    env = dict(kv.split("=", 1) for kv in args.env)
    log_dir = args.out / "tmp" / "logs"  # bench/results/tmp/ is git-ignored
    with (
        tempfile.TemporaryDirectory(prefix="rollout-prof-") as tmp_name,
        contextlib.ExitStack() as st,
    ):
        tmp = Path(tmp_name)
        tmp.chmod(0o755)
        _, ports = st.enter_context(
            nginx_backend(str(tools["nginx"]), tmp / "backend", log_dir / "prof-backend.log")
        )
        port = free_port()
        urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
        argv_proxy = [sys.executable, "-m", "proxy", "--replicas", urls, "--port", str(port)]
        proxy = st.enter_context(managed("proxy", argv_proxy, log_dir / "prof-proxy.log", env))
        url = f"http://127.0.0.1:{port}"
        lines = bodies(args.body, text_prompt=False)
        wait_http(url + "/v1/completions", 60, proc=proxy, method="POST", body=lines[0].encode())
        (tmp / "body.jsonl").write_text("\n".join(lines) + "\n")
        script = tmp / "wrk.lua"
        script.write_text(WRK_LUA.format(body_path=tmp / "body.jsonl"))
        wrk_argv = [str(tools["wrk"]), "-t1", "-c64", f"-d{args.duration + 3}s", "--timeout", "10s"]
        wrk_argv += ["-s", str(script)]
        load = subprocess.Popen(
            [*wrk_argv, url + "/v1/completions"], stdout=subprocess.PIPE, text=True
        )
        try:
            time.sleep(1.5)  # let the load settle before sampling
            raw = tmp / "proxy.raw"
            spy = [
                str(tools["py-spy"]),
                "record",
                "-p",
                str(proxy.pid),
                "-d",
                str(args.duration),
                "-f",
                "raw",
                *([] if args.lines else ["--nolineno"]),
                *(["--native"] if args.native else []),
                "-o",
                str(raw),
            ]
            subprocess.run(spy, check=True, capture_output=True, timeout=args.duration + 60)
            wrk_out, _ = load.communicate(timeout=args.duration + 60)
        finally:
            if load.poll() is None:
                load.kill()
        text = raw.read_text()
    # Keep the collapsed stacks (flamegraph.pl / speedscope input) next to the logs.
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "overhead_profile.raw").write_text(text)
    self_c, incl, total = parse_raw(text)
    bucket_c, _ = buckets(text)
    summary = wrk_out.strip().splitlines()[-1] if wrk_out.strip() else ""
    md = ["# Where rollout-proxy's CPU goes (py-spy, wrk -c64)\n\n"]
    md.append(
        f"`python -m bench.runners.profile_proxy "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"proxy env {env or '{}'}; workload `{args.body}`, {args.completion_tokens} generated ids "
        f"per answer; {total} samples at 100 Hz over "
        f"{args.duration} s of load "
        f"(idle event-loop waits excluded). wrk: `{summary}`.\n\n"
    )
    md.append("## By component (innermost match on each stack)\n\n")
    md.append(
        table(
            ["component", "share of busy samples"],
            [[k, f"{100 * v / total:.1f}%"] for k, v in bucket_c.most_common()],
        )
    )
    md.append(f"\n## Top {args.top} functions by self time\n\n")
    md.append(
        table(
            ["function (file)", "self", "inclusive"],
            [
                [f"`{k}`", f"{100 * v / total:.1f}%", f"{100 * incl[k] / total:.1f}%"]
                for k, v in self_c.most_common(args.top)
            ],
        )
    )
    md.append(f"\n## Top {args.top} functions by inclusive time\n\n")
    md.append(
        table(
            ["function (file)", "inclusive", "self"],
            [
                [f"`{k}`", f"{100 * v / total:.1f}%", f"{100 * self_c[k] / total:.1f}%"]
                for k, v in incl.most_common(args.top)
            ],
        )
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "overhead_profile" + "".join(f"_{v.lower()}" for v in env.values())
    if args.completion_tokens != run_overhead.DEFAULT_COMPLETION_TOKENS:
        name += f"_completion{args.completion_tokens}"
    name += ".md"
    path = args.out / name
    kept = ""
    if path.exists() and KEEP_ABOVE in (previous := path.read_text()):
        kept = previous.split(KEEP_ABOVE, 1)[0] + KEEP_ABOVE + "\n\n"
    path.write_text(kept + "".join(md))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
