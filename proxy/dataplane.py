"""Data plane: route one completion to one replica and relay the answer.

Retry rule. Completions are a pure function of their body (TRL even sends a ``seed``) and have no
side effect on the replica, so a completion may be re-sent to another eligible replica when the
first attempt produced nothing for the client: the connection was refused (nothing sent), the
connection broke before response headers arrived, the replica answered 404 for an adapter it
was believed to hold (it restarted; it is sent for reconciliation), or it answered 500/502/503
(its engine failed; another may not). Each replica is tried at most once per request, and the
last replica's answer is relayed when every eligible one failed. Timeouts are not retried (that
would double an already long wait), and nothing is retried once a single response byte has been
relayed to the client. Control-plane calls are never retried here; they have their own
semantics (control.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from proxy.core.extract import RoutingKey
from proxy.core.fleet import Fleet, Replica, Status
from proxy.core.policy import Decision
from proxy.core.router import Router
from proxy.errors import ModelNotFound, UpstreamUnavailable
from proxy.metrics import Metrics, status_label
from proxy.upstream import ReplicaBroken, ReplicaUnreachable, Upstream

log = logging.getLogger("rollout_proxy.dataplane")

# Response headers worth relaying; everything else (hop-by-hop, server, date, content-length
# which Starlette recomputes) is dropped.
RELAYED_HEADERS = ("content-type", "x-request-id", "cache-control")
# Engine failures worth trying on another replica (504 is a timeout: retrying doubles the wait).
RETRIED_STATUSES = frozenset({500, 502, 503})


def _relay_headers(response: httpx.Response, replica: int, request_id: str) -> dict[str, str]:
    headers = {k: response.headers[k] for k in RELAYED_HEADERS if k in response.headers}
    headers["x-proxy-replica"] = str(replica)
    headers["x-request-id"] = request_id
    return headers


def _lost_adapter(response: httpx.Response, model: str) -> bool:
    return (
        response.status_code == 404
        and "does not exist" in response.text
        and model in (response.text)
    )


class DataPlane:
    def __init__(
        self,
        fleet: Fleet,
        router: Router,
        upstream: Upstream,
        metrics: Metrics,
        eject: Callable[[Replica, str], None],
        routing_error: Callable[[], str | None],
    ) -> None:
        self.fleet = fleet
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.eject = eject
        self.routing_error = routing_error

    def _no_replica(self, model: str, tried: set[int]) -> Exception:
        if not self.fleet.is_base_model(model) and not self.fleet.known_anywhere(model):
            return ModelNotFound(f"The model `{model}` does not exist.", param="model")
        states = ", ".join(f"{r.index}={r.status.value}" for r in self.fleet.members())
        if tried:
            return UpstreamUnavailable(
                f"every eligible replica failed for model `{model}` (tried {sorted(tried)}; "
                f"replicas: {states})"
            )
        return UpstreamUnavailable(
            f"no replica in service has model `{model}` loaded yet (replicas: {states}); "
            "retry shortly",
            status_code=503,
        )

    def _track(self, replica: Replica, delta: int) -> None:
        replica.in_flight += delta
        self.metrics.inflight.labels(str(replica.index)).set(replica.in_flight)

    async def forward(
        self, route: str, path: str, raw: bytes, key: RoutingKey, request_id: str, started: float
    ) -> Response:
        problem = self.routing_error()
        if problem:
            raise UpstreamUnavailable(problem)
        tried: set[int] = set()
        headers = {"content-type": "application/json", "x-request-id": request_id}
        lora_path = self.fleet.lora_path(key.model)
        while True:
            eligible = [r for r in self.fleet.eligible(key.model) if r.index not in tried]
            if not eligible:
                raise self._no_replica(key.model, tried)
            decision = self.router.route(
                key, [(r.index, r.in_flight + r.queue_depth) for r in eligible], lora_path
            )
            self.metrics.decisions.labels(decision.outcome).inc()
            self.metrics.matched_blocks.observe(decision.matched_blocks)
            replica = self.fleet.replicas[decision.replica]
            tried.add(replica.index)
            label = str(replica.index)
            self._track(replica, +1)
            sent_at = time.perf_counter()
            routed = sent_at - started
            try:
                if key.stream:
                    response = await self.upstream.open_stream(
                        replica.index, replica.url, path, raw, headers
                    )
                else:
                    response = await self.upstream.call(
                        replica.index, replica.url, "POST", path, content=raw, headers=headers
                    )
            except ReplicaUnreachable as exc:
                self._track(replica, -1)
                self.eject(replica, exc.message)
                continue
            except ReplicaBroken as exc:
                self._track(replica, -1)
                log.warning("request %s: %s; retrying elsewhere", request_id, exc.message)
                continue
            except BaseException:
                self._track(replica, -1)
                raise
            if _lost_adapter(response, key.model) and lora_path is not None:
                await response.aclose()
                self._track(replica, -1)
                replica.adapters.pop(key.model, None)
                if replica.status is Status.READY:
                    replica.status = Status.RECONCILING
                replica.needs_reconcile = True
                log.warning(
                    "replica %d lost adapter %s; reconciling it, retrying elsewhere",
                    replica.index,
                    key.model,
                )
                continue
            if response.status_code in RETRIED_STATUSES and any(
                r.index not in tried for r in self.fleet.eligible(key.model)
            ):
                await response.aclose()
                self._track(replica, -1)
                self.metrics.requests.labels(route, label, status_label(response.status_code)).inc()
                log.warning(
                    "request %s: replica %d answered %d; retrying elsewhere",
                    request_id,
                    replica.index,
                    response.status_code,
                )
                continue
            if key.stream:
                return self._stream(route, replica, response, request_id, sent_at, routed)
            upstream_s = time.perf_counter() - sent_at
            self._track(replica, -1)
            self.metrics.upstream_seconds.labels(route, label).observe(upstream_s)
            self.metrics.requests.labels(route, label, status_label(response.status_code)).inc()
            if response.status_code == 200 and key.tokens is not None and key.num_prompts == 1:
                self._remember_completion(key, decision, response.content, lora_path)
            result = Response(
                response.content,
                response.status_code,
                _relay_headers(response, replica.index, request_id),
            )
            self.metrics.proxy_seconds.labels(route).observe(
                time.perf_counter() - started - upstream_s
            )
            return result

    def _remember_completion(
        self, key: RoutingKey, decision: Decision, content: bytes, lora_path: str | None
    ) -> None:
        """Index ``prompt + completion`` on the replica that generated it (TRL always asks for
        ``return_token_ids``; without them there is nothing to remember)."""
        if b'"token_ids"' not in content:
            return
        try:
            choices = orjson.loads(content).get("choices")
            if isinstance(choices, list) and len(choices) == 1:
                generated = choices[0].get("token_ids")
                if isinstance(generated, list) and generated:
                    self.router.record_completion(key, decision, generated, lora_path)
        except (orjson.JSONDecodeError, AttributeError, TypeError, OverflowError) as exc:
            # A malformed answer is the client's to see; routing just learns nothing from it.
            log.debug("could not index a completion: %s", exc)

    def _stream(
        self,
        route: str,
        replica: Replica,
        response: httpx.Response,
        request_id: str,
        sent_at: float,
        routed: float,
    ) -> StreamingResponse:
        label = str(replica.index)

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in response.aiter_raw():
                yield chunk

        async def finish() -> None:
            await response.aclose()

        done = False

        def account(_: Any = None) -> None:
            nonlocal done
            if done:
                return
            done = True
            self._track(replica, -1)
            self.metrics.upstream_seconds.labels(route, label).observe(
                time.perf_counter() - sent_at
            )
            self.metrics.requests.labels(route, label, status_label(response.status_code)).inc()
            self.metrics.proxy_seconds.labels(route).observe(routed)

        async def guarded() -> AsyncIterator[bytes]:
            # Runs when the client finishes *or* goes away (Starlette cancels the iteration on
            # disconnect): either way the upstream stream is closed and in-flight released.
            try:
                async for chunk in relay():
                    yield chunk
            finally:
                account()
                await response.aclose()

        return StreamingResponse(
            guarded(),
            response.status_code,
            _relay_headers(response, replica.index, request_id),
            background=BackgroundTask(finish),
        )
