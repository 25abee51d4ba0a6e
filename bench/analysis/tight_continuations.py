"""Where continuations lose their cache: ``python -m bench.analysis.tight_continuations DUMP...``.

Reads the per-request dumps ``bench.runners.run_routing`` writes
(``OUT/tmp/logs/requests-W-R-N.jsonl``) and prints, per run, what decides the loss on a
memory-tight fleet (tight x4 by default):

- ``lost``: the oracle's hit tokens not hit, as a share of the oracle's hits, split by class:
  first turns, continuations that stayed on their rollout's previous replica (``home``), and
  continuations that moved;
- ``spread``: replicas per group (its first turns' replicas), for the start-up burst's groups
  (sent before any request finished) and the rest;
- ``demand``: per replica, the KV tokens its live rollouts need to stay cached (each rollout's
  context so far: last prompt + completion, a group's shared first prompt counted once per
  replica), time-averaged over the run, over the replica's cache (``--kv-tokens``); a rollout
  lives on the replica of its latest request, from its first request to the answer of its last;
- ``home loss by mates``: the home continuations binned by how many other rollouts of their
  group were live on the same replica when they were sent (a group's first prompt is cached
  once per replica and pinned while any member there runs), with each bin's share of the
  oracle's hits lost there; and by their replica's demand / cache when sent.

Only the client's trace is read (router-independent, as bench/analysis/routing_memory.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# tight x4's replica cache: bench/harness/workload.py WORKLOADS["tight"].sim_for(4).kv_blocks
# (1,525) x block_size 16. Other cells: pass --kv-tokens.
TIGHT_X4_KV_TOKENS = 1525 * 16
DEMAND_BINS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0)


def load(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "rollout" in r and r.get("replica") is not None]


def _events(rows: Sequence[dict[str, Any]]) -> list[tuple[float, int, int, int, int, int]]:
    """(t, replica, rollout, group, context tokens, first prompt tokens) per change of a live
    rollout's state: sent to a replica (context = its prompt, then + completion at the answer),
    or ended (context -1)."""
    by_rollout: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_rollout[r["rollout"]].append(r)
    events = []
    for rollout, reqs in by_rollout.items():
        reqs.sort(key=lambda r: r["t_send"])
        first = reqs[0]["prompt_tokens"]
        for r in reqs:
            events.append(
                (r["t_send"], r["replica"], rollout, r["group"], r["prompt_tokens"], first)
            )
            ctx = r["prompt_tokens"] + r["completion_tokens"]
            events.append((r["t_recv"], r["replica"], rollout, r["group"], ctx, first))
        last = reqs[-1]
        events.append((last["t_recv"] + 1e-9, last["replica"], rollout, last["group"], -1, first))
    events.sort(key=lambda e: e[0])
    return events


def _demand(live: dict[int, tuple[int, int, int]]) -> int:
    """Distinct tokens of one replica's live rollouts (rollout -> (group, context, first))."""
    total = 0
    seen: set[int] = set()
    for group, ctx, first in live.values():
        total += ctx
        if group in seen:
            total -= first  # the group's first prompt is cached once per replica
        seen.add(group)
    return total


