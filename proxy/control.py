"""TRL's control calls: adapter load/unload, pause, resume, cache reset.

Each call records the desired state first (``Fleet.desired_*``), then applies its action to every
member replica in parallel through the reconciler, one call at a time and never waiting for the
health loop. ``reconciler.verdict`` answers every endpoint; load and pause are all-or-nothing (a
refused one restores the previous desired state and rolls back the replicas that applied it).
docs/reliability.md has the whole contract.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from proxy.errors import (
    BroadcastFailed,
    InvalidRequest,
    ProxyError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.reconciler import APPLIED, Action, Outcome, Reconciler, Verdict, verdict

log = logging.getLogger("rollout_proxy.control")


@dataclass
class Reply:
    """What the HTTP layer sends back for a successful broadcast."""

    status: int
    body: Any
    media_type: str = "application/json"


def parse_object(raw: bytes, *, optional: bool = False) -> dict[str, Any]:
    """A control call's JSON object body (``optional``: an empty body is ``{}``)."""
    if optional and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def parse_adapter_body(raw: bytes, need_path: bool) -> tuple[dict[str, Any], str, str | None]:
    body = parse_object(raw)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("'lora_name' must be a non-empty string", param="lora_name")
    path = body.get("lora_path")
    if need_path and (not isinstance(path, str) or not path):
        raise InvalidRequest("'lora_path' must be a non-empty string", param="lora_path")
    return body, name, path if isinstance(path, str) else None


