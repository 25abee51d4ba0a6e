"""What KV memory did in a routing run: the replicas' memory counters and where requests landed.

Two views, both router-independent (they read the simulated replicas and the client's trace,
never a router's own bookkeeping), so every router in a cell is measured the same way:

- :func:`memory_summary`: per run, from the simulator's counters (bench/harness/simulator.py
  ``/sim/stats``): mean KV usage (blocks held by running requests over capacity), the share of
  time a replica's queue waited for KV blocks with batch slots free, the mean queue, the mean
  running batch while busy, evictions per request, and the share of prefilled tokens that were
  blocks the same replica had evicted before (recompute caused by memory pressure).
- :func:`placement_classes`: each request classed by where it landed relative to its prefix:
  a first turn is ``first-of-group`` (no member of its GRPO group sent yet), ``with-group`` (on a
  replica a member already went to) or ``new-replica``; a later turn ``stayed`` (on the replica of
  its rollout's previous turn) or ``moved``. Per class: requests, prompt-token hit rate, and hits
  as a share of the oracle's on the same requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.analysis.report import fmt, pct, table
from bench.harness.simulator import SimConfig
from bench.harness.workload import RequestRecord

PLACEMENT_CLASSES = ("first-of-group", "with-group", "new-replica", "stayed", "moved")


def memory_summary(stats: Sequence[dict[str, Any]], elapsed_sim_s: float) -> dict[str, float]:
    """Fleet-wide memory figures of one run (``stats``: each replica's /sim/stats)."""
    if not stats or elapsed_sim_s <= 0:
        return {}
    n = len(stats)
    capacity_s = sum(s["kv_blocks"] for s in stats) * elapsed_sim_s
    busy = sum(s["busy_s"] for s in stats)
    prefilled = sum(s["prefilled_tokens"] for s in stats)
    requests = sum(s["requests"] for s in stats)
    return {
        "kv_usage": sum(s["kv_block_s"] for s in stats) / capacity_s,
        "mem_blocked_share": sum(s["mem_blocked_s"] for s in stats) / (n * elapsed_sim_s),
        "queue_mean": sum(s["waiting_s"] for s in stats) / (n * elapsed_sim_s),
        "batch_mean": sum(s["seq_s"] for s in stats) / busy if busy else float("nan"),
        "prefill_share": sum(s["prefill_s"] for s in stats) / busy if busy else float("nan"),
        "evictions_per_request": sum(s["evictions"] for s in stats) / requests
        if requests
        else float("nan"),
        "recompute_share": sum(s["recomputed_tokens"] for s in stats) / prefilled
        if prefilled
        else float("nan"),
    }


def placement_classes(
    records: Sequence[RequestRecord],
    replicas: Sequence[int | None],
    oracle_hits: Sequence[int],
    group_size: int,
) -> dict[str, dict[str, float]]:
    """Per class (:data:`PLACEMENT_CLASSES`): ``requests``, ``hit_rate`` (cached prompt tokens /
    prompt tokens) and ``of_oracle`` (cached / the oracle's hits on the same requests), from
    the successful ``records`` with the replica that served each and the oracle's hit tokens."""
    order = sorted(range(len(records)), key=lambda i: records[i].t_send)
    groups: dict[int, set[int]] = {}
    previous: dict[int, int] = {}
    sums = {c: [0, 0, 0, 0] for c in PLACEMENT_CLASSES}  # requests, prompt, cached, oracle
    for i in order:
        rec, where = records[i], replicas[i]
        if where is None:
            continue
        if rec.turn == 0:
            seen = groups.setdefault(rec.rollout // group_size, set())
            cls = "first-of-group" if not seen else "with-group" if where in seen else "new-replica"
            seen.add(where)
        else:
            cls = "stayed" if previous.get(rec.rollout) == where else "moved"
        previous[rec.rollout] = where
        row = sums[cls]
        row[0] += 1
        row[1] += len(rec.prompt)
        row[2] += rec.cached_tokens or 0
        row[3] += oracle_hits[i]
    return {
        cls: {
            "requests": float(n),
            "hit_rate": cached / prompt if prompt else float("nan"),
            "of_oracle": cached / oracle if oracle else float("nan"),
        }
        for cls, (n, prompt, cached, oracle) in sums.items()
    }


def _placement_cells(place: dict[str, dict[str, float]]) -> list[str]:
    """'share of requests: hit rate' per class."""
    total = sum(place[c]["requests"] for c in PLACEMENT_CLASSES if c in place) or 1.0
    cells = []
    for cls in PLACEMENT_CLASSES:
        c = place.get(cls)
        if not c or not c["requests"]:
            cells.append("-")
        else:
            cells.append(f"{pct(c['requests'] / total)}: {pct(c['hit_rate'])}")
    return cells


def memory_section(results: Sequence[Any]) -> str:
    """The report's memory section: one row per run that has the counters."""
    runs = [r for r in results if r.memory]
    if not runs:
        return ""
    rows = []
    for r in runs:
        m = r.memory
        rows.append(
            [
                f"{r.workload} {r.router} x{r.replicas}",
                fmt(r.throughput_tok_s, 0),
                pct(m["kv_usage"]),
                pct(m["mem_blocked_share"]),
                fmt(m["queue_mean"], 1),
                fmt(m["batch_mean"], 1),
                pct(m["prefill_share"]),
                fmt(m["evictions_per_request"], 1),
                pct(m["recompute_share"]),
                fmt(r.replicas_per_group, 2),
            ]
            + _placement_cells(r.placement)
        )
    head = [
        "run",
        "tok/s",
        "KV usage",
        "waiting for KV",
        "queue",
        "batch",
        "prefill of busy",
        "evictions / req",
        "recompute of prefill",
        "replicas per group",
    ] + [f"{c}: share, hits" for c in PLACEMENT_CLASSES]
    return (
        "\n## KV memory and placement\n\n"
        "Per run, from the simulated replicas (bench/analysis/routing_memory.py): mean KV usage "
        "(blocks "
        "held by running requests / capacity), the share of time a replica's queue waited for "
        "free KV blocks with batch slots free, mean queue, mean running batch while busy, "
        "prefill's share of busy time, evictions per request, the share of prefilled tokens "
        "that were blocks the same replica had evicted earlier; then where requests landed "
        "relative to their prefix (share of requests: their prompt-token hit rate).\n\n"
        + table(head, rows)
    )


def idle_attribution(
    intervals: Sequence[tuple[int, float, float]], replicas: int
) -> dict[str, float]:
    """Where a fleet's idle time came from, from each request's (replica, send, answer).

    A replica idle while another has two or more requests in flight is ``movable`` idle: a
    placement that had known when those requests would end could have put one of them on the
    idle replica (no router migrates a running request, so this is an upper bound on what
    placement can fix). A replica idle while none has two is ``tail`` idle: fewer requests are in
    flight than there are replicas, and no placement fills it -- the drain of the last rollouts.
    Both as replica-seconds over the run's replica-seconds (``replicas`` x its span)."""
    events = sorted(
        [(t_send, 1, r) for r, t_send, _ in intervals]
        + [(t_recv, -1, r) for r, _, t_recv in intervals]
    )
    if not events or replicas <= 0:
        return {"movable": float("nan"), "tail": float("nan")}
    in_flight = [0] * replicas
    movable = tail = 0.0
    last = events[0][0]
    for t, delta, r in events:
        idle = in_flight.count(0)
        if idle and t > last:
            if max(in_flight) >= 2:
                movable += idle * (t - last)
            else:
                tail += idle * (t - last)
        in_flight[r] += delta
        last = t
    span = (events[-1][0] - events[0][0]) * replicas
    return {"movable": movable / span, "tail": tail / span}


def drain_critical_path(rows: Sequence[dict[str, Any]], sim: SimConfig) -> dict[str, float]:
    """How much of a run's drain any placement could have saved, from its per-request dump.

    The drain starts when the last rollout sends its first turn (run_routing's
    ``_busy_before_drain``) and ends with the last answer. No placement ends it before the
    rollout still in flight with the most work left has done that work alone on a replica:
    per rollout, its remaining requests at a batch of one (the prefill they actually did,
    ``prompt - cached`` tokens, and their completions at one sequence's decode step; a request
    already running when the drain starts counts for its remaining share of its time). Returns
    ``drain_share`` (of the run), ``drain_s`` and ``alone_s`` (simulated seconds: the drain,
    and that bound), and their ratio ``drain_over_alone``: near 1, no router could shorten the
    drain; above, the last rollouts waited behind others (the gap is what placement, or an
    order that started the longest rollouts first, could at most recover)."""
    rows = [r for r in rows if "rollout" in r]
    first_turns = [r["t_send"] for r in rows if r["turn"] == 0]
    if not first_turns:
        return {}
    drain_from = max(first_turns)
    start = min(r["t_send"] for r in rows)
    end = max(r["t_recv"] for r in rows)
    step_s = (sim.decode_step_base_ms + sim.decode_step_per_seq_ms) / 1000.0
    remaining: dict[int, float] = {}
    for r in rows:
        if r["t_recv"] <= drain_from:
            continue
        alone = (r["prompt_tokens"] - r["cached_tokens"]) * sim.prefill_us_per_token / 1e6
        alone += r["completion_tokens"] * step_s
        took = r["t_recv"] - r["t_send"]
        left = min(1.0, (r["t_recv"] - drain_from) / took) if took > 0 else 1.0
        remaining[r["rollout"]] = remaining.get(r["rollout"], 0.0) + alone * left
    drain_s = end - drain_from
    alone_s = max(remaining.values(), default=0.0)
    return {
        "drain_share": drain_s / (end - start) if end > start else float("nan"),
        "drain_s": drain_s,
        "alone_s": alone_s,
        "drain_over_alone": drain_s / alone_s if alone_s > 0 else float("nan"),
    }


def _drain_report(paths: Sequence[str]) -> str:
    """One line per per-request dump (run_routing's ``requests-*.jsonl``)."""
    import json
    from pathlib import Path

    lines = []
    for path in paths:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        rows = [r for r in rows if r.get("replica") is not None]
        if not rows:
            continue
        n = max(r["replica"] for r in rows) + 1
        idle = idle_attribution([(r["replica"], r["t_send"], r["t_recv"]) for r in rows], n)
        drain = drain_critical_path(rows, SimConfig())
        lines.append(
            f"{Path(path).stem.removeprefix('requests-')}: idle while another replica had 2+ "
            f"requests {pct(idle['movable'])}, idle with no replica holding 2 (the tail) "
            f"{pct(idle['tail'])} of replica-time; drain {pct(drain['drain_share'])} of the "
            f"run, {fmt(drain['drain_s'])} s against {fmt(drain['alone_s'])} s for its longest "
            f"remaining rollout alone ({fmt(drain['drain_over_alone'])}x)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(_drain_report(sys.argv[1:]))
