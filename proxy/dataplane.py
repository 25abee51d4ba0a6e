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

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from proxy.core.extract import RoutingKey
from proxy.core.fleet import Fleet, Replica, Status
from proxy.core.policy import Decision
from proxy.core.router import Router
from proxy.errors import ModelNotFound, UpstreamUnavailable
from proxy.metrics import Metrics
from proxy.pool import Relay, Reply
from proxy.security.guard import Guard
from proxy.upstream import ReplicaBroken, ReplicaUnreachable

if TYPE_CHECKING:
    from proxy.kv_events import KvEvents

log = logging.getLogger("rollout_proxy.dataplane")

# Response headers worth relaying; everything else (hop-by-hop, server, date, content-length
# which Starlette recomputes) is dropped.
RELAYED_HEADERS = ("content-type", "x-request-id", "cache-control")
# Engine failures worth trying on another replica (504 is a timeout: retrying doubles the wait).
RETRIED_STATUSES = frozenset({500, 502, 503})
# Retry-After of the 503 for a model no replica can serve yet: one probe round (2 s) and a
# load retry (PROXY_LORA_RETRY_S, 2 s) from now the fleet may have changed.
NO_REPLICA_RETRY_AFTER_S = 2


async def send_whole(
    send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview
) -> None:
    """An answer sent whole as two ASGI messages (``headers`` include its content-length). Under
    uvicorn a completion is answered by proxy/front.py in one write; this is the ASGI path's."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _relay_headers(
    reply: Reply, replica: int, request_id: str, weight_version: bytes | None = None
) -> list[tuple[bytes, bytes]]:
    """The answer's headers: RELAYED_HEADERS as the replica sent them, then ``x-proxy-replica``,
    ``x-proxy-weight-version`` when a merged-weight group exists (the weights the replica held
    when its answer arrived: proxy/core/weights.py), and ``x-request-id`` set to the request's
    (in the replica's place if it sent one, else last). Built straight as the raw pairs the
    server writes (no dict, one pass)."""
    got = reply.headers
    rid = request_id.encode("latin-1")
    raw = []
    echoed = False
    for name, name_bytes in _RELAYED:
        value = got.get(name)
        if value is not None:
            if name_bytes == b"x-request-id":
                echoed = True
                raw.append((name_bytes, rid))
            else:
                raw.append((name_bytes, value.encode("latin-1")))
    raw.append((b"x-proxy-replica", _REPLICA_LABELS[replica] if replica < 64 else b"%d" % replica))
    if weight_version is not None:
        raw.append((b"x-proxy-weight-version", weight_version))
    if not echoed:
        raw.append((b"x-request-id", rid))
    return raw


_RELAYED = tuple((name, name.encode("latin-1")) for name in RELAYED_HEADERS)
# x-proxy-replica's value and the metrics' replica label for replicas 0-63, made once.
_REPLICA_LABELS = [b"%d" % i for i in range(64)]
_LABELS = [str(i) for i in range(64)]


_TOKEN_IDS = b'"token_ids"'


def _weights(fleet: Fleet, replica: Replica) -> bytes | None:
    """X-Proxy-Weight-Version's value: the merged weights ``replica`` holds as its answer
    arrives (a request frozen by a pause finishes on the weights of the sync that followed);
    None when no weight-transfer group exists."""
    return replica.weights.header.encode("ascii") if fleet.weights.active else None


def completion_token_ids(content: bytes) -> list[int] | None:
    """The generated ids of a one-choice completion answer, or None.

    Only the ``token_ids`` array is parsed when it occurs once: the whole answer, logprobs
    included, costs several times more to parse than the array alone. In JSON text the
    bytes ``"token_ids"`` can only be a key (a quote inside a string is escaped), and
    ``"prompt_token_ids"`` does not contain them; a second occurrence (several choices, or the
    key nested elsewhere) falls back to parsing the whole answer and reading ``choices``."""
    at = content.find(_TOKEN_IDS)
    if at < 0:
        return None
    after = at + len(_TOKEN_IDS)
    if content.find(_TOKEN_IDS, after) < 0:
        colon = content.find(b":", after)
        start = content.find(b"[", colon)
        if colon >= 0 and start >= 0 and not content[after:colon].strip():
            if not content[colon + 1 : start].strip():
                end = content.find(b"]", start)
                if end > 0:
                    ids = orjson.loads(content[start : end + 1])
                    return ids if isinstance(ids, list) and ids else None
            return None  # token_ids is null or not an array
    choices = orjson.loads(content).get("choices")
    if isinstance(choices, list) and len(choices) == 1:
        generated = choices[0].get("token_ids")
        if isinstance(generated, list) and generated:
            return generated
    return None


def generated_ids_finder(
    module: ModuleType | None,
) -> Callable[[bytes], Sequence[int] | None]:
    """``completion_token_ids``, run by the C extension when ``module`` is it: its
    ``completion_ids`` packs the array from the bytes (a rollout's hundreds or thousands of
    ids, never made into Python ints) and leaves every other answer to the reference."""
    if module is None:
        return completion_token_ids
    packed_ids: Callable[[bytes], Sequence[int] | None] = module.completion_ids

    def find(content: bytes) -> Sequence[int] | None:
        ids = packed_ids(content)
        return ids if ids is not None else completion_token_ids(content)

    return find


class _Request:
    """One completion on its way through ``DataPlane.forward``: what every attempt re-sends."""

    __slots__ = ("headers", "key", "lora_path", "path", "raw", "request_id", "route", "started")

    def __init__(
        self, route: str, path: str, raw: bytes, key: RoutingKey, request_id: str, started: float
    ) -> None:
        self.route = route
        self.path = path
        self.raw = raw
        self.key = key
        self.request_id = request_id
        self.started = started
        self.headers = {"content-type": "application/json", "x-request-id": request_id}
        self.lora_path: str | None = None


# What a replica's reply means for the request (``DataPlane._classify``).
_RETRY, _STREAM, _ANSWER = "retry", "stream", "answer"


class DataPlane:
    """The request loop, in layers: ``forward`` refuses while routing is misconfigured, then
    picks a replica and attempts it until an attempt gives the client an answer (the module's
    retry rule); ``_attempt`` sends to one replica and classifies its reply; ``_account``
    records what a relayed answer teaches (index, KV-event predictions, metrics)."""

    def __init__(
        self,
        fleet: Fleet,
        router: Router,
        relay: Relay,
        metrics: Metrics,
        eject: Callable[[Replica, str], None],
        guard: Guard | None = None,
        kv_events: KvEvents | None = None,
        wait_for_replica: Callable[[str], Awaitable[None]] | None = None,
        find_generated: Callable[[bytes], Sequence[int] | None] = completion_token_ids,
    ) -> None:
        # The guard masks the upstream token should a replica ever echo it (the data path runs
        # outside the security middleware that does this for FastAPI's routes).
        self.guard = guard if guard is not None and guard.secrets else None
        self.fleet = fleet
        self.router = router
        self.relay = relay
        self.metrics = metrics
        self.eject = eject
        # A rollout for a desired adapter no replica can serve yet waits (bounded) for one
        # (proxy.reconciler.wait_for_replica, PROXY_ADAPTER_WAIT_S) instead of a 503 at once.
        self.wait_for_replica = wait_for_replica
        self.kv_events = kv_events  # PROXY_KV_EVENTS: checks hit predictions
        # A completion answer's generated ids (generated_ids_finder: in C where it runs).
        self.find_generated = find_generated
        # Why no request can be routed (the replicas disagree on block size or hash algorithm;
        # set by app.configure_routing), or None.
        self.routing_error: str | None = None

    async def forward(
        self, route: str, path: str, raw: bytes, key: RoutingKey, request_id: str, started: float
    ) -> RelayedBody | RelayedStream:
        """Route one completion and relay its answer (or raise the error that explains why
        there is none)."""
        if self.routing_error is not None:
            raise UpstreamUnavailable(self.routing_error)
        request = _Request(route, path, raw, key, request_id, started)
        request.lora_path = self.fleet.lora_path(key.model)
        tried: set[int] = set()
        while True:
            try:
                replica, decision = self._pick(request, tried)
            except UpstreamUnavailable:
                if tried or self.wait_for_replica is None:
                    raise
                # Nobody may serve it yet: a desired adapter waits (bounded) for a replica.
                await self.wait_for_replica(key.model)
                replica, decision = self._pick(request, tried)
            tried.add(replica.index)
            answer = await self._attempt(request, replica, decision, tried)
            if answer is not None:
                return answer

    def _pick(self, request: _Request, tried: set[int]) -> tuple[Replica, Decision]:
        """The replica the router picks among the eligible ones not tried yet."""
        fleet = self.fleet
        model = request.key.model
        eligible = fleet.eligible(model)
        if tried:
            eligible = [r for r in eligible if r.index not in tried]
        if not eligible:
            raise self._no_replica(model, tried)
        decision = self.router.route(
            request.key,
            [(r.index, r.in_flight + r.queue_depth) for r in eligible],
            request.lora_path,
        )
        self.metrics.count_decision(decision.outcome, decision.matched_blocks)
        return fleet.replicas[decision.replica], decision

    def _no_replica(self, model: str, tried: set[int]) -> Exception:
        if not self.fleet.is_base_model(model) and not self.fleet.known_anywhere(model):
            return ModelNotFound(f"The model `{model}` does not exist.", param="model")
        fleet = self.fleet
        states = ", ".join(
            f"{r.index}={r.status.value}" + (f" ({why})" if (why := fleet.waiting_for(r)) else "")
            for r in fleet.members()
        )
        if tried:
            return UpstreamUnavailable(
                f"every eligible replica failed for model `{model}` (tried {sorted(tried)}; "
                f"replicas: {states})"
            )
        error = UpstreamUnavailable(
            f"no replica that may serve model `{model}` holds it yet (replicas: {states}); "
            "retry shortly",
            status_code=503,
        )
        error.retry_after = NO_REPLICA_RETRY_AFTER_S
        return error

    async def _attempt(
        self, request: _Request, replica: Replica, decision: Decision, tried: set[int]
    ) -> RelayedBody | RelayedStream | None:
        """Send the request to ``replica`` and make its reply the client's answer; None: try
        another replica. The replica counts the request in flight from the send until its
        answer is read, or, for a stream, until the stream ends (``RelayedStream.finish``),
        however the attempt ends."""
        stream = request.key.stream
        relayed: RelayedStream | None = None
        replica.in_flight += 1
        try:
            sent_at = time.perf_counter()
            try:
                reply = await self.relay.post(
                    replica.index, replica.url, request.path, request.raw, request.headers, stream
                )
                if stream and reply.status != 200:
                    # An error is a small JSON body, not a stream: read it, so that it can be
                    # retried or relayed like any other answer.
                    reply.body = b"".join([c async for c in reply.chunks()])
                    await reply.close()
            except ReplicaUnreachable as exc:
                self.eject(replica, exc.message)
                return None
            except ReplicaBroken as exc:
                log.warning("request %s: %s; retrying elsewhere", request.request_id, exc.message)
                return None
            verdict = self._classify(request, replica, reply, tried)
            if verdict is _RETRY:
                await reply.close()
                return None
            if verdict is _STREAM:
                relayed = RelayedStream(
                    self,
                    request.route,
                    replica,
                    reply,
                    request.request_id,
                    sent_at,
                    sent_at - request.started,
                    _weights(self.fleet, replica),
                )
                return relayed
            if not reply.released:  # (the lean pool's buffered replies are: no coroutine to run)
                await reply.close()
            upstream_s = time.perf_counter() - sent_at
        finally:
            if relayed is None:
                replica.in_flight -= 1
        return self._account(request, replica, decision, reply, upstream_s)

    def _classify(self, request: _Request, replica: Replica, reply: Reply, tried: set[int]) -> str:
        """What ``reply`` means: retry elsewhere (``_RETRY``; a replica that lost the adapter
        is sent for reconciliation), relay a stream (``_STREAM``) or a buffered answer
        (``_ANSWER``)."""
        status = reply.status
        model = request.key.model
        if (  # a 404 for the adapter: the replica restarted without it
            request.lora_path is not None
            and status == 404
            and b"does not exist" in reply.body
            and model.encode() in reply.body
        ):
            replica.adapters.pop(model, None)
            if replica.status is Status.READY:
                replica.status = Status.RECONCILING
            log.warning(
                "replica %d lost adapter %s; reconciling it, retrying elsewhere",
                replica.index,
                model,
            )
            return _RETRY
        if status in RETRIED_STATUSES and any(
            r.index not in tried for r in self.fleet.eligible(model)
        ):
            self.metrics.count_request(request.route, str(replica.index), status)
            log.warning(
                "request %s: replica %d answered %d; retrying elsewhere",
                request.request_id,
                replica.index,
                status,
            )
            return _RETRY
        return _STREAM if request.key.stream and status == 200 else _ANSWER

    def _account(
        self,
        request: _Request,
        replica: Replica,
        decision: Decision,
        reply: Reply,
        upstream_s: float,
    ) -> RelayedBody:
        """A buffered answer, relayed: what it teaches the router and the KV-event views, its
        log line and its metrics."""
        key = request.key
        index = replica.index
        status = reply.status
        if (
            status == 200
            and key.tokens is not None
            and key.num_prompts == 1
            and self.router.learns_completions
        ):
            self._remember_completion(key, decision, reply.body, request.lora_path)
        if self.kv_events is not None:
            self.kv_events.observe(decision, reply.body)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s: %s -> replica %d, %d in %.1f ms (%s, %d blocks matched)",
                request.request_id,
                request.route,
                index,
                status,
                upstream_s * 1e3,
                decision.outcome,
                decision.matched_blocks,
                extra={
                    "request_id": request.request_id,
                    "route": request.route,
                    "replica": index,
                    "status": status,
                    "outcome": decision.outcome,
                    "matched_blocks": decision.matched_blocks,
                    "upstream_ms": round(upstream_s * 1e3, 2),
                },
            )
        result = RelayedBody(
            reply, index, request.request_id, self.guard, _weights(self.fleet, replica)
        )
        proxy_s = time.perf_counter() - request.started - upstream_s
        self.metrics.answered(
            request.route, _LABELS[index] if index < 64 else str(index), status, upstream_s, proxy_s
        )
        return result

    def _remember_completion(
        self, key: RoutingKey, decision: Decision, content: bytes, lora_path: str | None
    ) -> None:
        """Index ``prompt + completion`` on the replica that generated it (TRL always asks for
        ``return_token_ids``; without them there is nothing to remember)."""
        try:
            generated = self.find_generated(content)
            if generated:
                self.router.record_completion(key, decision, generated, lora_path)
        except (orjson.JSONDecodeError, AttributeError, TypeError, OverflowError) as exc:
            # A malformed answer is the client's to see; routing just learns nothing from it.
            log.debug("could not index a completion: %s", exc)


class RelayedBody(Response):
    """A buffered upstream answer sent as two ASGI messages. Starlette's own ``Response``
    builds a header object model on every request, which cost more than routing the request
    in the profile; this is still a ``Response`` to anything that checks."""

    def __init__(
        self,
        reply: Reply,
        replica: int,
        request_id: str,
        guard: Guard | None,
        weight_version: bytes | None = None,
    ) -> None:
        # Deliberately not calling Response.__init__ (that is the cost being avoided).
        self.status_code = reply.status
        self.background = None
        raw = _relay_headers(reply, replica, request_id, weight_version)
        body = reply.body
        if guard is not None:
            body = guard.mask_body(body)
            raw = guard.mask_headers(raw)
        self.body = body
        raw.append((b"content-length", str(len(body)).encode()))
        self.raw_headers = raw

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send_whole(send, self.status_code, self.raw_headers, self.body)


class RelayedStream(Response):
    """A relayed SSE stream, chunk by chunk as the replica sends them. The upstream is closed and
    the in-flight count released however the response ends: finished, failed, or the client
    gone (then the upstream connection is closed at once, which makes vLLM abort the request).

    ``send`` waits while the client's socket buffer is full, and the relay does not read the
    next chunk until it returns; the lean client then stops reading the replica (proxy/pool.py),
    so a slow client slows its stream instead of growing the proxy's memory. Watching for the
    client leaving takes a second task, started only for streams: a buffered answer is sent in
    one go, and a client that left before it just misses it.
    """

    def __init__(
        self,
        plane: DataPlane,
        route: str,
        replica: Replica,
        reply: Reply,
        request_id: str,
        sent_at: float,
        routed: float,
        weight_version: bytes | None = None,
    ) -> None:
        self.plane = plane
        self.route = route
        self.replica = replica
        self.reply = reply
        self.sent_at = sent_at
        self.routed = routed
        self.status_code = reply.status
        self.background = None
        self.raw_headers = _relay_headers(reply, replica.index, request_id, weight_version)
        if plane.guard is not None:
            self.raw_headers = plane.guard.mask_headers(self.raw_headers)
        self.client_left = False

    async def masked_chunks(self) -> AsyncIterator[bytes]:
        """The stream's chunks as the replica sends them, the upstream token masked."""
        guard = self.plane.guard
        async for chunk in self.reply.chunks():
            yield chunk if guard is None else guard.mask_body(chunk)

    async def finish(self) -> None:
        """Close the upstream, release the in-flight count, count the answer: however it ended."""
        await self.reply.close()
        self.replica.in_flight -= 1
        upstream_s = time.perf_counter() - self.sent_at
        label = str(self.replica.index)
        self.plane.metrics.answered(self.route, label, self.reply.status, upstream_s, self.routed)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, task))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.masked_chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not self.client_left or task is None:
                raise
            task.uncancel()  # our own doing: the client is gone, nothing left to send
        finally:
            watcher.cancel()
            await self.finish()

    async def _watch(self, receive: Any, task: asyncio.Task[Any] | None) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_left = True
                if task is not None:
                    task.cancel()
                return
