"""What the routing benchmark reports about ``proxy-events`` runs: the proxy's KV-event views
(batches, gaps, views live at the end) and how often its expected cached tokens equalled what
the replica reported (``rollout_proxy_kv_prediction_*``), read from the proxy's /metrics.

    python -m bench.analysis.kv_events_report OUT/routing.json
    python -m bench.analysis.kv_events_report S0/routing.json S1/routing.json S2/routing.json

prints the side-by-side table of bench/results/kv_events.md from a run's routing.json, or, given
several runs (seeds), each run's pair and the pooled means per fleet size."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.analysis.report import pct, table

_VIEW_COUNTERS = ("batches", "events", "gaps", "malformed", "dropped", "replay_failures")


async def kv_events_summary(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Fleet totals of the proxy's KV-event metrics (empty when it exports none)."""
    try:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix("rollout_proxy_")
            if name.startswith("kv_events_") and name.endswith("_total"):
                key = name.removeprefix("kv_events_").removesuffix("_total")
            elif name == "kv_events_view_live":
                key = "views_live"
            elif name == "kv_prediction_requests_total":
                key = f"prediction_{s.labels['source']}_{s.labels['result']}"
            elif name.startswith("kv_prediction_") and "source" in s.labels:
                stem = name.removeprefix("kv_prediction_").removesuffix("_total")
                key = f"{stem}_{s.labels['source']}"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def kv_events_section(results: Sequence[Any]) -> str:
    """Markdown for the runs that routed on events ('' when none did)."""
    runs = [r for r in results if r.kv_events]
    if not runs:
        return ""
    rows = []
    for r in runs:
        kv = r.kv_events
        routed = {
            src: sum(kv.get(f"prediction_{src}_{x}", 0.0) for x in ("exact", "over", "under"))
            for src in ("events", "index")
        }
        total = sum(routed.values()) or 1.0
        exact = kv.get("prediction_events_exact", 0.0) / (routed["events"] or 1.0)
        rows.append(
            [f"{r.router} x{r.replicas}"]
            + [f"{kv.get(c, 0.0):.0f}" for c in _VIEW_COUNTERS]
            + [f"{kv.get('views_live', 0.0):.0f}/{r.replicas}", pct(routed["events"] / total)]
            + [pct(exact)]
        )
    head = ["run", *_VIEW_COUNTERS, "views live at end", "routed on events", "predictions exact"]
    return (
        "\n## KV-event views (proxy-events)\n\n"
        + table(head, rows)
        + "\n*routed on events*: requests whose chosen replica had a live view (the rest fell "
        "back to the index); *predictions exact*: of those, the share whose expected cached "
        "tokens equalled the replica's `usage.prompt_tokens_details.cached_tokens`.\n"
    )


def comparison(raw: dict[str, Any], workload: str = "tight") -> str:
    """The side-by-side table of bench/results/kv_events.md from a run's routing.json: every
    router of ``workload`` per fleet size, with the routing outcomes and, for proxy-events, how
    often its predicted cached tokens were exact (over / under)."""
    rows = []
    runs = [r for r in raw["results"] if r["workload"] == workload and r["status"] == "ok"]
    for r in sorted(runs, key=lambda r: r["replicas"]):
        decisions = r.get("decisions") or {}
        routed = sum(decisions.values()) or 1.0
        kv = r.get("kv_events") or {}
        made = sum(kv.get(f"prediction_events_{x}", 0.0) for x in ("exact", "over", "under"))
        predictions = (
            f"{pct(kv['prediction_events_exact'] / made, 0)} "
            f"({pct(kv['prediction_events_over'] / made, 0)} / "
            f"{pct(kv['prediction_events_under'] / made, 0)})"
            if made
            else "-"
        )
        rows.append(
            [
                str(r["replicas"]),
                r["router"],
                f"{pct(r['hit_rate'])} ({pct(r['oracle_ratio'])})",
                f"{r['throughput_tok_s']:.0f}",
                f"{r['p50_s']:.2f} / {r['p99_s']:.2f}",
                f"{r['router_cpu_ms']:.1f}",
                f"{r['added_p50_ms']:.0f}",
                " / ".join(pct(decisions.get(o, 0.0) / routed, 0) for o in _OUTCOMES),
                predictions,
            ]
        )
    head = [
        "replicas",
        "router",
        "hit rate (of oracle)",
        "throughput tok/s",
        "p50 / p99 s",
        "router CPU ms/request",
        "added real ms p50",
        "affinity / spilled / unmatched",
        "predictions exact (over / under)",
    ]
    return table(head, rows)


