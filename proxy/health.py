"""The health loop: every ``health_interval_s`` each member replica is probed and observed in
parallel, without any lock (a control call never waits for a probe), and handed to
``proxy.reconciler`` when it is behind the desired state (docs/reliability.md, Fleet).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.control import ControlPlane
from proxy.core.fleet import Fleet, Replica, Status, unaccounted_requests
from proxy.core.hashing import VLLM_HASH_ALGOS
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.upstream import Upstream

log = logging.getLogger("rollout_proxy.health")


def model_entries(payload: Any) -> list[dict[str, Any]]:
    """The entries of a vLLM /v1/models answer that are objects with a string ``id``."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answer has no 'data' list")
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("id"), str)]


def parse_models(payload: Any) -> tuple[str | None, int | None, dict[str, str]]:
    """(base model, its max_model_len, adapters name -> path) from a vLLM /v1/models answer.
    Adapters are the entries with a ``parent`` (vLLM sets it to the base model)."""
    base: str | None = None
    max_len: int | None = None
    adapters: dict[str, str] = {}
    for entry in model_entries(payload):
        if entry.get("parent"):
            adapters[entry["id"]] = str(entry.get("root") or "")
        elif base is None:
            base = entry["id"]
            mml = entry.get("max_model_len")
            # The replica's word: anything but a positive whole number is unknown (True would
            # read as 1 and refuse every prompt as too long).
            max_len = mml if type(mml) is int and mml > 0 else None
    return base, max_len, adapters


def parse_vllm_metrics(text: str) -> dict[str, Any]:
    """The few vLLM gauges/counters the proxy uses (summed over engine labels).

    Matched on sample names with any ``_total`` suffix removed: the text parser files a counter
    sample under a family of its own when the declared family name and the sample name differ
    only by ``_total``, which is how vLLM exposes its colon-named counters."""
    wanted = {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:prefix_cache_queries": "prefix_queries",
        "vllm:prefix_cache_hits": "prefix_hits",
    }
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            key = wanted.get(name)
            if key is not None:
                # Every figure is a replica's untrusted word: NaN, infinities and negative
                # counts are no report (unknown), not a load of infinity for the policy.
                if math.isfinite(sample.value) and sample.value >= 0.0:
                    out[key] = out.get(key, 0.0) + sample.value
            elif name == "vllm:cache_config_info":
                labels = sample.labels
                block_size = _label_int(labels.get("block_size"), MAX_BLOCK_SIZE)
                if block_size is not None:
                    out["block_size"] = block_size
                if labels.get("prefix_caching_hash_algo") in VLLM_HASH_ALGOS:
                    out["hash_algo"] = labels["prefix_caching_hash_algo"]
                blocks = _label_int(labels.get("num_gpu_blocks"), MAX_GPU_BLOCKS)
                if blocks is not None:
                    out["num_gpu_blocks"] = blocks
    return out


# Bounds on what a replica may report about its cache; anything outside reads as unknown. vLLM's
# block sizes are powers of two from 1 to a few hundred tokens (hybrid models go higher);
# 65,536 is far past any. 2**40 blocks would be petabytes of KV cache.
MAX_BLOCK_SIZE = 2**16
MAX_GPU_BLOCKS = 2**40


def _label_int(value: str | None, limit: int) -> int | None:
    """A positive whole number at most ``limit`` ("16" or vLLM's "16.0"), else None (unknown).
    Parsed as a float first only when short: int() of 5,000 digits raises, float("inf") cannot
    become an int, and a zero or negative block size would break the hasher."""
    if value is None or len(value) > 24:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if not (math.isfinite(number) and number.is_integer() and 1 <= number <= limit):
        return None
    return int(number)


