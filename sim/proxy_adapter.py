"""The simulation's one point of contact with the proxy: real runtime, real wiring.

``build_runtime`` (proxy.app) builds the real Fleet, Router, ControlPlane, HealthMonitor, Probes
and DataPlane on the simulated transport; this adapter starts and stops them with the app's own
``start_runtime`` / ``stop_runtime`` and calls them the way the HTTP handlers do, turning a
``ProxyError`` into its status and anything else into the 500 the app's catch-all would answer.

The data path goes through ``DataPlane.forward`` (eligibility, routing, retries) with
fakes/httpx_relay.py's relay over the simulated transport. When the data path's upstream client
changes, this module is the only one to re-point.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson

from fakes.httpx_relay import HttpxRelay
from proxy.app import Runtime, build_runtime, start_runtime, stop_runtime
from proxy.errors import ProxyError
from proxy.hotpath import EXTRACTORS, parse_json
from proxy.settings import Settings
from sim.replica import SimTransport


@dataclass
class Answer:
    status: int  # 0: the connection was dropped (the proxy restarted under the request)
    body: Any
    message: str = ""
    relayed: bool = False  # a replica's own answer passed through, not the proxy's
    headers: dict[str, str] = field(default_factory=dict)  # a relayed answer's headers


class ProxyUnderTest:
    def __init__(self, settings: Settings, transport: SimTransport) -> None:
        self.settings = settings
        self.transport = transport
        self.rt: Runtime | None = None
        self.generation = 0

    async def start(self) -> None:
        rt = build_runtime(self.settings, self.transport, HttpxRelay)
        await start_runtime(rt)
        self.rt = rt
        self.generation += 1

    async def stop(self) -> None:
        rt, self.rt = self.rt, None
        if rt is None:
            return
        await stop_runtime(rt)

    @property
    def up(self) -> bool:
        return self.rt is not None

    @staticmethod
    def _error(exc: BaseException) -> Answer:
        if isinstance(exc, ProxyError):
            return Answer(exc.status_code, exc.to_body(), exc.message)
        return Answer(500, None, f"internal proxy error: {type(exc).__name__}: {exc}")

    async def _answer(self, call: Coroutine[Any, Any, Any]) -> Answer:
        """A control or weight call's reply as the app's handler would send it."""
        try:
            reply = await call
        except Exception as exc:
            return self._error(exc)
        return Answer(reply.status, reply.body)

    async def control(self, endpoint: str, raw: bytes = b"", query: str = "") -> Answer:
        rt = self.rt
        assert rt is not None
        if endpoint == "load":
            call = rt.control.load_adapter(raw)
        elif endpoint == "unload":
            call = rt.control.unload_adapter(raw)
        elif endpoint == "pause":
            call = rt.control.pause(query)
        elif endpoint == "resume":
            call = rt.control.resume()
        else:
            call = rt.control.reset_prefix_cache(query)
        return await self._answer(call)

    async def weights(self, endpoint: str, raw: bytes = b"", query: str = "") -> Answer:
        """The merged-weight routes (proxy/weight_sync.py), as the app's handlers call them."""
        rt = self.rt
        assert rt is not None
        if endpoint == "get_world_size":
            call = rt.weights.get_world_size(query)
        elif endpoint == "init":
            call = rt.weights.init(raw)
        elif endpoint == "start":
            call = rt.weights.start(raw)
        elif endpoint == "update":
            call = rt.weights.update(raw)
        else:
            call = rt.weights.finish(raw)
        return await self._answer(call)

    async def add_replica(self, url: str) -> Answer:
        """POST /admin/replicas."""
        rt = self.rt
        assert rt is not None
        try:
            return Answer(201, await rt.membership.add(url))
        except Exception as exc:
            return self._error(exc)

    async def probe(self, endpoint: str) -> Answer:
        rt = self.rt
        assert rt is not None
        try:
            if endpoint == "health":
                status, body = await rt.probes.health()
                return Answer(status, body, str(body.get("message", "")))
            if endpoint == "server_info":
                return Answer(200, await rt.probes.server_info("config_format=json"))
            if endpoint == "server_info_text":
                return Answer(200, await rt.probes.server_info(""))
            if endpoint == "models":
                return Answer(200, await rt.probes.models())
            return Answer(200, await rt.probes.is_paused())
        except Exception as exc:
            return self._error(exc)

    async def complete(self, body: dict[str, Any], request_id: str) -> Answer:
        rt = self.rt
        assert rt is not None
        raw = orjson.dumps(body)
        try:
            key = EXTRACTORS["completions"](parse_json(raw), None)
            response = await rt.data.forward(
                "completions", "/v1/completions", raw, key, request_id, time.perf_counter()
            )
        except Exception as exc:
            if self.rt is not rt:  # the process this request was in went away: a reset
                return Answer(0, None, "connection reset: the proxy restarted")
            return self._error(exc)
        payload = bytes(response.body) if hasattr(response, "body") else b""
        try:
            answered = orjson.loads(payload) if payload else None
        except orjson.JSONDecodeError:
            answered = None
        headers = {k.lower(): v for k, v in getattr(response, "headers", {}).items()}
        return Answer(response.status_code, answered, relayed=True, headers=headers)
