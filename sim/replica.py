"""Simulated vLLM replicas behind one in-process httpx transport.

Each ``SimReplica`` answers the endpoints the proxy uses with the shared fake's state model and
answers (``fakes.vllm``: adapter table, /v1/models, /server_info, /metrics, vLLM's errors), and
carries switches for every fault the simulation schedules. It is not an HTTP server like the
tests' and the benchmark's fakes: it runs on the simulation's virtual clock, where a real socket
would tie time to the wall clock, so its requests arrive through ``SimTransport`` instead.
``SimTransport`` routes the proxy's httpx client to them by port and turns faults into what
httpx would raise on a real network: a refused connection, a connect timeout (partition), a read
timeout (wedged), a connection reset mid-answer (crash).

Invariant I1 is checked here, where it happens: a completion that reaches a replica lacking its
adapter is recorded as a violation.

Merged-weight sync (vLLM weight transfer) is modelled without tensors: each replica has a world
size and a weights counter. ``/init_weight_transfer_engine`` gives it a seat, ``/update_weights``
"receives" the trainer's version (``update_info.sim_version``, which the proxy passes on as it
passes every field), and ``/finish_weight_update`` makes it the weights the replica serves. A
restart loses the seat and goes back to the launch weights (0), as a restarted vLLM would.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from fakes.vllm import (
    Adapters,
    VllmError,
    adapter_not_readable,
    metrics_text,
    models_payload,
    server_info_json,
    server_info_text,
)

BASE_MODEL = "sim/base"
MAX_MODEL_LEN = 4096
PROBE_PATHS = frozenset({"/health", "/v1/models", "/is_paused", "/metrics", "/server_info"})


@dataclass
class Faults:
    down: bool = False  # crashed: connections refused
    wedged: bool = False  # accepts, never answers
    partitioned: bool = False  # packets dropped: connects time out, answers never arrive
    slow_s: float = 0.0  # extra latency on every answer
    errors_5xx: bool = False  # engine dead: everything (including /health) answers 500
    probe_hang: bool = False  # GETs (probes) hang; control calls and completions still answered
    missing: set[str] = field(default_factory=set)  # optional endpoints this server lacks
    mount_lag_s: float = 0.0  # adapters published now become readable this much later
    update_fails: bool = False  # /update_weights answers 500 (the transfer broke)
    update_hangs: bool = False  # /update_weights never answers (the transfer stalled)


class SimReplica:
    def __init__(self, index: int, world: Any) -> None:
        self.index = index
        self.world = world
        self.port = 9000 + index
        self.faults = Faults()
        self.adapters = Adapters()
        self.paused = False
        self.incarnation = 0
        # Faults that stop it applying control calls (wedge, slow, 5xx, partition) begun so far:
        # a call it was able to apply at both ends may still have met one in between.
        self.disruptions = 0
        self.readable_at: dict[str, float] = {}  # adapter path -> when this mount sees it
        # A mount that comes back lagging after a restart: each path answers "No adapter found"
        # to its first ``lag_attempts`` loads (counted per path), until ``lag_until`` at most.
        self.lag_attempts = 0
        self.lag_until = 0.0
        self.lag_seen: dict[str, int] = {}
        self._waiters: list[asyncio.Future[None]] = []  # completions in progress
        self._resumed: asyncio.Future[None] | None = None
        self.applied: list[tuple[float, str, str]] = []  # (time, action, name) of 2xx applies
        self.served = 0
        # Merged-weight sync: world size, seat (rank_offset) in the trainer's group, the weights
        # served (the trainer's version; 0 = launch weights) and the label its finish carried.
        self.world_size = 1
        self.seat: int | None = None
        self.updating = False
        self.received: int | None = None  # the version an update brought, not yet finished
        self.weights = 0
        self.weights_label: str | None = None

    # -- faults -------------------------------------------------------------------------------

    def crash(self) -> None:
        """The process dies: every open connection is reset, state is gone."""
        self.faults.down = True
        self.incarnation += 1
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_exception(httpx.RemoteProtocolError("connection reset by peer"))
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_exception(httpx.RemoteProtocolError("connection reset by peer"))
            self._resumed.exception()  # retrieved: held requests may all have timed out already
        self._resumed = None
        self.adapters.clear()
        self.paused = False
        self.seat = None  # a restarted engine has no weight-transfer group
        self.updating = False
        self.received = None
        self.weights = 0
        self.weights_label = None

    def restart(self) -> None:
        self.faults.down = False

    def publish(self, path: str, now: float) -> None:
        """The trainer wrote an adapter; this replica's mount sees it after its lag."""
        self.readable_at.setdefault(path, now + self.faults.mount_lag_s)

    def lag_after_restart(self, attempts: int) -> None:
        """Crash now; once restarted, every path needs ``attempts`` loads to become readable."""
        self.crash()
        self.lag_attempts = attempts
        self.lag_until = float("inf")
        self.lag_seen.clear()

    def mount_lags(self, now: float) -> bool:
        return now < self.lag_until or any(t > now for t in self.readable_at.values())

    def mount_caught_up_at(self, now: float) -> float:
        """When the mount last caught up (an adapter became readable): a fault ending."""
        times = [*self.readable_at.values(), self.lag_until]
        return max((t for t in times if t <= now), default=0.0)

    # -- serving --------------------------------------------------------------------------------

    async def handle(self, method: str, path: str, query: str, body: Any) -> httpx.Response:
        f = self.faults
        incarnation = self.incarnation
        if f.slow_s:
            await asyncio.sleep(f.slow_s)
            if self.incarnation != incarnation:  # it crashed meanwhile: the connection is gone
                raise httpx.RemoteProtocolError("connection reset by peer")
        if f.wedged or (f.probe_hang and method == "GET"):
            await self.world.forever()
        if path in f.missing:
            return _json({"detail": "Not Found"}, 404)
        if f.errors_5xx:
            return _error("EngineCore encountered an issue", "InternalServerError", 500)
        handler = ROUTES.get((method, path))
        if handler is None:
            return _json({"detail": "Not Found"}, 404)
        result: httpx.Response = await handler(self, query, body)
        return result

    async def health(self, query: str, body: Any) -> httpx.Response:
        return httpx.Response(200)

    async def models(self, query: str, body: Any) -> httpx.Response:
        return _json(models_payload(BASE_MODEL, MAX_MODEL_LEN, self.adapters))

    async def is_paused(self, query: str, body: Any) -> httpx.Response:
        return _json({"is_paused": self.paused})

    async def metrics(self, query: str, body: Any) -> httpx.Response:
        text = metrics_text(BASE_MODEL, running=len(self._waiters))
        return httpx.Response(200, text=text, headers={"content-type": "text/plain"})

    async def server_info(self, query: str, body: Any) -> httpx.Response:
        if "config_format=json" not in query:
            return _json(server_info_text(BASE_MODEL, MAX_MODEL_LEN))
        return _json(server_info_json(BASE_MODEL, MAX_MODEL_LEN))

    def _applied(self, action: str, name: str = "") -> None:
        self.applied.append((self.world.now(), action, name))

    async def load(self, query: str, body: Any) -> httpx.Response:
        path = body.get("lora_path")
        lagging = self.world.now() < self.lag_until and self.lag_seen.get(path, 0) < (
            self.lag_attempts
        )
        if lagging:
            self.lag_seen[path] = self.lag_seen.get(path, 0) + 1
        try:
            if lagging or self.world.now() < self.readable_at.get(path, float("inf")):
                raise adapter_not_readable(body.get("lora_name"))
            name, path = self.adapters.check_load(body)
        except VllmError as exc:
            return _json(exc.body(), exc.status)
        text = self.adapters.add(name, path)
        self._applied("load", name)
        return httpx.Response(200, text=text)

    async def unload(self, query: str, body: Any) -> httpx.Response:
        try:
            text = self.adapters.unload(body)
        except VllmError as exc:
            return _json(exc.body(), exc.status)
        self._applied("unload", body["lora_name"])
        return httpx.Response(200, text=text)

    async def pause(self, query: str, body: Any) -> httpx.Response:
        self.paused = True
        self._applied("pause")
        return _json({"status": "paused"})

    async def resume(self, query: str, body: Any) -> httpx.Response:
        self.paused = False
        self._applied("resume")
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None
        return _json({"status": "resumed"})

    async def reset(self, query: str, body: Any) -> httpx.Response:
        self._applied("reset")
        return _json({"success": True})

    # -- merged-weight sync (vLLM 0.33's weight-transfer routes) ---------------------------------

    async def get_world_size(self, query: str, body: Any) -> httpx.Response:
        return _json({"world_size": self.world_size})

    async def init_weights(self, query: str, body: Any) -> httpx.Response:
        info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            return _error("Missing 'init_info' in request body", "BadRequestError", 400)
        self.seat = int(info["rank_offset"])
        self.updating = False
        self.received = None
        self._applied("init_weights")
        return _json({"message": "Weight transfer initialized"})

    async def start_update(self, query: str, body: Any) -> httpx.Response:
        if self.seat is None:
            return _error("weight transfer engine is not initialized", "InternalServerError", 500)
        self.updating = True
        self.received = None
        return _json({"message": "Weight update started"})

    async def update_weights(self, query: str, body: Any) -> httpx.Response:
        if self.seat is None or not self.updating:
            message = "no weight update started on an initialized engine"
            return _error(message, "InternalServerError", 500)
        if self.faults.update_fails:
            return _error("weight transfer failed: connection closed by peer", "Error", 500)
        if self.faults.update_hangs:
            await self.world.forever()
        incarnation = self.incarnation
        await asyncio.sleep(self.world.rng_transfer_s())  # the tensors arrive over the group
        if self.incarnation != incarnation:
            raise httpx.RemoteProtocolError("connection reset by peer")
        self.received = int(body["update_info"]["sim_version"])
        return _json({"message": "Weights updated"})

    async def finish_update(self, query: str, body: Any) -> httpx.Response:
        if self.seat is None:
            return _error("weight transfer engine is not initialized", "InternalServerError", 500)
        if self.received is not None:
            self.weights = self.received
            label = body.get("weight_version") if isinstance(body, dict) else None
            self.weights_label = label if isinstance(label, str) else None
        self.updating = False
        self.received = None
        return _json({"message": "Weight update finished"})

    async def completion(self, query: str, body: Any) -> httpx.Response:
        model = body.get("model")
        try:
            self.adapters.resolve(model, BASE_MODEL)
        except VllmError as exc:
            self.world.violation(
                "I1",
                f"completion for {model} reached replica {self.index}, which lacks it "
                f"(has {sorted(self.adapters)})",
            )
            return _json(exc.body(), exc.status)
        loop = asyncio.get_running_loop()
        while self.paused:  # mode=keep: held until resumed
            if self._resumed is None:
                self._resumed = loop.create_future()
            # Shielded: the future is shared by every held request, and one of them timing out
            # (its task cancelled) must not cancel it for the others.
            await asyncio.shield(self._resumed)
        done: asyncio.Future[None] = loop.create_future()
        self._waiters.append(done)
        duration = self.world.rng_completion_s()
        handle = loop.call_later(duration, _finish, done)
        try:
            await done
        finally:
            handle.cancel()
            if done in self._waiters:
                self._waiters.remove(done)
        self.served += 1
        n = int(body.get("max_tokens") or 4)
        tokens = [
            (self.index * 7919 + i * 31 + len(body.get("prompt", []))) % 1000 for i in range(n)
        ]
        return _json(
            {
                "id": "cmpl-sim",
                "object": "text_completion",
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": tokens,
                        "logprobs": {"token_logprobs": [-0.5] * n},
                        "finish_reason": "length",
                    }
                ],
            }
        )


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