@dataclass(eq=False, repr=False)
class HealthMonitor:
    settings: Settings
    fleet: Fleet
    control: ControlPlane
    upstream: Upstream
    metrics: Metrics
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _reconciling: dict[int, asyncio.Task[Any]] = field(default_factory=dict, init=False)

    # -- probes -----------------------------------------------------------------------------

    async def _get(self, replica: Replica, path: str) -> Any:
        return await self.upstream.call(
            replica.index, replica.url, "GET", path, timeout=self.upstream.probe_timeout
        )

    async def _look(self, replica: Replica) -> str | None:
        """Probe a replica's /health, then scrape and observe it: None when it answered all,
        else why not."""
        try:
            response = await self._get(replica, "/health")
        except ProxyError as exc:
            return exc.message
        if response.status_code != 200:
            return f"/health answered {response.status_code}"
        try:
            await asyncio.gather(self.scrape(replica), self.observe(replica))
        except (ProxyError, ValueError) as exc:
            return f"observe failed: {exc}"
        return None

    async def read_paused(self, replica: Replica) -> bool | None:
        """The replica's pause state, or None when it cannot be known: no /is_paused (404 without
        dev mode), a timeout, an error status or an answer that is not {"is_paused": bool}."""
        try:
            response = await self._get(replica, "/is_paused")
            if response.status_code != 200:
                return None
            value = response.json().get("is_paused")
        except (ProxyError, ValueError, AttributeError):
            return None
        return value if isinstance(value, bool) else None

    async def observe(self, replica: Replica) -> bool:
        """Refresh a replica's adapters and pause state, without locks. False when the
        observation overlapped a call that changed the replica (stale: nothing recorded)."""
        generation = replica.generation
        models, paused = await asyncio.gather(
            self._get(replica, "/v1/models"), self.read_paused(replica)
        )
        if models.status_code != 200:
            raise ValueError(f"/v1/models answered {models.status_code}")
        base, max_len, adapters = parse_models(models.json())
        if replica.generation != generation:
            return False
        self.fleet.record_models(replica.index, base, max_len, adapters, paused)
        self.control.reconciler.changes.notify()
        return True

    async def scrape(self, replica: Replica) -> None:
        if not self.settings.scrape_vllm_metrics:
            return
        try:
            response = await self._get(replica, "/metrics")
            if response.status_code != 200:
                return
            values = parse_vllm_metrics(response.text)
        except (ProxyError, ValueError) as exc:
            log.debug("metrics scrape of replica %d failed: %s", replica.index, exc)
            return
        label = str(replica.index)
        waiting = values.get("waiting", 0.0)
        running = values.get("running", 0.0)
        replica.queue_depth = unaccounted_requests(running, waiting, replica.in_flight)
        replica.block_size = values.get("block_size", replica.block_size)
        replica.hash_algo = values.get("hash_algo", replica.hash_algo)
        if "num_gpu_blocks" in values and replica.block_size:
            # The cost policy prices KV memory with it (proxy/core/policy.py).
            capacity = values["num_gpu_blocks"] * replica.block_size
            self.control.router.kv_capacity_tokens[replica.index] = capacity
        self.metrics.vllm_waiting.labels(label).set(waiting)
        if "kv_usage" in values:
            self.metrics.vllm_kv_usage.labels(label).set(values["kv_usage"])
        if "prefix_queries" in values:
            queries, hits = values["prefix_queries"], values.get("prefix_hits", 0.0)
            self.fleet.record_cache(replica.index, queries, hits)
            self.metrics.vllm_prefix_queries.labels(label).set(queries)
            self.metrics.vllm_prefix_hits.labels(label).set(hits)

    # -- one round --------------------------------------------------------------------------

    async def check(self, replica: Replica, *, wait: bool = False) -> None:
        """Probe, observe and, if needed, reconcile one replica. The reconciliation runs in a
        task of its own unless ``wait``: the probe round must not wait behind it (a lagging
        mount or a slow replica must not delay the other replicas' ejections)."""
        if replica.status is Status.REMOVED:
            return
        problem = await self._look(replica)
        if problem is not None:
            self.control.reconciler.note_failure(replica, problem)
            return
        if not self._needs_converging(replica):
            self.metrics.replica_healthy.labels(str(replica.index)).set(
                1 if replica.status is Status.READY else 0
            )
            return
        if wait:
            await self.control.reconciler.converge(replica)
            return
        pending = self._reconciling.get(replica.index)
        if pending is None or pending.done():
            self._reconciling[replica.index] = asyncio.create_task(
                self.control.reconciler.converge(replica), name=f"reconcile-{replica.index}"
            )

    def _needs_converging(self, replica: Replica) -> bool:
        if replica.status in (Status.RECONCILING, Status.PENDING):
            return True
        if replica.status in (Status.READY, Status.DRAINING):
            # Behind the desired state while no control call is applying it (one that is will
            # bring it there itself): e.g. an adapter someone unloaded behind the proxy's back.
            return self.control.in_flight == 0 and not self.fleet.plan(replica).empty
        return False

    async def run_round(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.fleet.members()))

    async def start_up(self) -> None:
        """First contact: adopt the adapters and pause state replicas already have (a proxy
        restart mid-training loses nothing), then reconcile everyone to it."""
        observed: dict[int, dict[str, str]] = {}
        paused: dict[int, bool | None] = {}

        async def adopt(replica: Replica) -> None:
            if await self._look(replica) is None:
                observed[replica.index] = dict(replica.adapters)
                paused[replica.index] = replica.paused if replica.paused_observed else None

        await asyncio.gather(*(adopt(r) for r in self.fleet.members()))
        for name in self.fleet.adopt(observed, paused):
            log.warning(
                "adapter %s is loaded with different paths on different replicas; "
                "reconciling to the most common path",
                name,
            )
        await asyncio.gather(*(self.check(r, wait=True) for r in self.fleet.members()))

    # -- lifecycle --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.run_round()
            except Exception:  # the loop must survive anything a replica does
                log.exception("health round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="rollout-proxy-health")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._reconciling.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._reconciling.clear()
