"""Deliberate bugs the simulation must catch (tests/unit/test_sim.py runs them over the CI seeds).

Each one re-creates a rule the proxy used to have, or an easy mistake, on a live runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.core.fleet import Fleet, Replica, Status


def ready_only_broadcast(world: Any) -> None:
    """The rule behind issue 11's first defect: control calls only reach READY/DRAINING
    replicas, so a replica the proxy has ejected or is reconciling never hears of them."""
    fleet: Fleet = world.proxy.rt.fleet

    def targets() -> list[Replica]:
        return [r for r in fleet.replicas if r.status in (Status.READY, Status.DRAINING)]

    fleet.broadcast_targets = targets  # type: ignore[method-assign]


def eligibility_ignores_status(world: Any) -> None:
    """A broken eligibility rule: any member believed to hold the adapter takes traffic, READY
    or not (an ejected replica that restarted empty still 'has' what it had)."""
    fleet: Fleet = world.proxy.rt.fleet

    def eligible(model: str) -> list[Replica]:
        members = fleet.members()
        if fleet.is_base_model(model):
            return members
        return [r for r in members if model in r.adapters]

    fleet.eligible = eligible  # type: ignore[method-assign]


def ready_only_serving(world: Any) -> None:
    """The eligibility rule before "publish means served": only READY replicas take traffic (a
    replica still reloading other adapters after a restart serves nothing, not even the adapter
    it was just loaded with), and a rollout no replica can take is refused at once."""
    fleet: Fleet = world.proxy.rt.fleet

    def eligible(model: str) -> list[Replica]:
        ready = [r for r in fleet.replicas if r.status is Status.READY]
        if fleet.is_base_model(model):
            return ready
        return [r for r in ready if model in r.adapters]

    fleet.eligible = eligible  # type: ignore[method-assign]
    world.proxy.rt.data.wait_for_replica = None


def stale_weights_serve(world: Any) -> None:
    """A broken merged-weight rule: a replica whose weights are not the fleet's (its update
    failed, it restarted after the group was formed, or it was added later) stays eligible."""
    fleet: Fleet = world.proxy.rt.fleet
    can_serve, eligible = fleet.can_serve, fleet.eligible

    def ignoring_weights(replica: Replica, model: str) -> bool:
        stale, replica.weights.stale = replica.weights.stale, None
        try:
            return can_serve(replica, model)
        finally:
            replica.weights.stale = stale

    def eligible_ignoring_weights(model: str) -> list[Replica]:
        # eligible() decides the base model (every merged-weight rollout) without can_serve.
        saved = [(r, r.weights.stale) for r in fleet.replicas]
        for r, _ in saved:
            r.weights.stale = None
        try:
            return eligible(model)
        finally:
            for r, stale in saved:
                r.weights.stale = stale

    fleet.can_serve = ignoring_weights  # type: ignore[method-assign]
    fleet.eligible = eligible_ignoring_weights  # type: ignore[method-assign]


MUTATIONS: dict[str, Callable[[Any], None]] = {
    "ready_only_broadcast": ready_only_broadcast,
    "eligibility_ignores_status": eligibility_ignores_status,
    "ready_only_serving": ready_only_serving,
    "stale_weights_serve": stale_weights_serve,
}
# The trainer mode each mutation's rule matters in (python -m sim --mode, tests/integration).
MODES: dict[str, str] = {"stale_weights_serve": "merged"}
