"""Control plane: adapter load/unload, pause, resume, cache reset, broadcast to every replica in
service, in parallel, one operation at a time (a lock serialises them with each other and with
reconciliation, so a load can never interleave with a pause or a second load).

Semantics, per endpoint:

* load: all-or-nothing. A replica answering 404 "No adapter found" (its storage mount has not
  caught up with the trainer's rename) is retried every ``lora_retry_s`` until
  ``lora_load_timeout_s``. Any other failure, or the deadline, unloads the adapter from the
  replicas that did load it, and the error lists every replica's outcome. Never 404 (TRL reads a
  404 as "runtime LoRA updating disabled"); a mount that never caught up is 504.
* unload / reset_prefix_cache / resume: applied wherever possible; failures reported per replica
  and repaired by reconciliation (the desired state already says "unloaded"/"resumed").
* pause: all-or-nothing (replicas that paused are resumed if another could not pause).

A replica that cannot be reached at all is ejected rather than failing the broadcast: it takes
no traffic until reconciliation has brought it to the desired state, so the fleet that serves is
always consistent, and training is not killed by one dead replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.core.fleet import Fleet, Replica, Status, adapter_version
from proxy.core.router import Router
from proxy.errors import BroadcastFailed, InvalidRequest, UpstreamTimeout, UpstreamUnavailable
from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.upstream import ReplicaUnreachable, Upstream

log = logging.getLogger("rollout_proxy.control")

# Outcomes after which the replica was ejected: it serves nothing until reconciled, so the
# broadcast can succeed without it.
EJECTED = ("unreachable", "timeout")

# Upstream error bodies are echoed into our error message so operators see vLLM's reason;
# capped because a replica could answer with a multi-megabyte HTML page.
MAX_DETAIL_CHARS = 300


@dataclass
class Outcome:
    replica: int
    result: str  # ok | already_loaded | absent | failed | unreachable | timeout | mount_lag | ...
    http_status: int | None = None
    detail: str = ""
    attempts: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "result": self.result,
            "status": self.http_status,
            "detail": self.detail,
            "attempts": self.attempts,
        }

    def describe(self) -> str:
        text = f"replica {self.replica}: {self.result}"
        if self.http_status is not None:
            text += f" (HTTP {self.http_status})"
        if self.detail:
            text += f": {self.detail}"
        return text


@dataclass
class Reply:
    """What the HTTP layer sends back for a successful broadcast."""

    status: int
    body: Any
    media_type: str = "application/json"
    outcomes: list[Outcome] = field(default_factory=list)


def _detail(response: httpx.Response) -> str:
    try:
        payload = response.json()
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            return str(payload["error"].get("message", ""))[:MAX_DETAIL_CHARS]
        if isinstance(payload, dict) and "detail" in payload:
            return str(payload["detail"])[:MAX_DETAIL_CHARS]
    except ValueError:
        pass
    return response.text[:MAX_DETAIL_CHARS]


def _is_mount_lag(response: httpx.Response) -> bool:
    return response.status_code == 404 and "no adapter found" in response.text.lower()


def _is_already_loaded(response: httpx.Response) -> bool:
    return response.status_code == 400 and "already" in response.text.lower()


def parse_adapter_body(raw: bytes, need_path: bool) -> tuple[dict[str, Any], str, str | None]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("'lora_name' must be a non-empty string", param="lora_name")
    path = body.get("lora_path")
    if need_path and (not isinstance(path, str) or not path):
        raise InvalidRequest("'lora_path' must be a non-empty string", param="lora_path")
    return body, name, path if isinstance(path, str) else None


class ControlPlane:
    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        router: Router,
        upstream: Upstream,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        path_check: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        self.sleep = sleep
        self.path_check = path_check
        self.lock = asyncio.Lock()

    # -- helpers ----------------------------------------------------------------------------

    def _targets(self, endpoint: str) -> list[Replica]:
        targets = self.fleet.broadcast_targets()
        if not targets:
            raise UpstreamUnavailable(
                f"{endpoint}: no replica is in service "
                f"({', '.join(f'{r.index}={r.status.value}' for r in self.fleet.members())})"
            )
        return targets

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
                return
            self.note_failure(replica, reason)

    def _record(self, endpoint: str, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            self.metrics.broadcasts.labels(endpoint, str(o.replica), o.result).inc()

    def refresh_adapter_gauges(self) -> None:
        for r in self.fleet.members():
            label = str(r.index)
            self.metrics.adapters_loaded.labels(label).set(len(r.adapters))
            self.metrics.adapter_latest.labels(label).set(self.fleet.latest_version(r))

    async def _simple(
        self,
        replica: Replica,
        method: str,
        path: str,
        *,
        params: str | None = None,
        json_body: Any = None,
        ok_statuses: tuple[int, ...] = (200,),
        absent_ok: bool = False,
    ) -> Outcome:
        response = await self._send(replica, method, path, params=params, json_body=json_body)
        if isinstance(response, Outcome):
            return response
        if response.status_code in ok_statuses:
            return Outcome(replica.index, "ok", response.status_code, attempts=1)
        if absent_ok and response.status_code == 404:
            return Outcome(replica.index, "absent", 404, _detail(response), attempts=1)
        return Outcome(replica.index, "failed", response.status_code, _detail(response), 1)

    async def _send(
        self,
        replica: Replica,
        method: str,
        path: str,
        *,
        params: str | None = None,
        json_body: Any = None,
    ) -> httpx.Response | Outcome:
        """One control call. A replica that cannot be reached, or that does not answer within
        ``control_timeout_s``, is ejected (it will be reconciled before serving again) and
        reported as such, so one dead or wedged replica cannot fail a broadcast for the rest."""
        timeout = httpx.Timeout(
            self.settings.control_timeout_s, connect=self.settings.connect_timeout_s
        )
        if path == "/pause" and "mode=wait" in (params or ""):
            # mode=wait drains in-flight requests first: as long as the longest generation.
            timeout = httpx.Timeout(
                self.settings.upstream_timeout_s, connect=self.settings.connect_timeout_s
            )
        try:
            return await self.upstream.call(
                replica.index,
                replica.url,
                method,
                path,
                params=params,
                json=json_body,
                timeout=timeout,
            )
        except ReplicaUnreachable as exc:
            self.eject(replica, exc.message)
            return Outcome(replica.index, "unreachable", detail=exc.message, attempts=1)
        except UpstreamTimeout as exc:
            self.eject(replica, exc.message)
            return Outcome(replica.index, "timeout", detail=exc.message, attempts=1)
        except UpstreamUnavailable as exc:
            return Outcome(replica.index, "failed", detail=exc.message, attempts=1)

    # -- load -------------------------------------------------------------------------------

    async def _load_one(self, replica: Replica, body: dict[str, Any], deadline: float) -> Outcome:
        label = str(replica.index)
        attempts = 0
        while True:
            attempts += 1
            response = await self._send(replica, "POST", "/v1/load_lora_adapter", json_body=body)
            if isinstance(response, Outcome):
                self.metrics.load_attempts.labels(label, response.result).inc()
                response.attempts = attempts
                return response
            if response.status_code == 200:
                self.metrics.load_attempts.labels(label, "ok").inc()
                return Outcome(replica.index, "ok", 200, attempts=attempts)
            if _is_already_loaded(response):
                self.metrics.load_attempts.labels(label, "already_loaded").inc()
                return Outcome(replica.index, "already_loaded", 400, _detail(response), attempts)
            if _is_mount_lag(response):
                self.metrics.load_attempts.labels(label, "mount_lag").inc()
                if self.clock() + self.settings.lora_retry_s > deadline:
                    return Outcome(
                        replica.index, "mount_lag_timeout", 404, _detail(response), attempts
                    )
                self.metrics.mount_lag_retries.labels(label).inc()
                await self.sleep(self.settings.lora_retry_s)
                continue
            self.metrics.load_attempts.labels(label, "failed").inc()
            return Outcome(
                replica.index, "failed", response.status_code, _detail(response), attempts
            )

    async def load_adapter(self, raw: bytes) -> Reply:
        body, name, path = parse_adapter_body(raw, need_path=True)
        assert path is not None
        if self.path_check is not None:
            self.path_check(path)
        started = self.clock()
        async with self.lock:
            targets = self._targets("load_lora_adapter")
            deadline = started + self.settings.lora_load_timeout_s
            outcomes = await self._gather_load(targets, body, deadline)
            for o in outcomes:
                # "Already loaded" is success only if it is this very adapter (a repeated
                # publish, or a proxy restart); the same name at another path is a conflict.
                if o.result == "already_loaded" and (
                    self.fleet.replicas[o.replica].adapters.get(name) != path
                ):
                    o.result = "failed"
                    o.detail = f"name taken by another adapter path: {o.detail}"
            reachable = [o for o in outcomes if o.result not in EJECTED]
            good = [o for o in reachable if o.result in ("ok", "already_loaded")]
            if reachable and len(good) == len(reachable):
                self.fleet.published(name, path, [o.replica for o in good])
                self._record("load_lora_adapter", outcomes)
                self.metrics.publish_seconds.observe(self.clock() - started)
                self.refresh_adapter_gauges()
                log.info("adapter %s loaded on replicas %s", name, [o.replica for o in good])
                return Reply(
                    200,
                    f"Success: LoRA adapter '{name}' added successfully.",
                    "text/plain",
                    outcomes,
                )
            await self._rollback_load(name, outcomes)
            self._record("load_lora_adapter", outcomes)
            raise self._load_error(name, outcomes)

    async def _gather_load(
        self, targets: list[Replica], body: dict[str, Any], deadline: float
    ) -> list[Outcome]:
        """Run the per-replica loads; as soon as one fails for good, stop waiting for the
        others' storage mounts (the whole load will be rolled back anyway)."""
        tasks = {asyncio.ensure_future(self._load_one(r, body, deadline)): r for r in targets}
        results: dict[int, Outcome] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    outcome = task.result()
                    results[outcome.replica] = outcome
                if pending and any(
                    results[tasks[t].index].result not in ("ok", "already_loaded", *EJECTED)
                    for t in done
                ):
                    for other in pending:
                        other.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    for other in pending:
                        replica = tasks[other]
                        results[replica.index] = Outcome(
                            replica.index,
                            "cancelled",
                            detail="another replica failed first",
                            attempts=0,
                        )
                    pending = set()
        finally:
            for task in pending:
                task.cancel()
        return [results[r.index] for r in targets]

    async def _rollback_load(self, name: str, outcomes: list[Outcome]) -> None:
        # A "cancelled" replica may or may not have applied the load: unload it too (vLLM
        # answers 404 if it had not). Ejected ones are left to reconciliation, which unloads
        # whatever is not desired before they serve again.
        undo = [o for o in outcomes if o.result in ("ok", "cancelled")]
        if not undo:
            return
        results = await asyncio.gather(
            *(
                self._simple(
                    self.fleet.replicas[o.replica],
                    "POST",
                    "/v1/unload_lora_adapter",
                    json_body={"lora_name": name},
                    absent_ok=True,
                )
                for o in undo
            )
        )
        for o, undone in zip(undo, results, strict=True):
            if undone.result in ("ok", "absent"):
                o.result += ", rolled back"
                self.fleet.replicas[o.replica].adapters.pop(name, None)
            else:
                o.result += ", ROLLBACK FAILED"
                o.detail = (o.detail + "; " if o.detail else "") + undone.describe()
                # The replica may now hold an adapter the fleet does not want: reconcile it.
                replica = self.fleet.replicas[o.replica]
                replica.needs_reconcile = True

    def _load_error(self, name: str, outcomes: list[Outcome]) -> BroadcastFailed | UpstreamTimeout:
        summary = "; ".join(o.describe() for o in outcomes)
        message = f"adapter {name!r} was not loaded on the fleet (all-or-nothing): {summary}"
        details = [o.as_dict() for o in outcomes]
        if any(o.result.startswith("mount_lag_timeout") for o in outcomes):
            return UpstreamTimeout(
                message + f". The adapter path did not become readable within "
                f"{self.settings.lora_load_timeout_s:g}s (PROXY_LORA_LOAD_TIMEOUT_S).",
                param="lora_path",
                details=details,
            )
        failed = {o.http_status for o in outcomes if o.result.startswith("failed")}
        status = 502
        if len(failed) == 1:
            only = failed.pop()
            # Same verdict everywhere (e.g. 500 for a rank above --max-lora-rank, 400 for a bad
            # path): pass it on. Never 404: TRL would blame VLLM_ALLOW_RUNTIME_LORA_UPDATING.
            if only is not None and only != 404 and 400 <= only < 600:
                status = only
        return BroadcastFailed(message, status_code=status, param="lora_name", details=details)

    # -- unload -----------------------------------------------------------------------------

    async def unload_adapter(self, raw: bytes) -> Reply:
        _, name, _ = parse_adapter_body(raw, need_path=False)
        async with self.lock:
            targets = self._targets("unload_lora_adapter")
            outcomes = list(
                await asyncio.gather(
                    *(
                        self._simple(
                            r,
                            "POST",
                            "/v1/unload_lora_adapter",
                            json_body={"lora_name": name},
                            absent_ok=True,
                        )
                        for r in targets
                    )
                )
            )
            done = [o.replica for o in outcomes if o.result in ("ok", "absent")]
            self.fleet.unpublished(name, done)
            self.router.purge_model(name)
            self._record("unload_lora_adapter", outcomes)
            self.refresh_adapter_gauges()
            return self._partial_reply(
                "unload_lora_adapter",
                outcomes,
                success=Reply(
                    200,
                    f"Success: LoRA adapter '{name}' removed successfully.",
                    "text/plain",
                    outcomes,
                ),
                all_absent_status=404,
                name=name,
            )

    def _partial_reply(
        self,
        endpoint: str,
        outcomes: list[Outcome],
        success: Reply,
        all_absent_status: int | None = None,
        name: str = "",
    ) -> Reply:
        failed = [o for o in outcomes if o.result not in ("ok", "absent", *EJECTED)]
        if failed or all(o.result in EJECTED for o in outcomes):
            summary = "; ".join(o.describe() for o in outcomes)
            raise BroadcastFailed(
                f"{endpoint} did not apply on every replica (the rest is repaired by "
                f"reconciliation): {summary}",
                details=[o.as_dict() for o in outcomes],
            )
        if all_absent_status and all(o.result == "absent" for o in outcomes):
            # vLLM's own answer for an unknown adapter; TRL ignores unload responses.
            return Reply(
                all_absent_status,
                {
                    "error": {
                        "message": f"The lora adapter '{name}' cannot be found.",
                        "type": "NotFoundError",
                        "param": "lora_name",
                        "code": 404,
                    }
                },
                outcomes=outcomes,
            )
        return success

    # -- pause / resume / reset -------------------------------------------------------------

    async def pause(self, query: str) -> Reply:
        async with self.lock:
            targets = self._targets("pause")
            outcomes = list(
                await asyncio.gather(
                    *(self._simple(r, "POST", "/pause", params=query) for r in targets)
                )
            )
            if "clear_cache=false" not in query.lower():
                self.router.purge_all()  # vLLM resets the prefix cache on pause by default
            paused = [o for o in outcomes if o.result == "ok"]
            bad = [o for o in outcomes if o.result not in ("ok", *EJECTED)]
            if bad or not paused:
                undone = await asyncio.gather(
                    *(
                        self._simple(self.fleet.replicas[o.replica], "POST", "/resume")
                        for o in paused
                    )
                )
                for o, u in zip(paused, undone, strict=True):
                    o.result = "ok, rolled back" if u.result == "ok" else "ok, RESUME FAILED"
                    if u.result != "ok":
                        self.fleet.replicas[o.replica].paused = True
                self._record("pause", outcomes)
                raise BroadcastFailed(
                    "pause did not apply on every replica; the replicas that paused were "
                    "resumed: " + "; ".join(o.describe() for o in outcomes),
                    details=[o.as_dict() for o in outcomes],
                )
            for o in paused:
                self.fleet.replicas[o.replica].paused = True
            self.fleet.desired_paused = True
            self.fleet.pause_query = query
            self._record("pause", outcomes)
            return Reply(200, {"status": "paused"}, outcomes=outcomes)

    async def resume(self) -> Reply:
        async with self.lock:
            targets = self._targets("resume")
            outcomes = list(
                await asyncio.gather(*(self._simple(r, "POST", "/resume") for r in targets))
            )
            self.fleet.desired_paused = False
            for o in outcomes:
                if o.result == "ok":
                    self.fleet.replicas[o.replica].paused = False
            self._record("resume", outcomes)
            return self._partial_reply(
                "resume", outcomes, Reply(200, {"status": "resumed"}, outcomes=outcomes)
            )

    async def reset_prefix_cache(self, query: str) -> Reply:
        async with self.lock:
            targets = self._targets("reset_prefix_cache")
            outcomes = list(
                await asyncio.gather(
                    *(self._simple(r, "POST", "/reset_prefix_cache", params=query) for r in targets)
                )
            )
            self.router.purge_all()
            self._record("reset_prefix_cache", outcomes)
            return self._partial_reply(
                "reset_prefix_cache", outcomes, Reply(200, {"status": "ok"}, outcomes=outcomes)
            )

    # -- reconciliation (called by the health loop, under the lock) -------------------------

    async def apply_plan(self, replica: Replica) -> list[Outcome]:
        """Bring one replica to the desired state. Caller holds ``self.lock`` and has just
        refreshed the replica's observed adapters."""
        plan = self.fleet.plan(replica)
        outcomes: list[Outcome] = []
        for name in plan.unload:
            o = await self._simple(
                replica,
                "POST",
                "/v1/unload_lora_adapter",
                json_body={"lora_name": name},
                absent_ok=True,
            )
            if o.result in ("ok", "absent"):
                replica.adapters.pop(name, None)
            outcomes.append(o)
        deadline = self.clock() + self.settings.lora_load_timeout_s
        for name, path in sorted(
            plan.load.items(), key=lambda kv: (adapter_version(kv[0]) or 0, kv[0])
        ):
            o = await self._load_one(replica, {"lora_name": name, "lora_path": path}, deadline)
            if o.result in ("ok", "already_loaded"):
                replica.adapters[name] = path
            outcomes.append(o)
        if plan.pause is True:
            o = await self._simple(replica, "POST", "/pause", params=plan.pause_query)
            replica.paused = replica.paused or o.result == "ok"
            outcomes.append(o)
        elif plan.pause is False:
            o = await self._simple(replica, "POST", "/resume")
            replica.paused = replica.paused and o.result != "ok"
            outcomes.append(o)
        return outcomes
