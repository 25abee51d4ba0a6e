"""Runtime fleet membership: add, drain and remove replicas without restarting the proxy
(docs/reliability.md, Fleet). Indexes are never reused, so metric labels and X-Proxy-Replica
values keep their meaning; a draining replica still gets broadcasts (its in-flight requests may
name any published adapter).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from proxy.control import ControlPlane
from proxy.core.fleet import Fleet, Replica, Status
from proxy.errors import InvalidRequest, ProxyError
from proxy.health import HealthMonitor
from proxy.metrics import Metrics
from proxy.settings import Settings, normalize_replica_url

log = logging.getLogger("rollout_proxy.membership")


def describe(replica: Replica) -> dict[str, Any]:
    return {
        "index": replica.index,
        "url": replica.url,
        "status": replica.status.value,
        "in_flight": replica.in_flight,
        "adapters": dict(replica.adapters),
        "paused": replica.paused,
        # Where the pause state comes from: read from /is_paused, or "unknown" (no endpoint,
        # timeout, nonsense) and then only as the last successful apply set it.
        "observed": {"paused": "known" if replica.paused_observed else "unknown"},
        "not_reconciled": replica.not_reconciled,
        "failures": replica.failures,
        "last_error": replica.last_error,
        "block_size": replica.block_size,
    }


@dataclass(eq=False, repr=False)
class Membership:
    settings: Settings
    fleet: Fleet
    control: ControlPlane
    health: HealthMonitor
    metrics: Metrics

    def _replica(self, index: int) -> Replica:
        try:
            return self.fleet.get(index)
        except KeyError:
            raise ProxyError(
                f"no replica with index {index}", status_code=404, param="index"
            ) from None

    async def add(self, url: Any) -> dict[str, Any]:
        if not isinstance(url, str):
            raise InvalidRequest("'url' must be a string", param="url")
        try:
            url = normalize_replica_url(url)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="url") from None
        if any(r.url == url for r in self.fleet.members()):
            raise InvalidRequest(f"replica {url} is already a member", param="url")
        if len(self.fleet.replicas) >= self.settings.max_replicas:
            raise InvalidRequest(
                f"the fleet has used all {self.settings.max_replicas} replica slots "
                "(PROXY_MAX_REPLICAS; indexes are never reused)",
                param="url",
            )
        replica = self.fleet.add(url)
        log.info("replica %d added: %s", replica.index, url)
        # First reconciliation right away, so the caller learns whether it is ready.
        await self.health.check(replica, wait=True)
        return describe(replica)

    def drain(self, index: int) -> dict[str, Any]:
        replica = self._replica(index)
        if replica.status is not Status.DRAINING:
            replica.status = Status.DRAINING
            self.metrics.replica_healthy.labels(str(index)).set(0)
            log.info("replica %d draining (%d in flight)", index, replica.in_flight)
        return describe(replica)

    def undrain(self, index: int) -> dict[str, Any]:
        replica = self._replica(index)
        if replica.status is Status.DRAINING:
            # Back through reconciliation: broadcasts may have failed on it meanwhile.
            replica.status = Status.RECONCILING
        return describe(replica)

    async def remove(self, index: int, timeout_s: float) -> dict[str, Any]:
        replica = self._replica(index)
        if len(self.fleet.members()) == 1:
            raise InvalidRequest("cannot remove the last replica", param="index")
        self.drain(index)
        deadline = time.monotonic() + timeout_s
        # A counter decremented from the data plane; polling it is simpler than an event per
        # replica and costs nothing at 20 Hz for the seconds a drain lasts.
        while replica.in_flight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        abandoned = replica.in_flight
        async with self.control.lock:
            self.fleet.remove(index)
        self.control.router.forget_replica(index)
        self.metrics.replica_healthy.labels(str(index)).set(0)
        log.info("replica %d removed (%d requests still in flight)", index, abandoned)
        result = describe(replica)
        result["abandoned_in_flight"] = abandoned
        return result
