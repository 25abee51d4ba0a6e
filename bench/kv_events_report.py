"""What the routing benchmark reports about ``proxy-events`` runs: the proxy's KV-event views
(batches, gaps, views live at the end) and how often its expected cached tokens equalled what
the replica reported (``rollout_proxy_kv_prediction_*``), read from the proxy's /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.report import pct, table

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
