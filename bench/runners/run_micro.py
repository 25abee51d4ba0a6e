"""Micro-benchmarks of the proxy's pure core: block hashing of a 4,096-token prompt (fast and exact
modes) and the prefix index's memory per tracked block; with ``--request``, one routed completion
taken apart in process.

    python -m bench.runners.run_micro                  # -> bench/results/micro.md
    python -m bench.runners.run_micro --smoke --out /tmp/m
    python -m bench.runners.run_micro --request        # -> bench/results/micro_request.md

``--request`` builds the proxy's real runtime (settings, router, data plane, data path) with two
replicas marked ready and an upstream that answers at once with bench.runners.run_overhead's fixed
completion, then times ``DataPath.respond`` for bench.runners.run_overhead's ``distinct64`` bodies
and each stage it runs, in CPU microseconds without sockets. What that leaves out (the front, the
upstream client, the syscalls) is what bench.runners.run_overhead's ``floor-protocol`` target costs.

Uses ``proxy.core`` as a library: ``make_hasher(mode, block_size)``, ``Namespace``,
``PrefixIndex(capacity, max_replicas).record(keys, replica)``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.analysis.report import fmt, table
from bench.harness.procs import REPO, machine_description
from bench.harness.request_micro import CACHE_SWEEP_BYTES, cold_samples, request_timings
from proxy.core.hashing import Namespace, make_hasher
from proxy.core.prefix_index import PrefixIndex

DEFAULT_OUT = REPO / "bench" / "results"
PROMPT_TOKENS = 4096
BLOCK_SIZE = 16
# A TRL request names an adapter; vLLM keys its blocks by (name, path), so the exact mode hashes
# the adapter into every block, its most expensive case.
NAMESPACE = Namespace("trl-policy-v12", "/tmp/rollout-bench/.vllm_lora/trl-policy-v12")

TARGET_FAST_US = 20.0
TARGET_BYTES_PER_BLOCK = 150.0


@dataclass
class Timing:
    name: str
    median_us: float
    min_us: float
    runs: int


def time_call(name: str, fn: Callable[[], object], runs: int, inner: int) -> Timing:
    """Median and min over ``runs`` batches of ``inner`` calls, in us of CPU time per call.

    CPU time (CLOCK_PROCESS_CPUTIME_ID) rather than wall time: on a machine shared with other
    jobs, time spent descheduled would otherwise be charged to the code under test.
    """
    fn()  # warm caches
    samples = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(runs):
            t0 = time.process_time_ns()
            for _ in range(inner):
                fn()
            samples.append((time.process_time_ns() - t0) / inner / 1e3)
    finally:
        if gc_was:
            gc.enable()
    return Timing(name, statistics.median(samples), min(samples), runs * inner)


def hashing_timings(runs: int, inner: int) -> list[Timing]:
    rng = random.Random(0)
    tokens = [rng.randrange(151_936) for _ in range(PROMPT_TOKENS)]
    fast = make_hasher("fast", BLOCK_SIZE)
    exact = make_hasher("exact", BLOCK_SIZE)
    body = json.dumps({"model": NAMESPACE.model, "prompt": tokens, "max_tokens": 3000})
    results = [
        time_call("fast (xxh3-64 chain)", lambda: fast.hash_tokens(tokens, NAMESPACE), runs, inner),
        time_call(
            "exact (vLLM sha256 + pickle)",
            lambda: exact.hash_tokens(tokens, NAMESPACE),
            max(3, runs // 4),
            max(1, inner // 10),
        ),
        time_call(
            "reference: json.loads of the request body", lambda: json.loads(body), runs, inner
        ),
    ]
    return results


@dataclass
class IndexMemory:
    blocks: int
    bytes_total: int
    evictions: int

    @property
    def bytes_per_block(self) -> float:
        return self.bytes_total / self.blocks if self.blocks else float("nan")


def index_memory(blocks: int, replicas: int = 8) -> IndexMemory:
    """tracemalloc delta of a PrefixIndex holding ``blocks`` entries recorded as real chains
    (256-token prompts = 16 blocks each, spread over ``replicas``)."""
    hasher = make_hasher("fast", BLOCK_SIZE)
    rng = random.Random(1)
    per_prompt = 16
    prompts = -(-blocks // per_prompt)
    chains = []
    for i in range(prompts):
        toks = [rng.randrange(151_936) for _ in range(per_prompt * BLOCK_SIZE)]
        chains.append(hasher.hash_tokens(toks, Namespace(f"trl-policy-v{i % 5}")))
    # Capacity above the count: measure the entries themselves, not the eviction policy.
    capacity = 4 * blocks
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(capacity)
        for i, chain in enumerate(chains):
            index.record(chain, i % replicas)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return IndexMemory(len(index), after - before, index.evictions)


def write_report(
    timings: Sequence[Timing], mems: Sequence[IndexMemory], out: Path, command: str
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    md = ["# Micro-benchmarks: hashing and prefix index\n\n"]
    md.append(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}`. "
        f"Machine: {machine['nproc']} cores ({machine['cpu']}), {machine['memory']}, Python "
        f"{machine['python']}, shared with other jobs: timings are CPU time of this process "
        "(immune to being descheduled), medians and minimums of batches.\n\n"
    )
    md.append(f"## Hashing one {PROMPT_TOKENS}-token prompt ({BLOCK_SIZE}-token blocks)\n\n")
    md.append(
        table(
            ["what", "median (us)", "min (us)", "calls"],
            [[t.name, fmt(t.median_us, 1), fmt(t.min_us, 1), str(t.runs)] for t in timings],
        )
    )
    md.append("\n## Prefix index memory\n\n")
    md.append(
        table(
            ["tracked blocks", "bytes (tracemalloc)", "bytes per block", "evictions"],
            [
                [str(m.blocks), str(m.bytes_total), fmt(m.bytes_per_block, 1), str(m.evictions)]
                for m in mems
            ],
        )
    )
    md.append(
        "\nBlocks are recorded as 16-block chains (256-token prompts) over 8 replicas. "
        "Python dicts grow in powers of two, so bytes per block vary with how full the table is "
        "at the measured count.\n"
    )
    md.append("\n## Against the targets\n\n")
    fast = timings[0]
    md.append(
        f"- fast hashing: {fmt(fast.median_us, 1)} us per {PROMPT_TOKENS}-token prompt (target <= "
        f"{TARGET_FAST_US:.0f}: {'met' if fast.median_us <= TARGET_FAST_US else 'MISSED'})\n"
    )
    worst = max(mems, key=lambda m: m.bytes_per_block)
    md.append(
        f"- index: {fmt(worst.bytes_per_block, 1)} bytes per tracked block at {worst.blocks} "
        f"blocks (target <= {TARGET_BYTES_PER_BLOCK:.0f}: "
        f"{'met' if worst.bytes_per_block <= TARGET_BYTES_PER_BLOCK else 'MISSED'})\n"
    )
    (out / "micro.md").write_text("".join(md))
    raw = {
        "machine": machine,
        "command": command,
        "hashing": [asdict(t) for t in timings],
        "index": [asdict(m) | {"bytes_per_block": m.bytes_per_block} for m in mems],
    }
    (out / "micro.json").write_text(json.dumps(raw, indent=1))
    return out / "micro.md"


def write_request_report(timings: Sequence[Timing], core: str, out: Path, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    md = ["# One routed completion in process: where its CPU goes\n\n"]
    md.append(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `{command}`; core "
        f"modules: {core}. Machine: {machine['nproc']} cores ({machine['cpu']}), shared with "
        "other jobs: CPU time of this process, medians and minimums of batches. The stages are "
        "timed alone, hot in the cache; under wrk each costs more (bench/results/"
        "overhead_profile.md), and the last rows time routing call by call with "
        f"{CACHE_SWEEP_BYTES >> 20} MiB swept through the caches before each call, as other "
        "processes leave them between two requests of a loaded proxy.\n\n"
    )
    md.append(
        table(
            ["stage", "median (us)", "min (us)", "calls"],
            [[t.name, fmt(t.median_us, 1), fmt(t.min_us, 1), str(t.runs)] for t in timings],
        )
    )
    (out / "micro_request.md").write_text("".join(md))
    raw: dict[str, object] = {"machine": machine, "command": command, "core": core}
    raw["stages"] = [asdict(t) for t in timings]
    (out / "micro_request.json").write_text(json.dumps(raw, indent=1))
    return out / "micro_request.md"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.runners.run_micro", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="fewer repetitions, 20k blocks")
    p.add_argument("--request", action="store_true", help="time one routed completion's stages")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = "python -m bench.runners.run_micro " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.request:
        runs, inner = (3, 50) if args.smoke else (15, 1000)
        stages, core = request_timings(lambda name, fn: time_call(name, fn, runs, inner))
        for name, samples in cold_samples(200 if args.smoke else 5000):
            stages.append(Timing(name, statistics.median(samples), min(samples), len(samples)))
        for t in stages:
            print(f"{t.name:>52}: median {t.median_us:7.1f} us  min {t.min_us:7.1f} us")
        print(f"wrote {write_request_report(stages, core, args.out, command.strip())}")
        return 0
    runs, inner = (5, 20) if args.smoke else (20, 200)
    sizes = [20_000] if args.smoke else [50_000, 200_000]
    timings = hashing_timings(runs, inner)
    for t in timings:
        print(f"{t.name:>44}: median {t.median_us:9.1f} us  min {t.min_us:9.1f} us")
    mems = []
    for n in sizes:
        m = index_memory(n)
        mems.append(m)
        print(f"index with {m.blocks} blocks: {m.bytes_per_block:.1f} bytes/block")
    path = write_report(timings, mems, args.out, command.strip())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
