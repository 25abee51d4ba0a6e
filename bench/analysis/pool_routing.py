"""Pool routing runs of the same cells over seeds:
``python -m bench.analysis.pool_routing OUT DIR...``.

Single runs of a memory-tight cell swing by several percent from seed to seed (tight x2/x4: the
proxy 3-4%, the Rust routers 4-24%), more than the gaps they decide. This reads the
``routing.json`` of each run folder (``bench.runners.run_routing --seed N --out DIR``) and writes
``OUT.md`` and ``OUT.json``: per cell and router the mean over seeds of throughput, p99 and busy
imbalance, with each seed's throughput, and the proxy against the best other router by those
means (the same targets as bench/results/routing.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.analysis.report import fmt, table

# The routers the proxy is judged against (bench/results/routing.md, "Against the targets").
OTHERS = ("vllm-router", "sglang-router", "proxy-ll", "proxy-rr")
TARGET_P99_RATIO = 1.05


def pool(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, replicas, router) that succeeded in every run it appears in."""
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        for r in run["results"]:
            if r["status"] == "ok":
                cells.setdefault((r["workload"], r["replicas"], r["router"]), []).append(r)
    rows = []
    for (workload, replicas, router), results in sorted(cells.items()):
        rows.append(
            {
                "workload": workload,
                "replicas": replicas,
                "router": router,
                "seeds": len(results),
                "throughput_tok_s": statistics.fmean(r["throughput_tok_s"] for r in results),
                "throughput_each": [r["throughput_tok_s"] for r in results],
                "p99_s": statistics.fmean(r["p99_s"] for r in results),
                "imbalance_busy": statistics.fmean(r["imbalance_busy"] for r in results),
            }
        )
    return rows


def verdicts(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The proxy against the best other router of each cell, by the pooled means."""
    out = []
    for workload, replicas in sorted({(r["workload"], r["replicas"]) for r in rows}):
        cell = {
            r["router"]: r for r in rows if (r["workload"], r["replicas"]) == (workload, replicas)
        }
        ours = cell.get("proxy")
        others = [cell[n] for n in OTHERS if n in cell]
        if ours is None or not others:
            continue
        fastest = max(others, key=lambda r: r["throughput_tok_s"])
        tail = min(others, key=lambda r: r["p99_s"])
        out.append(
            {
                "workload": workload,
                "replicas": replicas,
                "best_other": fastest["router"],
                "throughput_ratio": ours["throughput_tok_s"] / fastest["throughput_tok_s"],
                "best_p99_other": tail["router"],
                "p99_ratio": ours["p99_s"] / tail["p99_s"],
                "imbalance_busy": ours["imbalance_busy"],
            }
        )
    return out


def paired(runs: Sequence[dict[str, Any]], others: Sequence[str] = OTHERS) -> list[dict[str, Any]]:
    """Per cell and other router, ``proxy``'s throughput over theirs seed by seed (both in the
    same run: same seed, same plan, minutes apart), with the mean, spread and range of those
    ratios. A gap smaller than the spread of the paired ratios is not one the seeds can tell
    from noise; a proxy behind on every seed is consistently behind. ``others``: the routers
    paired against (``--against``, e.g. a variant of the proxy run in the same folders)."""
    ratios: dict[tuple[str, int, str], list[float]] = {}
    for run in runs:
        ok = {
            (r["workload"], r["replicas"], r["router"]): r["throughput_tok_s"]
            for r in run["results"]
            if r["status"] == "ok"
        }
        for (workload, replicas, router), tok_s in ok.items():
            ours = ok.get((workload, replicas, "proxy"))
            if router in others and ours is not None and tok_s > 0:
                ratios.setdefault((workload, replicas, router), []).append(ours / tok_s)
    return [
        {
            "workload": workload,
            "replicas": replicas,
            "other": other,
            "ratios": each,
            "mean": statistics.fmean(each),
            "stdev": statistics.stdev(each) if len(each) > 1 else math.nan,
            "ahead": sum(1 for x in each if x >= 1.0),
        }
        for (workload, replicas, other), each in sorted(ratios.items())
    ]


def render_paired(pairs: Sequence[dict[str, Any]]) -> str:
    head = ["workload", "replicas", "proxy / this router", "seeds", "each seed", "mean", "stdev"]
    head.append("seeds proxy >= it")
    body = [
        [
            p["workload"],
            str(p["replicas"]),
            p["other"],
            str(len(p["ratios"])),
            " / ".join(fmt(x, 3) for x in p["ratios"]),
            fmt(p["mean"], 3),
            fmt(p["stdev"], 3),
            f"{p['ahead']} of {len(p['ratios'])}",
        ]
        for p in pairs
    ]
    return (
        "Paired per seed: `proxy`'s throughput over each other router's in the same run.\n\n"
        + table(head, body)
    )


def render(rows: Sequence[dict[str, Any]], judged: Sequence[dict[str, Any]], sources: str) -> str:
    head = [
        "workload",
        "replicas",
        "router",
        "seeds",
        "tok/s (mean)",
        "each seed",
        "p99 (s)",
        "busy imbalance",
    ]
    body = [
        [
            r["workload"],
            str(r["replicas"]),
            r["router"],
            str(r["seeds"]),
            fmt(r["throughput_tok_s"], 0),
            " / ".join(fmt(x, 0) for x in r["throughput_each"]),
            fmt(r["p99_s"], 2),
            fmt(r["imbalance_busy"], 3),
        ]
        for r in rows
    ]
    vhead = [
        "workload",
        "replicas",
        "best other (tok/s)",
        "throughput ratio",
        "best other (p99)",
        "p99 ratio",
        "proxy busy imbalance",
        "verdict",
    ]
    vbody = []
    for v in judged:
        met = v["throughput_ratio"] >= 1.0 and v["p99_ratio"] <= TARGET_P99_RATIO
        met = met and v["imbalance_busy"] <= 1.10
        vbody.append(
            [
                v["workload"],
                str(v["replicas"]),
                v["best_other"],
                fmt(v["throughput_ratio"], 3),
                v["best_p99_other"],
                fmt(v["p99_ratio"], 3),
                fmt(v["imbalance_busy"], 3),
                "all met" if met else "**missed**",
            ]
        )
    return (
        f"Pooled over seeds ({sources}): means per router, then `proxy` against the best of "
        f"{', '.join(OTHERS)} by those means.\n\n" + table(head, body) + "\n" + table(vhead, vbody)
    )


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.analysis.pool_routing", description=__doc__
    )
    parser.add_argument("out", type=Path, help="writes OUT.md and OUT.json")
    parser.add_argument("dirs", type=Path, nargs="+", help="run folders (their routing.json)")
    parser.add_argument(
        "--against",
        default=",".join(OTHERS),
        help="comma-separated routers to pair `proxy` against (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    out, dirs = args.out, args.dirs
    runs = [json.loads((d / "routing.json").read_text()) for d in dirs]
    rows = pool(runs)
    judged = verdicts(rows)
    pairs = paired(runs, tuple(args.against.split(",")))
    commands = [r.get("command") for r in runs]
    out.with_suffix(".json").write_text(
        json.dumps(
            {"runs": commands, "pooled": rows, "verdicts": judged, "paired": pairs}, indent=1
        )
    )
    text = render(rows, judged, ", ".join(d.name for d in dirs))
    out.with_suffix(".md").write_text(text + "\n" + render_paired(pairs))


if __name__ == "__main__":
    main(sys.argv[1:])
