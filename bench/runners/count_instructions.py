"""Instructions per routed completion, counted by valgrind (callgrind): the same count for the
same code and inputs whatever else the machine runs, where CPU time on a shared machine swings by
1.5x between rounds. It compares trees (a change against its base) and does not replace
bench.runners.run_overhead: it counts user-space instructions, not CPU time (no kernel time, no
cache misses under load).

    python -m bench.runners.count_instructions     # -> bench/results/instructions.md
    BENCH_TREES=base=/path/to/checkout python -m bench.runners.count_instructions --out /tmp/i
    python -m bench.runners.count_instructions --whole-process  # -> instructions_process.md

Each tree runs in its own ``.venv`` (``make setup`` there) the request of
``python -m bench.runners.run_micro --request``: ``DataPath.respond`` on run_overhead's
``distinct64`` bodies, with two ready replicas and an upstream that answers at once. The count is
taken twice, after the same warm-up, with 0 and with ``--requests`` more requests: the difference
divided by ``--requests`` is one request's. The upstream's answer carries ``--completion-tokens``
generated ids (with logprobs, as TRL asks for them): learning a rollout's completion costs per
generated id, which run_overhead's 16-token answer hardly shows.

``--whole-process`` counts whole server processes instead: each tree's ``python -m proxy`` and
vllm-router (when installed), in front of run_overhead's nginx backend, driven over keep-alive
connections with the same bodies. Everything the process runs per request is counted (front,
upstream client, event loop, routing), and vllm-router can be compared too; what no count
includes is the kernel's share (syscalls) and how fast each instruction runs, which differ
between a Python and a Rust process, so the ratio to vllm-router is not its CPU-time ratio
(callgrind also counts a large copy's ``rep movsb`` once per byte).
Instrumentation is switched on after the warm-up (``callgrind_control -i on``) and off after
``--requests`` requests; health probes are set an hour apart, as a per-second cost would be
stretched by valgrind's slowdown into a per-request one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench.analysis.report import table
from bench.harness.procs import REPO, find_tool, machine_description, managed, wait_http
from bench.harness.routers import rust_router_argv, trees
from bench.runners import run_overhead
from fakes.net import free_port

DEFAULT_OUT = REPO / "bench" / "results"
WARM_REQUESTS = 1000  # every distinct64 prompt routed and learned ~15 times
# Whole processes: every distinct64 prompt routed ~10 times, and each connection opened, first.
PROCESS_WARM_REQUESTS = 600
HOUR_S = 3600

# Run inside the measured tree (its own interpreter, its proxy/ and bench/). Checkouts from before
# bench/ was split into harness/ and runners/ keep the same helpers at the top of bench/.
DRIVER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
try:
    from bench.harness import request_micro as micro
    from bench.runners import run_overhead as overhead
except ImportError:
    from bench import request_micro as micro, run_overhead as overhead
warm, n, mode, tokens = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
overhead.COMPLETION_TOKENS = tokens  # the upstream's answer: this many generated ids, logprobs
micro.ANSWER = overhead._fixed_completion().encode()
rt, path = micro._runtime(mode)
raws = [json.dumps(overhead.completion_request(False, s), separators=(",", ":")).encode()
        for s in range(overhead.DISTINCT_PROMPTS)]
scope = {"type": "http", "method": "POST", "path": "/v1/completions",
         "raw_path": b"/v1/completions", "query_string": b"",
         "headers": [(b"host", b"proxy"), (b"content-type", b"application/json")]}
for i in range(warm + n):
    raw = raws[i % len(raws)]
    answer = micro.drive(path.respond("completions", scope, raw, time.perf_counter()))
    if answer.status_code != 200:
        raise SystemExit(f"request failed: {answer.body!r}")
"""

_COLLECTED = re.compile(r"Collected\s*:\s*([\d,]+)")


