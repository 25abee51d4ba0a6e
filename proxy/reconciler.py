"""The one reconciler: applies actions to replicas and brings each one to the desired state.
Rules: docs/reliability.md (control plane, fleet).

TRL's control calls (``proxy.control``) record the desired state, ``apply`` their action to every
member replica and hand the outcomes to ``verdict``; the health loop calls ``converge`` on a
replica out of the desired state (plan, apply a step, re-plan; each step once per round, so it
terminates). An apply holds the replica's lock for one HTTP call, so control calls and steps
never interleave on a replica. Observation takes no lock: it compares ``Replica.generation``
before and after and discards itself when it overlapped an apply, instead of undoing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.core.fleet import Fleet, Replica, Status, adapter_version
from proxy.core.router import Router
from proxy.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.metrics import Metrics
from proxy.security.redaction import scrub
from proxy.settings import Settings
from proxy.upstream import Upstream

log = logging.getLogger("rollout_proxy.reconciler")

# Upstream error bodies are echoed into our error messages so operators see vLLM's reason;
# capped because a replica could answer with a multi-megabyte HTML page.
MAX_DETAIL_CHARS = 300

# Per-replica outcomes, by what they mean for a broadcast. UNREACHED: ejected, reconciled later.
# REFUSED (4xx, a verdict on the request itself): the call is refused. Any other ("failed": 5xx;
# "mount_lag_timeout": a mount that never caught up) is ejected when others applied the call,
# else it is the call's verdict.
APPLIED = frozenset({"ok", "already_loaded", "absent"})
UNREACHED = frozenset({"unreachable", "timeout"})
REFUSED = frozenset({"refused"})


@dataclass(frozen=True)
class Action:
    """One control call to one replica."""

    kind: str  # load | unload | pause | resume | reset
    name: str = ""  # adapter name (load/unload)
    path: str = ""  # adapter path (load)
    query: str = ""  # query string (pause/reset)
    body: dict[str, Any] | None = None  # the client's own JSON body (load: extra fields kept)

    def describe(self) -> str:
        return f"{self.kind} {self.name}".strip()


@dataclass
class Outcome:
    replica: int
    result: str  # in APPLIED | UNREACHED | REFUSED, or failed / mount_lag(_timeout)
    http_status: int | None = None
    detail: str = ""
    attempts: int = 0
    action: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "result": self.result,
            "status": self.http_status,
            "detail": self.detail,
            "attempts": self.attempts,
        }

    def describe(self) -> str:
        """The outcome in a sentence, as every broadcast's error message names it."""
        text = f"replica {self.replica}: {self.result}"
        if self.http_status is not None:
            text += f" (HTTP {self.http_status})"
        if self.detail:
            text += f": {self.detail}"
        return text


@dataclass
class Verdict:
    """What one broadcast amounts to, decided in one place for every endpoint."""

    applied: list[Outcome] = field(default_factory=list)
    refused: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)  # the unreached: in none (ejected)

    @property
    def success(self) -> bool:
        """Every replica that answered applied it, or failed on its own side while others
        applied it (those are ejected); nothing refused the request itself."""
        return bool(self.applied) and not self.refused


def verdict(outcomes: list[Outcome]) -> Verdict:
    v = Verdict()
    for o in outcomes:
        if o.result in APPLIED:
            v.applied.append(o)
        elif o.result in REFUSED:
            v.refused.append(o)
        elif o.result not in UNREACHED:
            v.failed.append(o)
    return v


def detail_of(response: httpx.Response) -> str:
    """vLLM's own reason from an error answer, whatever shape (or garbage) it comes in."""
    text = response.text[: MAX_DETAIL_CHARS * 4]
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:MAX_DETAIL_CHARS]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return str(error.get("message", ""))[:MAX_DETAIL_CHARS]
        for key in ("detail", "message"):
            if key in payload:
                return str(payload[key])[:MAX_DETAIL_CHARS]
    return text[:MAX_DETAIL_CHARS]


def _classify(
    action: Action, response: httpx.Response, secrets: tuple[str, ...] = ()
) -> tuple[str, str]:
    """(result, detail) of one answered call. A replica (or a gateway before it) may quote our
    token back in its error: the detail is scrubbed here, before any log line, ``/admin/fleet``
    entry or reply can carry it."""
    status = response.status_code
    if 200 <= status < 300:
        return "ok", ""
    detail = scrub(detail_of(response), secrets)
    lowered = detail.lower()
    if action.kind == "load":
        if status == 404 and "no adapter found" in lowered:
            return "mount_lag", detail
        if status == 400 and "already" in lowered:
            return "already_loaded", detail
    if action.kind == "unload" and status == 404:
        return "absent", detail
    if 400 <= status < 500:
        return "refused", detail
    return "failed", detail