def analyse(rows: Sequence[dict[str, Any]], kv_tokens: int) -> dict[str, Any]:
    oracle = sum(r["oracle_hit_tokens"] for r in rows)
    replicas = sorted({r["replica"] for r in rows})
    order = sorted(rows, key=lambda r: r["t_send"])
    first_recv = min(r["t_recv"] for r in rows)
    previous: dict[int, int] = {}
    lost = {"first": 0, "home": 0, "moved": 0}
    count = {"first": 0, "home": 0, "moved": 0}
    cls_of: dict[int, str] = {}
    for i, r in enumerate(order):
        miss = r["oracle_hit_tokens"] - (r["cached_tokens"] or 0)
        if r["turn"] == 0:
            c = "first"
        else:
            c = "home" if previous.get(r["rollout"]) == r["replica"] else "moved"
        previous[r["rollout"]] = r["replica"]
        lost[c] += miss
        count[c] += 1
        cls_of[id(r)] = c
        order[i] = r
    # Group spread: distinct replicas of each group's first turns.
    groups: dict[int, set[int]] = defaultdict(set)
    burst: set[int] = set()
    for r in order:
        if r["turn"] == 0:
            groups[r["group"]].add(r["replica"])
            if r["t_send"] < first_recv:
                burst.add(r["group"])
    spread_burst = [len(groups[g]) for g in sorted(burst)]
    spread_late = [len(v) for g, v in sorted(groups.items()) if g not in burst]
    # Demand per replica over time, and each home continuation's replica demand when sent.
    live: dict[int, dict[int, tuple[int, int, int]]] = {k: {} for k in replicas}
    where: dict[int, int] = {}
    area = dict.fromkeys(replicas, 0.0)
    rollouts_area = dict.fromkeys(replicas, 0.0)
    peak = dict.fromkeys(replicas, 0.0)
    demand_now = dict.fromkeys(replicas, 0)
    send_demand: dict[tuple[int, int], float] = {}
    t_last = 0.0
    for t, rep, rollout, group, ctx, first in _events(rows):
        dt = t - t_last
        if dt > 0:
            for k in replicas:
                area[k] += demand_now[k] * dt
                rollouts_area[k] += len(live[k]) * dt
        t_last = t
        old = where.get(rollout)
        if old is not None and old != rep:
            live[old].pop(rollout, None)
            demand_now[old] = _demand(live[old])
        if ctx < 0:
            live[rep].pop(rollout, None)
            where.pop(rollout, None)
        else:
            if rollout not in live[rep] or live[rep][rollout][1] != ctx:
                # A send records the demand just before the request joins (its own context
                # is already live there when it stayed home).
                send_demand.setdefault((rollout, ctx), demand_now[rep] / kv_tokens)
            live[rep][rollout] = (group, ctx, first)
            where[rollout] = rep
        demand_now[rep] = _demand(live[rep])
        peak[rep] = max(peak[rep], demand_now[rep] / kv_tokens)
    span = t_last
    # Group mates live on the same replica when each home continuation was sent.
    last_recv: dict[int, float] = defaultdict(float)
    for r in rows:
        last_recv[r["rollout"]] = max(last_recv[r["rollout"]], r["t_recv"])
    mates_bins: dict[int, list[int]] = {}
    at: dict[int, tuple[int, int]] = {}  # rollout -> (replica, group) of its latest request
    for r in order:
        if cls_of[id(r)] == "home":
            mates = sum(
                1
                for q, (rep, g) in at.items()
                if rep == r["replica"]
                and g == r["group"]
                and q != r["rollout"]
                and last_recv[q] > r["t_send"]
            )
            b = mates_bins.setdefault(mates, [0, 0, 0])
            b[0] += 1
            b[1] += r["oracle_hit_tokens"] - (r["cached_tokens"] or 0)
            b[2] += r["oracle_hit_tokens"]
        at[r["rollout"]] = (r["replica"], r["group"])
    bins: dict[str, list[int]] = {}
    edges = (*DEMAND_BINS, float("inf"))
    for r in order:
        if cls_of[id(r)] != "home":
            continue
        d = send_demand.get((r["rollout"], r["prompt_tokens"]), float("nan"))
        lo = 0.0
        for hi in edges:
            if d < hi:
                key = f"{lo:g}-{hi:g}" if hi != float("inf") else f">{lo:g}"
                b = bins.setdefault(key, [0, 0, 0])
                b[0] += 1
                b[1] += r["oracle_hit_tokens"] - (r["cached_tokens"] or 0)
                b[2] += r["oracle_hit_tokens"]
                break
            lo = hi
    return {
        "requests": len(rows),
        "lost": {k: v / oracle for k, v in lost.items()},
        "count": count,
        "spread_burst": spread_burst,
        "spread_late": spread_late,
        "demand_mean": {k: area[k] / span / kv_tokens for k in replicas},
        "demand_peak": peak,
        "rollouts_mean": {k: rollouts_area[k] / span for k in replicas},
        "mates_bins": {
            k: {"n": v[0], "lost_of_all": v[1] / oracle, "lost_in_bin": v[1] / v[2] if v[2] else 0}
            for k, v in sorted(mates_bins.items())
        },
        "home_bins": {
            k: {"n": v[0], "lost_of_all": v[1] / oracle, "lost_in_bin": v[1] / v[2] if v[2] else 0}
            for k, v in sorted(bins.items(), key=lambda kv: float(kv[0].lstrip(">").split("-")[0]))
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "dumps",
        nargs="+",
        type=Path,
        help="per-request dumps, or run folders (--out of bench.runners.run_routing): one "
        "markdown row per router of each folder, its routing.json figures beside the dump's",
    )
    parser.add_argument(
        "--pair",
        default="",
        help="A,B: with run folders, also print each folder's throughput and p99 of router A "
        "over router B (paired: same seed, same run)",
    )
    parser.add_argument("--kv-tokens", type=int, default=TIGHT_X4_KV_TOKENS)
    parser.add_argument("--json", action="store_true", help="one JSON object per dump")
    args = parser.parse_args(argv)
    folders = [p for p in args.dumps if p.is_dir()]
    if folders:
        for line in table(folders, args.kv_tokens):
            print(line)
        if args.pair:
            for line in paired(folders, *args.pair.split(",")):
                print(line)
    for path in args.dumps:
        if path.is_dir():
            continue
        a = analyse(load(path), args.kv_tokens)
        if args.json:
            print(json.dumps({"dump": str(path), **a}))
            continue
        for line in describe(path, a):
            print(line)


def table(folders: Sequence[Path], kv_tokens: int) -> list[str]:
    """Markdown rows: per run folder and router, throughput, p99 and busy imbalance (its
    routing.json), then the dump's lost shares, replicas per group and the home loss of
    continuations with at most 2 group mates on their replica."""
    lines = [
        "| run | router | tok/s | p99 s | busy imb | lost cont. | home | moved | "
        "home, <= 2 mates (n) | replicas/group burst / later |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for folder in folders:
        run = json.loads((folder / "routing.json").read_text())
        for r in run["results"]:
            if r["status"] != "ok":
                continue
            dump = (
                folder
                / "tmp"
                / "logs"
                / f"requests-{r['workload']}-{r['router']}-{r['replicas']}.jsonl"
            )
            a = analyse(load(dump), kv_tokens)
            few = [v for k, v in a["mates_bins"].items() if k <= 2]
            sb, sl = a["spread_burst"], a["spread_late"]
            lines.append(
                f"| {folder.parent.name}/{folder.name} | {r['router']}"
                f" | {r['throughput_tok_s']:,.0f} | {r['p99_s']:.2f}"
                f" | {r['imbalance_busy']:.3f} | {r['lost_continuation']:.3f}"
                f" | {a['lost']['home']:.3f} | {a['lost']['moved']:.3f}"
                f" | {sum(v['lost_of_all'] for v in few):.3f} ({sum(v['n'] for v in few)})"
                f" | {sum(sb) / max(len(sb), 1):.2f} / {sum(sl) / max(len(sl), 1):.2f} |"
            )
    return lines


def paired(folders: Sequence[Path], a: str, b: str) -> list[str]:
    """Per run folder holding both routers: throughput and p99 of ``a`` over ``b``."""
    lines = []
    ratios = []
    for folder in folders:
        run = json.loads((folder / "routing.json").read_text())
        ok = {r["router"]: r for r in run["results"] if r["status"] == "ok"}
        if a in ok and b in ok:
            tput = ok[a]["throughput_tok_s"] / ok[b]["throughput_tok_s"]
            ratios.append(tput)
            p99 = ok[a]["p99_s"] / ok[b]["p99_s"]
            lines.append(
                f"{folder.parent.name}/{folder.name}: {a}/{b} tok/s {tput:.3f} p99 {p99:.3f}"
            )
    if ratios:
        ahead = sum(1 for x in ratios if x > 1.0)
        lines.append(
            f"{a}/{b} tok/s: mean {statistics.fmean(ratios):.3f}, median"
            f" {statistics.median(ratios):.3f}, {ahead} of {len(ratios)} ahead"
        )
    return lines


def _row(values: dict[int, float]) -> str:
    return " ".join(f"{v:.2f}" for v in values.values())


def describe(path: Path, a: dict[str, Any]) -> list[str]:
    """The human-readable summary of one dump's :func:`analyse`."""
    lost, n = a["lost"], a["count"]
    sb, sl = a["spread_burst"], a["spread_late"]
    lines = [
        f"== {path}",
        f"  lost/oracle: first {lost['first']:.3f}  home {lost['home']:.3f}"
        f"  moved {lost['moved']:.3f}  (n first {n['first']}, home {n['home']},"
        f" moved {n['moved']})",
        f"  replicas/group: burst {sum(sb) / max(len(sb), 1):.2f} {sb}"
        f"  later {sum(sl) / max(len(sl), 1):.2f} {sl}",
        f"  demand/cache mean per replica: {_row(a['demand_mean'])}"
        f"  peak: {_row(a['demand_peak'])}",
        f"  live rollouts mean per replica: {_row(a['rollouts_mean'])}",
    ]
    for label, bins in (("with {} group mates there", "mates_bins"), ("at demand {}", "home_bins")):
        for k, v in a[bins].items():
            lines.append(
                f"  home sent {label.format(k)}: n {v['n']:4d}  lost {v['lost_in_bin']:.3f}"
                f" of its hits, {v['lost_of_all']:.3f} of all"
            )
    return lines


if __name__ == "__main__":
    main()