_OUTCOMES = ("affinity", "spilled", "unmatched")


def _memo_share(r: dict[str, Any]) -> str:
    kv = r.get("kv_events") or {}
    hits, misses = kv.get("exact_memo_hits", 0.0), kv.get("exact_memo_misses", 0.0)
    return pct(hits / (hits + misses), 0) if hits + misses else "-"


def pooled(raws: Sequence[dict[str, Any]], workload: str = "tight") -> str:
    """``proxy-events`` against ``proxy`` over several runs (seeds): every run's pair, then the
    mean of each per fleet size -- oracle hits, throughput, p99, router CPU and the real
    latency each router added per request (p50) -- and the differences of the means."""
    cells: dict[int, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}
    for raw in raws:
        runs = {
            (r["router"], r["replicas"]): r
            for r in raw["results"]
            if r["workload"] == workload and r["status"] == "ok"
        }
        for (router, n), events in runs.items():
            index = runs.get(("proxy", n))
            if router == "proxy-events" and index is not None:
                cells.setdefault(n, []).append((raw.get("measured_at", "?"), index, events))

    def cols(r: dict[str, Any]) -> str:
        return (
            f"{pct(r['oracle_ratio'])} / {r['throughput_tok_s']:.0f} / {r['p99_s']:.2f} / "
            f"{r['router_cpu_ms']:.1f} / {r['added_p50_ms']:.0f}"
        )

    def diff(index: dict[str, float], events: dict[str, float]) -> str:
        return (
            f"{100 * (events['oracle_ratio'] - index['oracle_ratio']):+.1f} / "
            f"{100 * (events['throughput_tok_s'] / index['throughput_tok_s'] - 1):+.1f}% / "
            f"{100 * (events['p99_s'] / index['p99_s'] - 1):+.1f}%"
        )

    keys = ("oracle_ratio", "throughput_tok_s", "p99_s", "router_cpu_ms", "added_p50_ms")
    rows = []
    for n in sorted(cells):
        for at, index, events in cells[n]:
            rows.append([str(n), at, cols(index), cols(events), diff(index, events),
                         _memo_share(events)])  # fmt: skip
        sides = ([index for _, index, _ in cells[n]], [events for _, _, events in cells[n]])
        mean = [{k: sum(run[k] for run in side) / len(side) for k in keys} for side in sides]
        rows.append([f"**{n}**", f"**pooled, {len(cells[n])} runs**", cols(mean[0]),
                     cols(mean[1]), f"**{diff(mean[0], mean[1])}**", ""])  # fmt: skip
    head = [
        "replicas",
        "run (measured at)",
        "proxy: hits of oracle / tok/s / p99 s / router CPU ms / added ms p50",
        "proxy-events: same",
        "events - proxy: points / throughput / p99",
        "exact memo hits",
    ]
    return table(head, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.analysis.kv_events_report",
        description="proxy vs proxy-events side by side, from a run_routing routing.json",
    )
    p.add_argument("routing_json", type=Path, nargs="+", help="several: pooled (seeds)")
    p.add_argument("--workload", default="tight")
    args = p.parse_args(argv)
    if len(args.routing_json) > 1:
        raws = [json.loads(path.read_text()) for path in args.routing_json]
        print(pooled(raws, args.workload), end="")
        for raw in raws:
            print(f"\n`{raw['command']}`; measured {raw.get('measured_at', '?')}")
        return 0
    raw = json.loads(args.routing_json[0].read_text())
    print(comparison(raw, args.workload), end="")
    print(f"\n`{raw['command']}`; measured {raw.get('measured_at', '?')}, {raw['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