class ControlPlane:
    """The control endpoints over the one ``Reconciler`` (which owns the fleet, router, upstream
    and clock they act through)."""

    def __init__(
        self, reconciler: Reconciler, *, path_check: Callable[[str], None] | None = None
    ) -> None:
        self.reconciler = reconciler
        self.fleet = reconciler.fleet
        self.router = reconciler.router
        self.path_check = path_check
        self.lock = asyncio.Lock()  # control calls, one at a time (the health loop never takes it)
        self.in_flight = 0  # control calls under way: the health loop leaves READY replicas alone

    @asynccontextmanager
    async def serialised(self) -> AsyncIterator[None]:
        async with self.lock:
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1
                self.reconciler.changes.notify()  # desired state moved: waiting rollouts re-check

    async def _broadcast(
        self, endpoint: str, action: Action, deadline: float | None = None
    ) -> tuple[list[Outcome], Verdict]:
        targets = self.fleet.broadcast_targets()
        outcomes = list(
            await asyncio.gather(*(self.reconciler.apply(r, action, deadline) for r in targets))
        )
        result = verdict(outcomes)
        if result.success:
            # Failed on their own side while the rest applied it: out of service until the
            # health loop has brought them to the desired state.
            for o in result.failed:
                self.reconciler.eject(
                    self.fleet.replicas[o.replica], f"{endpoint} failed: {o.describe()}"
                )
        for o in outcomes:
            self.reconciler.metrics.broadcasts.labels(endpoint, str(o.replica), o.result).inc()
        return outcomes, result

    async def _undo(self, applied: list[Outcome], action: Action) -> list[Outcome]:
        """``action`` on every replica in ``applied`` (a refused call's rollback)."""
        replicas = self.fleet.replicas
        return list(
            await asyncio.gather(
                *(self.reconciler.apply(replicas[o.replica], action) for o in applied)
            )
        )

    def _refusal(self, endpoint: str, what: str, outcomes: list[Outcome], v: Verdict) -> ProxyError:
        """The error for a refused call; TRL retries none, and reads a 404 on load as "runtime
        LoRA updating disabled", so a replica's 4xx is passed on as is but never as 404."""
        message = f"{endpoint}: {what}: {'; '.join(o.describe() for o in outcomes)}"
        details = [o.as_dict() for o in outcomes]
        if v.refused:
            statuses = {o.http_status for o in v.refused}
            status = statuses.pop() if len(statuses) == 1 else 400
            if status is None or status == 404 or not 400 <= status < 500:
                status = 400
            return BroadcastFailed(message, status_code=status, details=details)
        if v.failed and all(o.result == "mount_lag_timeout" for o in v.failed):
            return UpstreamTimeout(
                message + f". The adapter path did not become readable within "
                f"{self.reconciler.settings.lora_load_timeout_s:g}s (PROXY_LORA_LOAD_TIMEOUT_S).",
                param="lora_path",
                details=details,
            )
        if v.failed:
            return BroadcastFailed(message, status_code=502, details=details)
        return UpstreamUnavailable(message, status_code=503, details=details)

    async def load_adapter(self, raw: bytes) -> Reply:
        body, name, path = parse_adapter_body(raw, need_path=True)
        assert path is not None
        if self.path_check is not None:
            self.path_check(path)
        async with self.serialised():
            started = self.reconciler.clock()
            previous = self.fleet.desired_adapters.get(name)
            if previous is not None and previous != path and not body.get("load_inplace"):
                raise BroadcastFailed(
                    f"load_lora_adapter: adapter {name!r} is already published with another "
                    f"path ({previous}); pass load_inplace to replace it",
                    status_code=400,
                    param="lora_name",
                )
            self.fleet.desired_adapters[name] = path  # desired first, then applied
            extra = {k: v for k, v in body.items() if k not in ("lora_name", "lora_path")}
            action = Action("load", name=name, path=path, body=extra)
            deadline = started + self.reconciler.settings.lora_load_timeout_s
            outcomes, v = await self._broadcast("load_lora_adapter", action, deadline)
            if not v.success:
                await self._undo_load(name, previous, v)
                self.reconciler.refresh_adapter_gauges()
                raise self._refusal(
                    "load_lora_adapter",
                    f"adapter {name!r} was not loaded on the fleet (all-or-nothing; rolled back)",
                    outcomes,
                    v,
                )
            self.reconciler.metrics.publish_seconds.observe(self.reconciler.clock() - started)
            self.reconciler.refresh_adapter_gauges()
            log.info("adapter %s loaded on replicas %s", name, [o.replica for o in v.applied])
            return Reply(200, f"Success: LoRA adapter '{name}' added successfully.", "text/plain")

    async def _undo_load(self, name: str, previous: str | None, v: Verdict) -> None:
        if previous is None:
            self.fleet.desired_adapters.pop(name, None)
        else:
            self.fleet.desired_adapters[name] = previous
        undo = [o for o in v.applied if o.result == "ok"]
        results = await self._undo(undo, Action("unload", name=name))
        for o, undone in zip(undo, results, strict=True):
            if undone.result in APPLIED:
                o.result += ", rolled back"
            else:
                o.result += ", ROLLBACK FAILED"
                o.detail = (o.detail + "; " if o.detail else "") + undone.describe()

    async def unload_adapter(self, raw: bytes) -> Reply:
        _, name, _ = parse_adapter_body(raw, need_path=False)
        async with self.serialised():
            self.fleet.desired_adapters.pop(name, None)
            self.router.purge_model(name)
            outcomes, v = await self._broadcast("unload_lora_adapter", Action("unload", name=name))
            self.reconciler.refresh_adapter_gauges()
            if not v.success:
                raise self._refusal(
                    "unload_lora_adapter",
                    "not applied by any replica (reconciliation unloads it later)",
                    outcomes,
                    v,
                )
            if all(o.result == "absent" for o in v.applied) and not v.failed:
                # vLLM's own answer for an unknown adapter; TRL ignores unload responses.
                message = f"The lora adapter '{name}' cannot be found."
                error = {
                    "message": message,
                    "type": "NotFoundError",
                    "param": "lora_name",
                    "code": 404,
                }
                return Reply(404, {"error": error})
            return Reply(200, f"Success: LoRA adapter '{name}' removed successfully.", "text/plain")

    async def pause(self, query: str) -> Reply:
        async with self.serialised():
            was_paused, was_query = self.fleet.desired_paused, self.fleet.pause_query
            self.fleet.desired_paused, self.fleet.pause_query = True, query
            outcomes, v = await self._broadcast("pause", Action("pause", query=query))
            if "clear_cache=false" not in query.lower():
                self.router.purge_all()  # vLLM resets the prefix cache on pause by default
            if not v.success:
                self.fleet.desired_paused, self.fleet.pause_query = was_paused, was_query
                if not was_paused:
                    undone = await self._undo(v.applied, Action("resume"))
                    for o, u in zip(v.applied, undone, strict=True):
                        o.result = "ok, rolled back" if u.result == "ok" else "ok, RESUME FAILED"
                raise self._refusal("pause", "not applied (all-or-nothing)", outcomes, v)
            return Reply(200, {"status": "paused"})

    async def resume(self) -> Reply:
        async with self.serialised():
            self.fleet.desired_paused = False
            outcomes, v = await self._broadcast("resume", Action("resume"))
            if not v.success:
                raise self._refusal(
                    "resume", "not applied (reconciliation keeps trying)", outcomes, v
                )
            return Reply(200, {"status": "resumed"})

    async def reset_prefix_cache(self, query: str) -> Reply:
        async with self.serialised():
            outcomes, v = await self._broadcast("reset_prefix_cache", Action("reset", query=query))
            self.router.purge_all()
            if not v.success:
                raise self._refusal("reset_prefix_cache", "not applied", outcomes, v)
            return Reply(200, {"status": "ok"})
