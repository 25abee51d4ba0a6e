"""TRL's merged-weight sync (vLLM weight transfer) through the proxy to every replica; the
calls, answers and faults: docs/merged-weights.md.

The replicas form one process group with the trainer (rank 0), each at its own ``rank_offset``
(proxy/core/weights.py ``seats``). 200 only when every seated replica applied the call, else an
OpenAI-shaped error naming each replica's outcome. Each replica call is bounded by
PROXY_CONTROL_TIMEOUT_S; calls are serialised with the other control calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.control import ControlPlane, Reply, parse_object
from proxy.core.fleet import Fleet, Replica, Status
from proxy.core.weights import ENDPOINTS, WeightBook, check_version, parse_world_size, seats
from proxy.errors import (
    BroadcastFailed,
    Conflict,
    InvalidRequest,
    ProxyError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.metrics import Metrics
from proxy.reconciler import Outcome as CallOutcome
from proxy.settings import Settings
from proxy.upstream import Upstream

log = logging.getLogger("rollout_proxy.weights")


@dataclass
class Outcome(CallOutcome):
    """``result``: ok | failed | timeout | unreachable | refused | invalid | removed."""

    extra: dict[str, Any] | None = None  # listed beside the result (world size, seat)
    value: Any = None  # the parsed answer where the caller needs it (world size)

    @property
    def ok(self) -> bool:
        return self.result == "ok"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "replica": self.replica,
            "result": self.result,
            "http_status": self.http_status,
        }
        if self.detail:
            out["detail"] = self.detail
        if self.extra:
            out.update(self.extra)
        return out


def _int_field(info: dict[str, Any], name: str, low: int) -> int:
    value = info.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequest(f"'init_info.{name}' must be an integer >= {low}", param=name)
    return value


@dataclass(eq=False, repr=False)
class WeightSync:
    settings: Settings
    fleet: Fleet
    upstream: Upstream
    control: ControlPlane
    metrics: Metrics

    @property
    def book(self) -> WeightBook:
        return self.fleet.weights

    # -- one call to each replica --------------------------------------------------------------

    async def _call(
        self, replica: Replica, method: str, path: str, body: Any, params: str | None
    ) -> tuple[Outcome, httpx.Response | None]:
        if replica.status is Status.REMOVED:
            detail = "removed from the fleet; its ranks cannot take part in the group"
            return Outcome(replica.index, "removed", None, detail), None
        limit = self.settings.control_timeout_s
        timeout = httpx.Timeout(limit, connect=min(self.settings.connect_timeout_s, limit))
        try:
            # asyncio.timeout bounds the whole call (httpx's bounds each read), so a replica
            # that trickles bytes cannot hold the answer past PROXY_CONTROL_TIMEOUT_S either.
            async with asyncio.timeout(limit):
                response = await self.upstream.call(
                    replica.index,
                    replica.url,
                    method,
                    path,
                    json=body,
                    params=params,
                    timeout=timeout,
                )
        except TimeoutError:
            detail = f"no answer within {limit:g}s (PROXY_CONTROL_TIMEOUT_S)"
            return Outcome(replica.index, "timeout", None, detail), None
        except UpstreamTimeout as exc:
            return Outcome(replica.index, "timeout", None, exc.message), None
        except ProxyError as exc:
            return Outcome(replica.index, "unreachable", None, exc.message), None
        status = response.status_code
        if status == 200:
            return Outcome(replica.index, "ok", 200), response
        detail = response.text[:300]
        if status == 404:
            detail = (
                f"{path} not found: the replica needs VLLM_SERVER_DEV_MODE=1 and "
                '--weight-transfer-config \'{"backend": "nccl"}\''
            )
        return Outcome(replica.index, "refused" if status < 500 else "failed", status, detail), None

    async def _fan(
        self,
        replicas: list[Replica],
        method: str,
        path: str,
        bodies: dict[int, Any] | None = None,
        params: str | None = None,
    ) -> list[tuple[Outcome, httpx.Response | None]]:
        calls = (
            self._call(r, method, path, bodies.get(r.index) if bodies else None, params)
            for r in replicas
        )
        results = await asyncio.gather(*calls)
        for o, _ in results:
            self.metrics.broadcasts.labels(path.lstrip("/"), str(o.replica), o.result).inc()
        return results

    # -- answers --------------------------------------------------------------------------------

    def _refusal(self, endpoint: str, what: str, outcomes: list[Outcome]) -> ProxyError:
        failed = [o for o in outcomes if not o.ok]
        message = f"{endpoint}: {what}: " + "; ".join(o.describe() for o in failed)
        details = [o.as_dict() for o in outcomes]
        if any(o.result == "timeout" for o in failed):
            return UpstreamTimeout(message, details=details)
        if all(o.result == "unreachable" for o in failed):
            return UpstreamUnavailable(message, status_code=503, details=details)
        return BroadcastFailed(message, status_code=502, details=details)

    def _seated(self) -> list[Replica]:
        if not self.book.active:
            raise Conflict(
                "no weight-transfer group was formed through this proxy: call "
                "/init_weight_transfer_engine first (after a proxy restart the trainer must "
                "form a new group: start a new run)"
            )
        return [r for r in self.fleet.replicas if r.weights.seat is not None]

    def refresh_gauges(self) -> None:
        for r in self.fleet.members():
            label = str(r.index)
            self.metrics.weight_seq.labels(label).set(r.weights.seq)
            self.metrics.weights_stale.labels(label).set(0 if r.weights.ok else 1)

    @asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """Serialised with the control calls, and counted among them (``control.in_flight``)."""
        async with self.control.serialised():
            try:
                yield
            finally:
                self.refresh_gauges()

    # -- /get_world_size ------------------------------------------------------------------------

    async def _world_sizes(
        self, endpoint: str, query: str
    ) -> tuple[list[Outcome], list[tuple[int, int]]]:
        """Every member's world size, kept in ``book.sizes`` for the group's seats; refused when
        none answered one. A query (vLLM's include_dp) is passed on as is; TRL sends none."""
        members = self.fleet.members()
        results = await self._fan(members, "GET", "/get_world_size", None, query or None)
        for o, response in results:
            if response is not None:
                try:
                    o.value = parse_world_size(response.json())
                    o.extra = {"world_size": o.value}
                except ValueError as exc:
                    o.result, o.detail = "invalid", f"/get_world_size answer: {exc}"
        outcomes = [o for o, _ in results]
        sizes = [(o.replica, o.value) for o in outcomes if o.ok]
        if not sizes:
            raise self._refusal(endpoint, "no replica reported its world size", outcomes)
        self.book.sizes = sizes
        return outcomes, sizes

    async def get_world_size(self, query: str) -> Reply:
        async with self._exclusive():
            outcomes, sizes = await self._world_sizes("get_world_size", query)
        total = sum(size for _, size in sizes)
        return Reply(200, {"world_size": total, "replicas": [o.as_dict() for o in outcomes]})

    # -- /init_weight_transfer_engine ------------------------------------------------------------

    async def init(self, raw: bytes) -> Reply:
        body = parse_object(raw)
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise InvalidRequest("'init_info' must be a JSON object", param="init_info")
        base = _int_field(info, "rank_offset", 0)
        world_size = _int_field(info, "world_size", 1)
        endpoint = "init_weight_transfer_engine"
        async with self._exclusive():
            sizes = self.book.sizes or (await self._world_sizes(endpoint, ""))[1]
            group, total = seats(sizes, base)
            if world_size != total:
                raise InvalidRequest(
                    f"init_weight_transfer_engine: world_size {world_size} does not match the "
                    f"fleet's group: rank_offset {base} + replicas' world sizes "
                    f"{[s for _, s in sizes]} = {total} (ask /get_world_size again)",
                    param="world_size",
                )
            replicas = [self.fleet.replicas[s.replica] for s in group]
            bodies = {
                s.replica: {**body, "init_info": {**info, "rank_offset": s.rank_offset}}
                for s in group
            }
            results = await self._fan(replicas, "POST", "/" + endpoint, bodies)
            outcomes = [o for o, _ in results]
            for o, seat in zip(outcomes, group, strict=True):
                o.extra = {"rank_offset": seat.rank_offset, "world_size": seat.world_size}
            if not all(o.ok for o in outcomes):
                raise self._refusal(
                    endpoint, "the group was not formed (no routing change)", outcomes
                )
            master = info.get("master_address")
            port = info.get("master_port")
            where = f"{master}:{port}" if isinstance(master, str) else None
            self.book.form(self.fleet.weight_states(), group, total, where)
            self.book.sizes = None  # the next group asks again
            log.info("weight-transfer group formed: world size %d, seats %s", total, group)
            return Reply(
                200,
                {
                    "message": "Weight transfer initialized",
                    "world_size": total,
                    "replicas": [o.as_dict() for o in outcomes],
                },
            )

    # -- start / update / finish -----------------------------------------------------------------

    async def _step(
        self, step: str, message: str, body: dict[str, Any], given: str | None = None
    ) -> Reply:
        """One step to every seated replica (``given``: the trainer's label for a finish)."""
        endpoint = ENDPOINTS[step]
        async with self._exclusive():
            seated = self._seated()
            if step == "finish":
                body["weight_version"] = label = self.book.next_label(given)
            bodies = {r.index: body for r in seated}
            outcomes = [o for o, _ in await self._fan(seated, "POST", "/" + endpoint, bodies)]
            for o in outcomes:
                w = self.fleet.replicas[o.replica].weights
                self.book.record(w, step, None if o.ok else o.describe())
            extra: dict[str, Any] = {}
            if step == "finish":
                serving = self.book.finish(self.fleet.weight_states(), label)
                extra = {"weight_version": label if serving else None, "serving": serving}
        if not all(o.ok for o in outcomes):
            what = "not applied on every replica; those that failed take no traffic"
            if step == "finish":
                what += f" (replicas {extra['serving']} serve weight version {label})"
            raise self._refusal(endpoint, what, outcomes)
        return Reply(
            200, {"message": message, **extra, "replicas": [o.as_dict() for o in outcomes]}
        )

    async def start(self, raw: bytes) -> Reply:
        body = parse_object(raw, optional=True)
        return await self._step("start", "Weight update started", body)

    async def update(self, raw: bytes) -> Reply:
        body = parse_object(raw)
        if not isinstance(body.get("update_info"), dict | list):
            raise InvalidRequest("'update_info' must be a JSON object or list", param="update_info")
        return await self._step("update", "Weights updated", body)

    async def finish(self, raw: bytes) -> Reply:
        body = parse_object(raw, optional=True)
        try:
            given = check_version(body.get("weight_version"))
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="weight_version") from None
        return await self._step("finish", "Weight update finished", body, given)
