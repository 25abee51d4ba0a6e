"""TRL's weight sync (pause -> load -> resume -> unload) through the proxy vs a direct broadcast.

Eight simulated replicas (``python -m bench.harness.simulator``), the proxy in its own process with
its health loop probing every ``--health-interval`` seconds (default 0.05 s: a probe round is always
in flight, the worst case for a control call that must not wait behind probes), and one client
that times each sync the way TRL's trainer experiences it (sequential calls). Proxy and direct
syncs alternate, one after the other in the same run, so both see the same machine load.

The direct broadcast is what a trainer could do without a proxy: each call sent to the 8
replicas in parallel, waiting for all. The proxy's target: no more than direct + 5 ms.

    python -m bench.runners.run_sync --replicas 8 --syncs 40
writes bench/results/sync.json and sync.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness.procs import machine_description, managed, wait_http
from fakes.net import free_port

RESULTS = Path(__file__).resolve().parents[1] / "results"


async def _sync(client: httpx.AsyncClient, bases: list[str], version: int) -> float:
    """One TRL weight sync against ``bases`` (one base: through the proxy); seconds taken."""
    name = f"trl-policy-v{version}"
    calls: list[tuple[str, Any, str | None]] = [
        ("/pause", None, "mode=keep"),
        ("/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"/bench/{name}"}, None),
        ("/resume", None, None),
    ]
    if version > 5:
        calls.append(("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{version - 5}"}, None))
    started = time.perf_counter()
    for path, body, query in calls:
        answers = await asyncio.gather(
            *(
                client.post(base + path + (f"?{query}" if query else ""), json=body)
                for base in bases
            )
        )
        # TRL ignores the unload's answer (404 when a replica no longer has it).
        ok = (200, 404) if path == "/v1/unload_lora_adapter" else (200,)
        bad = [a for a in answers if a.status_code not in ok]
        if bad:
            raise RuntimeError(f"{path}: {bad[0].status_code} {bad[0].text[:200]}")
    return time.perf_counter() - started


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
    }


async def _measure(proxy: str, replicas: list[str], syncs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"proxy": [], "direct": []}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        version = 0
        for i in range(syncs + 2):  # two warm-up syncs each, not counted
            for who in ("proxy", "direct") if i % 2 == 0 else ("direct", "proxy"):
                version += 1
                taken = await _sync(client, [proxy] if who == "proxy" else replicas, version)
                if i >= 2:
                    times[who].append(taken)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.runners.run_sync", description=__doc__)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--syncs", type=int, default=40, help="measured syncs per side")
    parser.add_argument("--health-interval", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    logs = args.out / "tmp"  # process logs (ignored by git)
    with managed(
        "replicas",
        [sys.executable, "-m", "bench.harness.simulator", "--replicas", str(args.replicas)],
        logs / "sync_replicas.log",
        capture_stdout=True,
    ) as sim:
        assert sim.proc is not None and sim.proc.stdout is not None
        ports = json.loads(sim.proc.stdout.readline())["ports"]
        replicas = [f"http://127.0.0.1:{p}" for p in ports]
        port = free_port()
        env = {
            "PROXY_REPLICAS": ",".join(replicas),
            "PROXY_PORT": str(port),
            "PROXY_HOST": "127.0.0.1",
            "PROXY_HEALTH_INTERVAL_S": str(args.health_interval),
            "PROXY_LOG_LEVEL": "WARNING",
        }
        with managed("proxy", [sys.executable, "-m", "proxy"], logs / "sync_proxy.log", env) as p:
            proxy = f"http://127.0.0.1:{port}"
            wait_http(proxy + "/health", 60, proc=p)
            times = asyncio.run(_measure(proxy, replicas, args.syncs))

    proxy_s, direct_s = _summary(times["proxy"]), _summary(times["direct"])
    extra = proxy_s["median_ms"] - direct_s["median_ms"]
    result = {
        "replicas": args.replicas,
        "syncs_per_side": args.syncs,
        "health_interval_s": args.health_interval,
        "sync": "pause?mode=keep -> load_lora_adapter -> resume (-> unload v(N-5))",
        "proxy": proxy_s,
        "direct": direct_s,
        "proxy_minus_direct_median_ms": extra,
        "target": "proxy <= direct + 5 ms",
        "met": extra <= 5.0,
        "machine": machine_description(),
        "samples_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in times.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sync.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [
        "# Weight sync through the proxy vs a direct broadcast",
        "",
        f"`python -m bench.runners.run_sync --replicas {args.replicas} --syncs {args.syncs}`: "
        f"{args.replicas} simulated replicas, proxy health loop every {args.health_interval:g} s, "
        "proxy and direct syncs alternating in one run (TRL's sequence, calls one after another).",
        "",
        "| path | median ms | p90 ms | mean ms |",
        "|---|---|---|---|",
        *(
            f"| {k} | {v['median_ms']:.1f} | {v['p90_ms']:.1f} | {v['mean_ms']:.1f} |"
            for k, v in (("proxy", proxy_s), ("direct", direct_s))
        ),
        "",
        f"Proxy minus direct (median): {extra:+.1f} ms per sync; target <= +5 ms: "
        f"{'met' if extra <= 5.0 else 'NOT met'}.",
        "",
    ]
    (args.out / "sync.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