def count(python: Path, tree: Path, warm: int, requests: int, mode: str, tokens: int) -> int:
    """Instructions the driver runs in ``tree`` with ``requests`` requests after the warm-up."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(python), "-P"]
    argv += ["-c", DRIVER, str(tree), str(warm), str(requests), mode, str(tokens)]
    # One hash seed for every run: string hashes (and so dict layouts) differ between processes
    # otherwise, and the two counts by a few million instructions.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tree, env=env, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{python} in {tree} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_request(
    python: Path, tree: Path, warm: int, requests: int, mode: str, tokens: int
) -> float:
    more = count(python, tree, warm, requests, mode, tokens)
    return (more - count(python, tree, warm, 0, mode, tokens)) / requests


async def _drive(port: int, bodies: Sequence[bytes], total: int, connections: int) -> None:
    """``total`` POSTs of ``bodies`` (in turn) over ``connections`` keep-alive connections; every
    answer must be a 200 with a content-length (what the proxy and vllm-router send)."""
    sent = 0

    async def one(first: int) -> None:
        nonlocal sent
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = first
        try:
            while sent < total:
                sent += 1
                body = bodies[i % len(bodies)]
                i += connections
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                    % (len(body), body)
                )
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"answer was not a 200: {head[:300]!r}")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if length is None:
                    raise RuntimeError(f"answer without content-length: {head[:300]!r}")
                await reader.readexactly(int(length.group(1)))
        finally:
            writer.close()

    await asyncio.gather(*(one(c) for c in range(connections)))


def serve_and_drive(
    name: str,
    argv: Sequence[str],
    port: int,
    env: dict[str, str],
    log_dir: Path,
    warm: int,
    requests: int,
    connections: int,
    around: Callable[[int, bool], None] | None = None,
) -> None:
    """Start ``argv`` (serving on ``port``), send ``warm`` requests, then ``requests`` more with
    ``around(pid, True)`` called before them and ``around(pid, False)`` after."""
    bodies = [b.encode() for b in run_overhead.bodies("distinct64", False)]
    with managed(name, argv, log_dir / f"instructions-{name}.log", env) as proc:
        url = f"http://127.0.0.1:{port}/v1/completions"
        wait_http(url, 600, proc=proc, method="POST", body=bodies[0])
        asyncio.run(_drive(port, bodies, warm, connections))
        if around is not None:
            around(proc.pid, True)
        asyncio.run(_drive(port, bodies, requests, connections))
        if around is not None:
            around(proc.pid, False)


def _callgrind_switch(pid: int, on: bool) -> None:
    """Instrumentation on, or off and the counts dumped (the dump is written before it returns)."""
    control = ["callgrind_control"]
    if on:
        subprocess.run([*control, "-i", "on", str(pid)], check=True, capture_output=True)
    else:
        subprocess.run([*control, "-i", "off", str(pid)], check=True, capture_output=True)
        subprocess.run([*control, "-d", str(pid)], check=True, capture_output=True)


def process_targets(backend_urls: Sequence[str], port: int) -> dict[str, list[str]]:
    """Each tree's ``python -m proxy`` and vllm-router (when installed), serving on ``port``."""
    proxy_args = ["-m", "proxy", "--replicas", ",".join(backend_urls), "--port", str(port)]
    # -P: each checkout's own proxy/ (its venv's editable install), not this working directory's
    found = {"this tree": [sys.executable, "-P", *proxy_args]}
    for label, path in trees().items():
        found[label] = [str(path / ".venv" / "bin" / "python"), "-P", *proxy_args]
    router = find_tool("vllm-router")
    if router is not None:
        found["vllm-router"] = rust_router_argv("vllm-router", router, backend_urls, port, HOUR_S)
    return found


# The process's settings for a count: string hashes as in every count, probes an hour apart.
PROCESS_ENV = {"PYTHONHASHSEED": "0", "PROXY_HEALTH_INTERVAL_S": str(HOUR_S)}


@contextlib.contextmanager
def backend(tokens: int, log_dir: Path) -> Iterator[list[str]]:
    """run_overhead's nginx backend (two fake replicas answering ``tokens`` generated ids at
    once) for the block; yields their base URLs."""
    nginx = find_tool("nginx")
    if nginx is None:
        raise RuntimeError("nginx is not installed (apt-get install -y nginx)")
    with tempfile.TemporaryDirectory(prefix="rollout-backend-") as tmp:
        Path(tmp).chmod(0o755)  # nginx workers drop privileges when started as root
        log = log_dir / f"backend-{tokens}.log"
        with run_overhead.nginx_backend(nginx, Path(tmp) / "backend", log, tokens) as (_, ports):
            yield [f"http://127.0.0.1:{p}" for p in ports]


def count_processes(
    tokens: int, warm: int, requests: int, connections: int, work: Path
) -> dict[str, float]:
    """Instructions per request of each whole process (``process_targets``), one after another
    in front of one backend answering ``tokens`` generated ids."""
    counts: dict[str, float] = {}
    with backend(tokens, work) as urls:
        port = free_port()
        for label, argv in process_targets(urls, port).items():
            name = f"{label.replace(' ', '_')}-{tokens}"
            out = work / f"callgrind-{name}.out"
            valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
            valgrind.append(f"--callgrind-out-file={out}")
            serve_and_drive(
                name, [*valgrind, *argv], port, PROCESS_ENV, work, warm, requests, connections,
                _callgrind_switch,
            )  # fmt: skip
            # Part 1 is the dump after the counted requests; the final part, written at exit,
            # counted nothing (instrumentation was off).
            totals = [
                int(line.split()[1])
                for dump in work.glob(out.name + "*")
                for line in dump.read_text().splitlines()
                if line.startswith("totals:")
            ]
            if not totals:
                raise RuntimeError(f"{label}: no callgrind totals in {work}")
            counts[label] = sum(totals) / requests
            print(f"{label:>12} whole process {tokens:5d} generated: {counts[label]:10,.0f}")
    return counts