ROUTES: dict[tuple[str, str], Any] = {
    ("GET", "/health"): SimReplica.health,
    ("GET", "/v1/models"): SimReplica.models,
    ("GET", "/is_paused"): SimReplica.is_paused,
    ("GET", "/metrics"): SimReplica.metrics,
    ("GET", "/server_info"): SimReplica.server_info,
    ("POST", "/v1/load_lora_adapter"): SimReplica.load,
    ("POST", "/v1/unload_lora_adapter"): SimReplica.unload,
    ("POST", "/pause"): SimReplica.pause,
    ("POST", "/resume"): SimReplica.resume,
    ("POST", "/reset_prefix_cache"): SimReplica.reset,
    ("POST", "/v1/completions"): SimReplica.completion,
    ("GET", "/get_world_size"): SimReplica.get_world_size,
    ("POST", "/init_weight_transfer_engine"): SimReplica.init_weights,
    ("POST", "/start_weight_update"): SimReplica.start_update,
    ("POST", "/update_weights"): SimReplica.update_weights,
    ("POST", "/finish_weight_update"): SimReplica.finish_update,
}


def _json(payload: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(
        status, content=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )


def _error(message: str, type_: str, status: int) -> httpx.Response:
    return _json(VllmError(status, message, type_).body(), status)


class SimTransport(httpx.AsyncBaseTransport):
    """The proxy's only way to its replicas in a simulation."""

    def __init__(self, replicas: list[SimReplica]) -> None:
        self.by_port = {r.port: r for r in replicas}
        self.open = 0  # requests in progress (I5: none left at the end)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        replica = self.by_port[request.url.port or 80]
        timeout = request.extensions.get("timeout", {})
        connect_s, read_s = timeout.get("connect"), timeout.get("read")
        if replica.faults.partitioned:
            await asyncio.sleep(connect_s if connect_s is not None else 30.0)
            raise httpx.ConnectTimeout("connect timed out", request=request)
        if replica.faults.down:
            raise httpx.ConnectError("connection refused", request=request)
        raw = await request.aread()
        body = json.loads(raw) if raw else None
        query = request.url.query.decode()
        self.open += 1
        incarnation = replica.incarnation
        try:
            work = replica.handle(request.method, request.url.path, query, body)
            try:
                response = await asyncio.wait_for(work, read_s)
            except TimeoutError:
                raise httpx.ReadTimeout("read timed out", request=request) from None
            if replica.incarnation != incarnation or replica.faults.down:
                raise httpx.RemoteProtocolError("server disconnected", request=request)
            if replica.faults.partitioned:
                await asyncio.sleep(read_s if read_s is not None else 30.0)
                raise httpx.ReadTimeout("read timed out", request=request)
            return response
        finally:
            self.open -= 1
