"""``python -m sim --seeds N`` runs seeds 0..N-1; ``python -m sim --seed K`` replays one seed and
prints its fault schedule and every violation. Exit status 1 when any invariant was violated.

The last line is always ``N seeds, M invariant violations``.
"""

from __future__ import annotations

import argparse
import sys
import time

from sim.mutations import MUTATIONS
from sim.world import run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seeds", type=int, default=100, help="run seeds 0..N-1")
    group.add_argument("--seed", type=int, help="replay one seed and print its schedule")
    parser.add_argument("--first", type=int, default=0, help="first seed of a --seeds run")
    parser.add_argument(
        "--mutate", choices=sorted(MUTATIONS), help="run with a deliberate bug (must be caught)"
    )
    parser.add_argument(
        "--mode",
        choices=("adapter", "merged"),
        default="adapter",
        help="how the simulated trainer syncs: adapter loads, or merged weights (weight transfer)",
    )
    args = parser.parse_args(argv)

    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    started = time.perf_counter()
    violations = 0
    failing: list[int] = []
    totals = {
        "syncs": 0,
        "control_calls": 0,
        "control_refused": 0,
        "completions": 0,
        "weight_calls": 0,
        "weight_refused": 0,
        "weights_checked": 0,
        "stale_unchecked": 0,
    }
    for seed in seeds:
        mutate = MUTATIONS[args.mutate] if args.mutate else None
        result = run_seed(seed, mutate=mutate, mode=args.mode)
        for key in totals:
            totals[key] += getattr(result, key)
        if args.seed is not None:
            print(f"seed {seed}: fault schedule")
            for fault in result.schedule:
                print(f"  {fault.describe()}")
            if args.mode == "merged":
                print(f"  trainer carries on after a failed step: {result.persist}")
            print(
                f"  {result.syncs} weight syncs, {result.control_calls} control calls "
                f"({result.control_refused} refused), {result.completions} completions "
                f"({result.completions_failed} failed attempts)"
            )
        for v in result.violations:
            print(f"seed {seed} t={v.at:.2f}s {v.invariant}: {v.message}")
        if result.violations:
            failing.append(seed)
            violations += len(result.violations)
        done = seed - seeds[0] + 1
        if args.seed is None and done % 100 == 0:  # progress for long runs
            print(f"... {done} seeds, {violations} violations so far", flush=True)
    elapsed = time.perf_counter() - started
    count = len(seeds)
    print(
        f"{totals['syncs']} weight syncs, {totals['control_calls']} control calls "
        f"({totals['control_refused']} refused), {totals['completions']} completions; "
        f"{elapsed:.1f} s wall, {count / elapsed:.1f} seeds/s"
        + (f"; failing seeds: {failing[:20]}" if failing else "")
    )
    if args.mode == "merged":
        print(
            f"{totals['weight_calls']} weight-transfer calls ({totals['weight_refused']} refused), "
            f"{totals['weights_checked']} completions checked against the fleet's weights, "
            f"{totals['stale_unchecked']} served by other weights while unchecked "
            "(after a proxy restart, before a new group's first finish)"
        )
    print(f"{count} seeds, {violations} invariant violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