def _write(out: Path, name: str, text: str, results: list[dict[str, object]]) -> int:
    """The report (``name``.md) and its figures (``name``.json) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / name}.md")
    return 0


def main_processes(args: argparse.Namespace, lengths: Sequence[int]) -> int:
    results, rows = [], []
    with tempfile.TemporaryDirectory(prefix="rollout-instructions-") as tmp:
        work = Path(tmp)
        for tokens in lengths:
            counts = count_processes(tokens, args.warm, args.requests, args.connections, work)
            first = next(iter(counts.values()))
            for label, ir in counts.items():
                results.append(dict(target=label, tokens=tokens, per_request=ir))
                rows.append([label, str(tokens), f"{ir:,.0f}", f"{ir / first:.3f}"])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python -m bench.runners.count_instructions " + " ".join(sys.argv[1:])
    text = (
        "# Instructions per completion, whole processes\n\n"
        f"Measured {stamp} with `{command.strip()}` (valgrind callgrind; {args.requests} "
        f"requests over {args.connections} keep-alive connections after {args.warm} warm-up "
        "requests, run_overhead's distinct64 bodies and nginx backend). Machine: "
        f"{machine_description()['cpu']}. User-space instructions of the whole process: front, "
        "upstream client, event loop, routing; not the kernel's share and not CPU time (a "
        "Python and a Rust process run instructions at different speeds, and callgrind counts "
        "each byte of a large copy, memcpy's `rep movsb`, as one instruction, which weighs "
        "a 32 KB answer's copies far above their time). ratio: to the first target's count "
        "with the same answer.\n\n"
        + table(["target", "generated ids", "instructions per request", "ratio"], rows)
        + "\n"
    )
    return _write(args.out, "instructions_process", text, results)


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m bench.runners.count_instructions"
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="requests counted (2000)")
    p.add_argument(
        "--warm",
        type=int,
        default=None,
        help=f"warm-up requests ({WARM_REQUESTS} in process, {PROCESS_WARM_REQUESTS} with "
        "--whole-process)",
    )
    p.add_argument(
        "--modes",
        default="auto",
        help="PROXY_NATIVE values, e.g. auto,off (auto; in process only: whole processes run "
        "their default)",
    )
    p.add_argument(
        "--completion-tokens",
        default="16,600",
        help="generated ids per answer, one count each (16: run_overhead's answer; 600: the "
        "recipe's median completion)",
    )
    p.add_argument(
        "--whole-process",
        action="store_true",
        help="count whole server processes (each tree's proxy, vllm-router) instead",
    )
    p.add_argument(
        "--connections", type=int, default=64, help="keep-alive connections (--whole-process; 64)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    lengths = [int(t) for t in args.completion_tokens.split(",") if t.strip()]
    if args.whole_process:
        if args.warm is None:
            args.warm = PROCESS_WARM_REQUESTS
        return main_processes(args, lengths)
    if args.warm is None:
        args.warm = WARM_REQUESTS
    targets = {"this tree": (Path(sys.executable), REPO)}
    targets |= {label: (path / ".venv" / "bin" / "python", path) for label, path in trees().items()}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    rows = []
    for tokens in lengths:
        for mode in modes:
            first = None
            for label, (python, tree) in targets.items():
                ir = per_request(python, tree, args.warm, args.requests, mode, tokens)
                first = first or ir
                print(f"{label:>12} PROXY_NATIVE={mode:<4} {tokens:5d} generated: {ir:10,.0f}")
                results.append(
                    dict(target=label, tree=str(tree), native=mode, tokens=tokens, per_request=ir)
                )
                rows.append([label, mode, str(tokens), f"{ir:,.0f}", f"{ir / first:.3f}"])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python -m bench.runners.count_instructions " + " ".join(argv or sys.argv[1:])
    text = (
        "# Instructions per routed completion, in process\n\n"
        f"Measured {stamp} with `{command.strip()}` (valgrind callgrind; {args.requests} requests "
        f"after {args.warm} warm-up requests, run_overhead's distinct64 bodies). Machine: "
        f"{machine_description()['cpu']}. Instruction counts do not depend on the machine's "
        "load; they leave out sockets, the event loop and cache misses (bench/results/overhead.md "
        "has those). ratio: to the first target's count in the same setting.\n\n"
        + table(
            ["target", "PROXY_NATIVE", "generated ids", "instructions per request", "ratio"],
            rows,
        )
        + "\n"
    )
    return _write(args.out, "instructions", text, results)


if __name__ == "__main__":
    sys.exit(main())
