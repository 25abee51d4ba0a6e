"""Where a target's time goes at one connection, from its own system calls (a diagnostic for the
``added p50 @1`` column of ``run_overhead``; needs ``perf`` and the rights to trace).

    python -m bench.runners.latency_split --targets proxy,floor-min,vllm-router --rounds 3

At one connection nothing overlaps: wrk sends a request, the target reads it, writes it
upstream, reads the answer and writes it back, and wrk sends the next one. ``perf record`` of
the target's read/write/recvfrom/writev/sendto entries (kernel tracepoints: no ptrace stop per
call, unlike strace) timestamps those steps, so each request splits into

- ``A`` client read -> upstream write: the target's work before the upstream has the request;
- ``W`` upstream write -> upstream read: the backend's turn (nginx ``return 200``) and two hops;
- ``B`` upstream read -> client write: the target's work before the client has the answer;
- ``T`` client write -> next client read: wrk's turn and two hops, plus whatever the target
  still does after the write (it reads the next request only once it is idle).

``A + B`` is the target's own share of wrk's latency; the rest is hops and the other processes.
The client connection is told from the upstream ones by its local port (the target's), read
from /proc while wrk runs. Targets and the backend are those of ``run_overhead`` (``proxy@LABEL``
with ``BENCH_TREES`` too); rounds interleave the targets. Figures are medians over requests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.harness.procs import find_tool
from bench.runners import run_overhead as ro

READS = ("read", "recvfrom")
WRITES = ("write", "writev", "sendto")
EVENTS = ",".join(f"syscalls:sys_enter_{name}" for name in READS + WRITES)
# perf script: "comm tid [cpu] 1234.567890: syscalls:sys_enter_read: fd: 0x0000000e, ..."
LINE = re.compile(r"\s(\d+\.\d+):\s+syscalls:sys_enter_(\w+):\s+fd: (0x[0-9a-f]+)")


def socket_ports(pid: int) -> dict[int, int]:
    """fd -> local TCP port of each established socket ``pid`` holds (IPv4, /proc/net/tcp;
    a listening socket has the same port as the connections it accepted)."""
    inodes: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes[link[8:-1]] = int(fd)
    ports: dict[int, int] = {}
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and fields[3] == "01":  # TCP_ESTABLISHED
            ports[inodes[fields[9]]] = int(fields[1].split(":")[1], 16)
    return ports


def split(events: Sequence[tuple[float, str, int]], client: int) -> dict[str, list[float]]:
    """Per-request segments (us) from (time us, syscall, fd) in time order. Upstream sockets
    are the other fds the target reads (a log file or pipe is only written)."""
    upstream = {fd for _, name, fd in events if name in READS} - {client}
    out: dict[str, list[float]] = {"A": [], "W": [], "B": [], "T": []}
    state, since = "idle", 0.0
    for ts, name, fd in events:
        read, write = name in READS, name in WRITES
        if read and fd == client:
            if state == "answered":
                out["T"].append(ts - since)
            state, since = "request", ts
        elif write and fd in upstream and state == "request":
            out["A"].append(ts - since)
            state, since = "upstream", ts
        elif read and fd in upstream and state == "upstream":
            out["W"].append(ts - since)
            state, since = "answer", ts
        elif write and fd == client and state == "answer":
            out["B"].append(ts - since)
            state, since = "answered", ts
    return out


def trace(
    perf: str, wrk: str, run: ro.Running, kind: str, seconds: float, data: Path
) -> tuple[dict[str, list[float]], int, float]:
    assert run.proc is not None
    pid = run.proc.pid
    port = int(run.url.rsplit(":", 1)[1])
    recorder = subprocess.Popen(
        [perf, "record", "-q", "-e", EVENTS, "-p", str(pid), "-o", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    load = subprocess.Popen(
        [
            wrk,
            "-t1",
            "-c1",
            f"-d{max(1, round(seconds))}s",
            "-s",
            str(run.scripts[kind]),
            run.url + "/v1/completions",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(0.3)
    client = next((fd for fd, p in socket_ports(pid).items() if p == port), -1)
    out, _ = load.communicate(timeout=seconds + 60)
    recorder.send_signal(2)
    recorder.wait(timeout=60)
    m = re.search(r"^WRKJSON .*\"requests\":(\d+).*\"p50_us\":(\d+)", out, re.M)
    script = subprocess.run(
        [perf, "script", "-i", str(data)], capture_output=True, text=True, check=True
    ).stdout
    events = []
    for line in script.splitlines():
        hit = LINE.search(line)
        if hit:
            events.append((float(hit.group(1)) * 1e6, hit.group(2), int(hit.group(3), 16)))
    events.sort()
    requests, p50 = (int(m.group(1)), float(m.group(2))) if m else (0, float("nan"))
    return split(events, client), requests, p50


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.runners.latency_split", description=__doc__)
    p.add_argument("--targets", default="proxy,floor-min,vllm-router")
    p.add_argument("--body", default="repeated", choices=ro.BODIES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    perf, wrk, nginx = find_tool("perf"), find_tool("wrk"), find_tool("nginx")
    if perf is None or wrk is None or nginx is None:
        print("latency_split needs perf, wrk and nginx", file=sys.stderr)
        return 2
    names = [n for n in args.targets.split(",") if n]
    log_dir = ro.DEFAULT_OUT / "tmp" / "logs"
    with tempfile.TemporaryDirectory(prefix="rollout-split-") as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o755)
        with (
            ro.nginx_backend(nginx, tmp / "backend", log_dir / "split-backend.log") as (_, ports),
            contextlib.ExitStack() as stack,
        ):
            running, rows = ro.start_targets(names, [args.body], ports, tmp, log_dir, stack)
            for row in rows.values():
                if row.status != "ok":
                    print(f"{row.target}: {row.status}: {row.reason}")
            for run in running.values():  # warm-up, as run_overhead's
                ro.run_wrk(wrk, run.url, run.scripts[args.body], 8, 1)
            print(
                "target round: requests wrk-p50 | medians (us) A client->upstream, "
                "W upstream, B upstream->client, T client turn; A+B"
            )
            for round_no in range(1, args.rounds + 1):
                for name, run in running.items():
                    if run.proc is None:
                        continue
                    seg, requests, p50 = trace(
                        perf, wrk, run, args.body, args.seconds, tmp / f"{name}.data"
                    )
                    med = {k: statistics.median(v) if v else float("nan") for k, v in seg.items()}
                    print(
                        f"{name:>12} {round_no}: {requests:6d} p50 {p50:5.0f} | "
                        + " ".join(f"{k} {med[k]:5.0f}" for k in "AWBT")
                        + f"; A+B {med['A'] + med['B']:5.0f} (n={len(seg['B'])})",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
