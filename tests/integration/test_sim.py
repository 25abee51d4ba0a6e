"""The deterministic fault simulation (sim/): the CI seeds pass, a seed replays exactly, and the
simulation can fail -- the old ready-only broadcast rule and a broken eligibility rule are each
caught within the CI seeds.

``make sim SEEDS=N`` runs many more; README "Reliability" has the figures.
"""

from __future__ import annotations

import os

import pytest

from sim.mutations import MODES, MUTATIONS
from sim.world import run_seed

# Sized for make test on a busy shared 2-core machine (each seed is a simulated minute of
# training with faults; see README "Reliability" for the seeds per second measured).
CI_SEEDS = int(os.environ.get("SIM_CI_SEEDS", "200"))
# The merged-weight mode on top (`python -m sim --mode merged`; docs/merged-weights.md).
CI_MERGED_SEEDS = int(os.environ.get("SIM_CI_MERGED_SEEDS", "20"))


def test_ci_seeds_hold_every_invariant() -> None:
    failures = []
    for seed in range(CI_SEEDS):
        result = run_seed(seed)
        failures += [f"seed {seed} {v.invariant}: {v.message}" for v in result.violations]
    assert not failures, "\n".join(failures[:20])


def test_ci_seeds_of_the_merged_weight_mode_hold_every_invariant() -> None:
    failures = []
    checked = 0
    for seed in range(CI_MERGED_SEEDS):
        result = run_seed(seed, mode="merged")
        checked += result.weights_checked
        failures += [f"seed {seed} {v.invariant}: {v.message}" for v in result.violations]
    assert not failures, "\n".join(failures[:20])
    assert checked > 0  # I7 looked at completions, not at none


def test_a_seed_replays_exactly() -> None:
    first, second = run_seed(7), run_seed(7)
    assert [f.describe() for f in first.schedule] == [f.describe() for f in second.schedule]
    assert (first.completions, first.control_calls, first.syncs) == (
        second.completions,
        second.control_calls,
        second.syncs,
    )
    assert [v.message for v in first.violations] == [v.message for v in second.violations]


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_simulation_catches_a_deliberate_bug(mutation: str) -> None:
    mode = MODES.get(mutation, "adapter")
    for seed in range(CI_SEEDS):
        if run_seed(seed, mutate=MUTATIONS[mutation], mode=mode).violations:
            return
    pytest.fail(f"{mutation} went unnoticed over {CI_SEEDS} seeds")
