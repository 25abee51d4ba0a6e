"""Overhead ratios paired by round: each target against vllm-router (or ``--reference``) in
the same round.

On a shared machine a whole round can run slow or fast (other jobs, the host), which moves every
target of that round together; a ratio of two medians taken over different rounds keeps that
swing, a ratio taken within each round cancels it. ``run_overhead`` runs every target once per
round, in turn, so its JSON holds per-round samples in round order for every target.

    python -m bench.analysis.paired bench/results/overhead.json [more runs' overhead.json ...]
    python -m bench.analysis.paired --reference proxy@base OUT/overhead.json   # tree vs tree

prints, per workload and target, the median and range of the per-round ratios (CPU per request
and requests/s, at each loaded connection count) over all the rounds of the files given.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFERENCE = "vllm-router"


@dataclass(frozen=True)
class Paired:
    """Per-round ratios of one figure of one target to the reference's."""

    body: str
    target: str
    figure: str  # a sample name of run_overhead's: "cpu_us_per_req@64", "rps@8", ...
    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan

    @property
    def low(self) -> float:
        return min(self.ratios) if self.ratios else math.nan

    @property
    def high(self) -> float:
        return max(self.ratios) if self.ratios else math.nan


def round_ratios(ours: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Round i of ``ours`` over round i of ``reference``; a round either side lacks (a failed
    run: NaN, or fewer rounds) gives no ratio."""
    out = []
    for a, b in zip(ours, reference, strict=False):
        if math.isfinite(a) and math.isfinite(b) and b > 0:
            out.append(a / b)
    return out


def paired(
    runs: Iterable[dict[str, Any]], figures: Sequence[str], against: str = REFERENCE
) -> list[Paired]:
    """Every target's per-round ratios to ``against`` (a target's name), pooled over ``runs``
    (run_overhead's JSON documents), by workload and figure."""
    pooled: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        rows = [r for r in run["rows"] if r.get("status", "ok") == "ok"]
        reference = {r["body"]: r for r in rows if r["target"] == against}
        for r in rows:
            ref = reference.get(r["body"])
            if ref is None or r["target"] == against:
                continue
            for figure in figures:
                key = (r["body"], r["target"], figure)
                ratios = round_ratios(r["samples"].get(figure, []), ref["samples"].get(figure, []))
                pooled.setdefault(key, []).extend(ratios)
    return [Paired(b, t, f, tuple(v)) for (b, t, f), v in pooled.items()]


def loaded_figures(runs: Iterable[dict[str, Any]]) -> list[str]:
    """The loaded-run sample names present (``rps@C`` and ``cpu_us_per_req@C``), by C
    descending."""
    counts = set()
    for run in runs:
        for r in run["rows"]:
            for name in r.get("samples", {}):
                figure, at, c = name.partition("@")
                if at and figure in ("rps", "cpu_us_per_req"):
                    counts.add(int(c))
    return [f"{f}@{c}" for c in sorted(counts, reverse=True) for f in ("cpu_us_per_req", "rps")]


def describe(p: Paired) -> str:
    return f"{p.median:.2f} ({p.low:.2f}-{p.high:.2f}, {len(p.ratios)} rounds)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.analysis.paired", description=__doc__)
    parser.add_argument("runs", type=Path, nargs="+", help="run_overhead's overhead.json files")
    parser.add_argument(
        "--reference",
        default=REFERENCE,
        help=f"the target every other is divided by, round by round ({REFERENCE}; e.g. "
        "proxy@base to compare two trees)",
    )
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    figures = loaded_figures(runs)
    found = paired(runs, figures, args.reference)
    if not found:
        parser.error(f"no run has the reference target {args.reference!r} beside another target")
    for p in sorted(found, key=lambda p: (p.body, p.target, figures.index(p.figure))):
        print(f"{p.body:<11} {p.target:<16} {p.figure:<20} x {args.reference}: {describe(p)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