class FleetChanges:
    """Wakes a rollout waiting for a replica to get its adapter. ``notify`` follows every apply,
    observation and control call; waiters re-check ``Fleet.awaited`` on each wake-up, so a
    spurious one costs a list scan, never a wrong answer."""

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None

    def notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def wait(self, timeout: float) -> None:
        """Until the next change or ``timeout`` seconds."""
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


async def wait_for_replica(
    fleet: Fleet, changes: FleetChanges, model: str, wait_s: float, clock: Callable[[], float]
) -> None:
    """Return once a replica may serve ``model``, after ``wait_s`` seconds, or as soon as
    waiting cannot help (``Fleet.awaited`` turns false: the adapter was unloaded, or a replica
    may serve it); the caller then picks again. Woken by ``changes``, not by polling."""
    deadline = clock() + wait_s
    while (left := deadline - clock()) > 0 and fleet.awaited(model):
        await changes.wait(left)


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        router: Router,
        upstream: Upstream,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        # The event loop's clock: monotonic, and virtual under the fault simulation.
        self.clock: Callable[[], float] = lambda: asyncio.get_running_loop().time()
        # One per replica: an apply holds it for its one HTTP call (module docstring).
        self._locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._secrets = tuple(settings.secrets())
        self.changes = FleetChanges()

    # -- failure bookkeeping ----------------------------------------------------------------

    def note_failure(self, replica: Replica, reason: str) -> None:
        """A probe, observation or call failed: count it, and account for an ejection once
        (the one place the fleet's failure bookkeeping meets metrics and logs)."""
        if self.fleet.record_failure(replica.index, reason):
            self.metrics.ejections.labels(str(replica.index)).inc()
            log.warning("replica %d ejected: %s", replica.index, reason)
        if replica.status is not Status.READY:
            self.metrics.replica_healthy.labels(str(replica.index)).set(0)

    def eject(self, replica: Replica, reason: str) -> None:
        """Eject at once, whatever the probe threshold (the replica refused or timed out)."""
        if replica.status in (Status.READY, Status.RECONCILING, Status.PENDING, Status.DRAINING):
            replica.failures = max(replica.failures, self.fleet.eject_after)
            if replica.status is Status.DRAINING:
                replica.last_error = reason
                replica.paused = None
                return
            self.note_failure(replica, reason)
        elif replica.status is Status.EJECTED:
            replica.last_error = reason

    # -- one call ---------------------------------------------------------------------------

    def _timeout(self, replica: Replica, action: Action) -> httpx.Timeout:
        connect = self.settings.connect_timeout_s
        if replica.status is Status.EJECTED:
            # Only check whether it is back, within the probe budget: a wedged replica must not
            # hold every weight sync for control_timeout_s. The health loop reconciles it later.
            budget = min(self.settings.probe_timeout_s, self.settings.control_timeout_s)
            return httpx.Timeout(budget, connect=min(connect, budget))
        if action.kind == "pause" and "mode=wait" in action.query:
            # mode=wait drains in-flight requests first: as long as the longest generation.
            return httpx.Timeout(self.settings.upstream_timeout_s, connect=connect)
        return httpx.Timeout(self.settings.control_timeout_s, connect=connect)

    def _request(self, action: Action) -> tuple[str, str | None, Any]:
        if action.kind == "load":
            body = {**(action.body or {}), "lora_name": action.name, "lora_path": action.path}
            return "/v1/load_lora_adapter", None, body
        if action.kind == "unload":
            return "/v1/unload_lora_adapter", None, {"lora_name": action.name}
        path = {"pause": "/pause", "resume": "/resume", "reset": "/reset_prefix_cache"}
        return path[action.kind], action.query or None, None  # a query: pause and reset only

    async def _once(self, replica: Replica, action: Action) -> Outcome:
        """One attempt, under the replica's lock; updates what the proxy believes it holds."""
        path, params, body = self._request(action)
        async with self._locks[replica.index]:
            replica.generation += 1
            if action.kind == "unload":
                # Shrinking what it may serve applies before the call: no completion may be
                # routed to it for the adapter while the unload is on its way.
                replica.adapters.pop(action.name, None)
            try:
                response = await self.upstream.call(
                    replica.index,
                    replica.url,
                    "POST",
                    path,
                    params=params,
                    json=body,
                    timeout=self._timeout(replica, action),
                )
            except (UpstreamTimeout, UpstreamUnavailable) as exc:
                # Unreachable, silent, or broken mid-answer (it may or may not have applied).
                self.eject(replica, exc.message)
                result = "timeout" if isinstance(exc, UpstreamTimeout) else "unreachable"
                return Outcome(replica.index, result, None, exc.message)
            finally:
                replica.generation += 1
                self.changes.notify()
            result, detail = _classify(action, response, self._secrets)
            believed = replica.adapters.get(action.name)
            if result == "already_loaded" and believed != action.path:
                # Success only if it is this very adapter (a repeated publish, a proxy restart):
                # the name held at another (or an unconfirmed) path is a conflict. The next
                # observation shows what it holds, and reconciliation takes it from there.
                result = "refused"
                detail = (
                    f"name taken by another adapter path ({believed or 'unconfirmed'}): {detail}"
                )
            if result in APPLIED:
                self._believe(replica, action)
                self.changes.notify()
            return Outcome(replica.index, result, response.status_code, detail)

    def _believe(self, replica: Replica, action: Action) -> None:
        """A successful apply is trusted even where it cannot be observed (no /is_paused)."""
        if action.kind == "load":
            replica.adapters[action.name] = action.path
        elif action.kind == "unload":
            replica.adapters.pop(action.name, None)
        elif action.kind == "pause":
            replica.paused = True
        elif action.kind == "resume":
            replica.paused = False

    async def apply(
        self, replica: Replica, action: Action, deadline: float | None = None
    ) -> Outcome:
        """Apply one action. A load meeting a storage mount that has not caught up ("No adapter
        found") is retried every ``lora_retry_s`` until ``deadline`` (None: one attempt; the
        next reconciliation round tries again), without holding the replica's lock meanwhile."""
        label = str(replica.index)
        attempts = 0
        while True:
            attempts += 1
            outcome = await self._once(replica, action)
            outcome.attempts, outcome.action = attempts, action.describe()
            if action.kind == "load":
                self.metrics.load_attempts.labels(label, outcome.result).inc()
            if outcome.result != "mount_lag" or deadline is None:
                return outcome
            if self.clock() + self.settings.lora_retry_s > deadline:
                outcome.result = "mount_lag_timeout"
                return outcome
            self.metrics.mount_lag_retries.labels(label).inc()
            await asyncio.sleep(self.settings.lora_retry_s)

    # -- convergence (the health loop's driver) -----------------------------------------------

    def _next_step(self, replica: Replica, tried: set[Action]) -> Action | None:
        plan = self.fleet.plan(replica)
        steps = [Action("unload", name=n) for n in plan.unload]
        steps += [
            Action("load", name=n, path=p)
            for n, p in sorted(
                plan.load.items(), key=lambda kv: (adapter_version(kv[0]) or 0, kv[0])
            )
        ]
        if plan.pause is True:
            steps.append(Action("pause", query=plan.pause_query))
        elif plan.pause is False:
            steps.append(Action("resume"))
        return next((step for step in steps if step not in tried), None)

    async def converge(self, replica: Replica) -> list[Outcome]:
        """Bring one replica to the desired state: re-plan before every step (a control call
        may have moved the desired state meanwhile), try each step at most once per call. The
        replica is READY when nothing is left; otherwise ``not_reconciled`` says why."""
        label = str(replica.index)
        outcomes: list[Outcome] = []
        tried: set[Action] = set()
        was = replica.status
        while replica.status is not Status.REMOVED:
            step = self._next_step(replica, tried)
            if step is None:
                break
            tried.add(step)
            outcome = await self.apply(replica, step)
            outcomes.append(outcome)
            if outcome.result in UNREACHED:
                break  # ejected; the next probe round decides when to try again
        plan = self.fleet.plan(replica)
        if plan.empty and replica.status in (Status.RECONCILING, Status.READY):
            if replica.status is Status.RECONCILING:
                if was in (Status.EJECTED, Status.PENDING) or any(
                    o.result == "ok" for o in outcomes
                ):
                    # It restarted or lost adapters: whatever the index thinks it cached is gone.
                    self.router.forget_replica(replica.index)
                self.fleet.mark_reconciled(replica.index)
                self.metrics.reconciliations.labels(label, "ok").inc()
                log.info(
                    "replica %d reconciled (%d actions) and ready", replica.index, len(outcomes)
                )
            replica.not_reconciled = None
        elif not plan.empty:
            failures = "; ".join(
                f"{o.action}: {o.describe()}" for o in outcomes if o.result not in APPLIED
            )
            replica.not_reconciled = f"still to do: {plan.describe()}" + (
                f" (last attempts: {failures})" if failures else ""
            )
            self.metrics.reconciliations.labels(label, "failed").inc()
            log.warning("replica %d not reconciled yet: %s", replica.index, replica.not_reconciled)
        self.metrics.replica_healthy.labels(label).set(1 if replica.status is Status.READY else 0)
        self.refresh_adapter_gauges()
        self.changes.notify()
        return outcomes

    def refresh_adapter_gauges(self) -> None:
        for r in self.fleet.members():
            label = str(r.index)
            self.metrics.adapters_loaded.labels(label).set(len(r.adapters))
            self.metrics.adapter_latest.labels(label).set(self.fleet.latest_version(r))
