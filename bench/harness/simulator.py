"""A vLLM replica simulator: the endpoints the proxy uses, in front of a KV-cache and engine model.

Why a simulator: the routing benchmark must run the same AsyncGRPO-shaped workload through several
routers (ours and the Rust ones users would pick) on a 2-core machine without a GPU, and measure
what routing changes on the replicas: prefix-cache hits, load spread, throughput and latency.

What is modelled (per replica):

- KV cache: ``kv_blocks`` blocks of ``block_size`` tokens. Full blocks are keyed by chained hashes
  seeded with the adapter ``(lora_name, lora_path)``, as vLLM does, so adapters never share cache
  and a hit on block i implies blocks 0..i. Blocks held by running requests are pinned; freed
  blocks stay findable until evicted LRU (a request's tail blocks first, as vLLM frees in reverse).
  Prompt blocks are registered when the request is scheduled (vLLM caches full blocks at
  allocation), generated blocks when it finishes. A hit covers at most ``(len(prompt)-1)//16``
  blocks, vLLM's cap. ``/reset_prefix_cache`` and ``/pause`` (unless ``clear_cache=false``) drop
  every cached block; blocks of running requests stay allocated but are no longer findable.
- Engine: FCFS admission bounded by ``max_num_seqs`` batch slots and by free KV blocks (a request
  reserves ``ceil((prompt + output) / block_size)`` blocks on admission; no preemption). Admitted
  requests prefill their *uncached* tokens exclusively (decode of the whole batch stalls meanwhile,
  as a prefill chunk stalls vLLM's step), then decode at one token per engine step, where a step
  takes ``decode_step_base_ms + decode_step_per_seq_ms * batch``. The model is fluid: it sleeps
  until the next event (a completion, an arrival, a pause) and advances every running request by
  the elapsed time, so a request costs a handful of wake-ups rather than one per token.
- Time: simulated seconds map to real seconds by ``time_scale`` (real = simulated * scale), so a
  minute of simulated serving takes seconds. Figures reported in simulated seconds.
- Output: the number of generated tokens and their ids are drawn from a PRNG seeded by the
  request's ``seed`` (TRL sends one per request), so the same workload yields the same completions
  behind every router.

Extras for the benchmark (not vLLM): ``GET /sim/stats`` (busy time, hit tokens, per-request
timings), ``POST /sim/reset`` (zero the counters, empty the cache), and ``prompt`` may also be a
string of space-separated token ids, for routers that only forward text prompts.

Run ``python -m bench.harness.simulator --replicas 4`` to serve four replicas on free ports of
127.0.0.1; the first line on stdout is ``{"ports": [...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import signal
import socket
import sys
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from fakes.vllm import (
    Adapters,
    VllmError,
    bad_request,
    metrics_text,
    models_payload,
    pause_mode,
    query_flag,
    server_info_json,
    server_info_text,
    validation_error,
)

# Qwen2.5-Math-1.5B (the recipe's model): 28 layers, 2 KV heads x 128 dims, bf16. KV per token is
# 2 (K,V) * 28 * 2 * 128 * 2 bytes = 28 KiB, so a 16-token block is 448 KiB.
_KV_BYTES_PER_TOKEN = 2 * 28 * 2 * 128 * 2


@dataclass(frozen=True)
class SimConfig:
    """Parameters of one simulated replica; every default says what it was sized from."""

    model: str = "Qwen/Qwen2.5-Math-1.5B"
    # vLLM's default block size, and the recipe's `--block-size 16`.
    block_size: int = 16
    # One H100-80GB at gpu_memory_utilization=0.9: 72 GB - 3.1 GB weights - ~4 GB activations and
    # CUDA graphs = ~65 GB of KV cache = ~145k blocks of 448 KiB (vLLM logs ~2.3M tokens for this
    # model). Rounded down. Use a smaller figure to study a memory-tight fleet.
    kv_blocks: int = 140_000
    # vLLM's default `--max-num-seqs`: the batch slot limit; more requests wait in FCFS order.
    max_num_seqs: int = 256
    # Prefill is compute-bound: 2 * 1.54e9 = 3.1 GFLOP per token; an H100 (989 TFLOPS bf16 dense)
    # at the ~30-35% MFU vLLM reaches on short prompts gives ~9-10 us per token.
    prefill_us_per_token: float = 10.0
    # Decode is memory- and overhead-bound for a 1.5B model: reading 3.1 GB of weights at
    # 3.35 TB/s is ~0.9 ms, and scheduler, sampler and graph launch bring a single-stream step to
    # ~4 ms (~250 tokens/s, what vLLM serves a 1.5B model at batch 1). Each running sequence adds
    # KV reads (~1k tokens * 28 KiB = 28 MB, ~9 us) and sampling over a 151k vocabulary, ~50 us in
    # all; at a batch of 64 a step is ~7.2 ms, ~9k generated tokens/s per replica.
    decode_step_base_ms: float = 4.0
    decode_step_per_seq_ms: float = 0.05
    # Real seconds per simulated second. 0.1 turns a 90-second simulated run into ~9 s, while a
    # millisecond of real overhead (a router hop, an event-loop hiccup on 2 shared cores) stays
    # ~10 ms simulated against requests of ~4 s.
    time_scale: float = 0.1
    # Loading a rank-1 LoRA adapter from local disk takes vLLM a few hundred milliseconds.
    lora_load_s: float = 0.3
    # Completion lengths of Qwen2.5-Math-1.5B on MATH: median ~600 tokens with a long tail to the
    # recipe's 3,000-token cap; lognormal(ln 600, 0.7) puts ~1% at the cap.
    gen_median_tokens: float = 600.0
    gen_sigma: float = 0.7
    # The recipe's `--max-model-len 4096`, `--max-loras 6`, `--max-lora-rank 1`.
    max_model_len: int = 4096
    max_loras: int = 6
    max_lora_rank: int = 1
    # Qwen2.5 vocabulary size and its <|endoftext|> id, for plausible output ids.
    vocab_size: int = 151_936
    eos_token_id: int = 151_643
    # Publish KV-cache events the way vLLM does (bench/harness/kv_events_publisher.py; hashes become
    # vLLM's exact sha256 keys so the proxy can match them). Off: the events cost CPU.
    kv_events: bool = False

    def __post_init__(self) -> None:
        positive = {
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "max_num_seqs": self.max_num_seqs,
            "time_scale": self.time_scale,
            "decode_step_base_ms": self.decode_step_base_ms,
            "gen_median_tokens": self.gen_median_tokens,
            "max_model_len": self.max_model_len,
            "max_loras": self.max_loras,
            "vocab_size": self.vocab_size,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {value!r}")
        non_negative = {
            "prefill_us_per_token": self.prefill_us_per_token,
            "decode_step_per_seq_ms": self.decode_step_per_seq_ms,
            "lora_load_s": self.lora_load_s,
            "gen_sigma": self.gen_sigma,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {value!r}")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"kv_blocks * block_size ({self.kv_blocks * self.block_size}) must hold one "
                f"max_model_len ({self.max_model_len}) sequence"
            )

    @property
    def kv_cache_gib(self) -> float:
        """The KV memory these blocks stand for, for the report."""
        return self.kv_blocks * self.block_size * _KV_BYTES_PER_TOKEN / 2**30

    def step_seconds(self, batch: float) -> float:
        """Simulated seconds of one decode step with ``batch`` running sequences."""
        return (self.decode_step_base_ms + self.decode_step_per_seq_ms * batch) / 1000.0

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any]) -> SimConfig:
        """Build from a mapping of field names, rejecting unknown names (typos)."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"unknown SimConfig field(s): {', '.join(unknown)}")
        return cls(**overrides)


# --------------------------------------------------------------------------------------------
# Block hashing (simulator-private: any stable, chained, adapter-seeded hash models vLLM's).


def block_hashes(
    tokens: Sequence[int],
    adapter: tuple[str, str] | None,
    block_size: int,
    *,
    start: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` from block index ``start``.

    ``parent`` is the hash of block ``start - 1`` (None when ``start`` is 0). Python's tuple hash is
    deterministic for ints and stable within a process, which is all the simulator needs.
    """
    seed = hash(("sim-root", adapter))
    prev = seed if parent is None else parent
    out: list[int] = []
    n_full = len(tokens) // block_size
    for i in range(start, n_full):
        prev = hash((prev, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(prev)
    return out


# --------------------------------------------------------------------------------------------
# KV cache model (pure, synchronous).


class _Block:
    __slots__ = ("hash", "ref")

    def __init__(self, block_hash: int, ref: int) -> None:
        self.hash = block_hash
        self.ref = ref


@dataclass
class Allocation:
    """The KV blocks one admitted request holds."""

    blocks: list[_Block]  # hashed prompt blocks (cache hits first, then newly registered)
    anon: int  # blocks reserved without a hash: partial prompt block and the output
    hit_blocks: int


class KVCache:
    """Fixed-capacity block pool with a prefix index and LRU eviction of unreferenced blocks."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        self.capacity = capacity_blocks
        self._index: dict[int, _Block] = {}
        # Unreferenced but still findable blocks, least recently freed first.
        self._evictable: OrderedDict[int, _Block] = OrderedDict()
        self._pinned = 0  # blocks with ref > 0 (hashed or orphaned by a reset)
        self._anon = 0
        self.evictions = 0
        # Hashes this cache evicted for room, and how many blocks it later had to register (so
        # prefill) again under one of them: the recompute that memory pressure causes. A set of
        # ints per run (tens of thousands at most); cleared with the statistics.
        self._evicted: set[int] = set()
        self.recomputed_blocks = 0
        self.events: Any = None  # a KvEventPublisher when SimConfig.kv_events

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (what vLLM reports as KV usage)."""
        return self._pinned + self._anon

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by hash (pinned or evictable)."""
        return len(self._index)

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Number of leading ``hashes`` present (at most ``limit``)."""
        n = 0
        for h in hashes[: max(limit, 0)]:
            if h not in self._index:
                break
            n += 1
        return n

    def allocate(
        self, hashes: Sequence[int], hit_limit: int, total_blocks: int
    ) -> Allocation | None:
        """Reserve ``total_blocks`` for a request whose prompt has full-block ``hashes``.

        Reuses the longest cached prefix (up to ``hit_limit`` blocks), evicts LRU blocks to make
        room, registers the remaining prompt blocks, and returns None when the pool cannot hold
        the request until running ones finish.
        """
        hit: list[_Block] = []
        for h in hashes[: max(hit_limit, 0)]:
            b = self._index.get(h)
            if b is None:
                break
            hit.append(b)
        evictable_hits = sum(1 for b in hit if b.ref == 0)
        new_needed = total_blocks - len(hit)
        if new_needed > self.capacity - self._pinned - self._anon - evictable_hits:
            return None
        for b in hit:
            if b.ref == 0:
                del self._evictable[b.hash]
                self._pinned += 1
            b.ref += 1
        free = self.capacity - self._pinned - self._anon - len(self._evictable)
        evicted = []
        for _ in range(new_needed - free):
            _, victim = self._evictable.popitem(last=False)
            del self._index[victim.hash]
            self.evictions += 1
            evicted.append(victim.hash)
            self._evicted.add(victim.hash)
        if self.events is not None:
            self.events.removed(evicted)
        owned = list(hit)
        anon = new_needed
        for h in hashes[len(hit) :]:
            if h in self._index:  # orphan of an evicted parent: keep a private copy, like vLLM
                continue
            if h in self._evicted:
                self._evicted.discard(h)
                self.recomputed_blocks += 1
            b = _Block(h, 1)
            self._index[h] = b
            owned.append(b)
            self._pinned += 1
            anon -= 1
        self._anon += anon
        if self.events is not None:
            self.events.stored([b.hash for b in owned[len(hit) :]])
        return Allocation(owned, anon, len(hit))

    def release(self, alloc: Allocation, output_hashes: Sequence[int]) -> None:
        """Free a finished request's blocks, caching its full generated blocks."""
        self._anon -= alloc.anon
        # Generated full blocks become cached, unreferenced blocks (they used reserved slots).
        new: list[_Block] = []
        for h in output_hashes[: alloc.anon]:
            if h in self._index:
                continue
            b = _Block(h, 0)
            self._index[h] = b
            new.append(b)
        if self.events is not None:
            self.events.stored([b.hash for b in new])
        # Free tail-first so that, under pressure, the ends of sequences go before their prefixes.
        for b in reversed(new):
            self._evictable[b.hash] = b
        for b in reversed(alloc.blocks):
            b.ref -= 1
            if b.ref == 0:
                self._pinned -= 1
                if self._index.get(b.hash) is b:
                    self._evictable[b.hash] = b
        alloc.blocks = []
        alloc.anon = 0

    def reset_counters(self) -> None:
        self.evictions = 0
        self.recomputed_blocks = 0
        self._evicted.clear()

    def reset(self) -> None:
        """Forget every cached block; blocks of running requests stay allocated, unfindable."""
        self._index.clear()
        self._evictable.clear()
        if self.events is not None:
            self.events.cleared()


# --------------------------------------------------------------------------------------------
# Engine model (asyncio, fluid in time).


class SimClock:
    """Simulated seconds since ``t0``; real time runs ``time_scale`` times as fast."""

    def __init__(self, time_scale: float, t0: float | None = None) -> None:
        self.time_scale = time_scale
        self.t0 = time.monotonic() if t0 is None else t0

    def now(self) -> float:
        return (time.monotonic() - self.t0) / self.time_scale

    def real_delay(self, sim_seconds: float) -> float:
        return max(sim_seconds, 0.0) * self.time_scale


@dataclass(eq=False)
class SimRequest:
    """One /v1/completions request inside the engine."""

    prompt: list[int]
    output: list[int]
    adapter: tuple[str, str] | None
    hashes: list[int]
    arrival: float
    done: asyncio.Future[None]
    remaining: float = 0.0
    admitted: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    hit_tokens: int = 0
    alloc: Allocation | None = None
    finish_reason: str = "length"
    aborted: bool = False
    number: int = 0  # the replica's request counter, also in the answer's id


@dataclass
class EngineStats:
    """Counters a replica exposes at /sim/stats (simulated seconds, tokens)."""

    busy_s: float = 0.0  # prefilling or decoding
    prefill_s: float = 0.0
    decode_s: float = 0.0
    seq_s: float = 0.0  # integral of the running batch size over time
    queries_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0
    finished: int = 0
    generated_tokens: int = 0
    prefilled_tokens: int = 0
    max_waiting: int = 0
    resets: int = 0
    # Time frozen by /pause (any mode) until /resume, and how many pauses: what TRL's weight
    # syncs cost the replica, whoever forwarded them.
    paused_s: float = 0.0
    pauses: int = 0
    # Memory: the integral of KV blocks held by running requests over time (mean usage =
    # kv_block_s / (capacity * elapsed)), the time the head of the queue waited for free KV
    # blocks while batch slots were free (vLLM would preempt or queue there), and the integral
    # of the waiting queue's length (mean queue = waiting_s / elapsed).
    kv_block_s: float = 0.0
    mem_blocked_s: float = 0.0
    waiting_s: float = 0.0
    # arrival, admitted, first_token, finished, prompt_len, hit_tokens, gen_len, number
    log: list[tuple[float, float, float, float, int, int, int, int]] = field(default_factory=list)


class Engine:
    """FCFS continuous-batching engine over a :class:`KVCache`, advancing in simulated time."""

    def __init__(self, config: SimConfig, clock: SimClock) -> None:
        self.config = config
        self.clock = clock
        self.cache = KVCache(config.kv_blocks)
        self.hash_blocks = block_hashes  # vLLM's exact keys when the cache publishes events
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._admission_paused = False
        self._frozen = False
        self._frozen_at = 0.0
        self._stall_until = -math.inf  # simulated time when the current prefill work ends
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()  # set whenever the running batch empties
        self._last = clock.now()
        self._kv_t = self._last  # the memory integral's last mark
        self._mem_blocked = False  # the queue's head is waiting for KV blocks
        self._task: asyncio.Task[None] | None = None
        self.last_pause_mode: str | None = None  # lets the bench see what a router forwarded

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._last = self.clock.now()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for r in [*self.running, *self.waiting]:
            if not r.done.done():
                r.done.cancel()

    # -- requests --------------------------------------------------------------------------

    async def generate(self, req: SimRequest) -> None:
        """Queue ``req`` and wait until it finished (or was aborted)."""
        self.stats.requests += 1
        self.waiting.append(req)
        self.stats.max_waiting = max(self.stats.max_waiting, len(self.waiting))
        self._wake.set()
        await req.done

    @property
    def paused(self) -> bool:
        return self._frozen

    def reset_cache(self) -> None:
        self.cache.reset()
        self.stats.resets += 1

    async def pause(self, mode: str) -> None:
        """vLLM's pause modes: keep freezes in-flight requests, wait drains, abort ends them."""
        self._advance_to(self.clock.now())
        self.last_pause_mode = mode
        self._admission_paused = True
        if mode == "wait":
            while self.running:
                self._drained.clear()
                await self._drained.wait()
        elif mode == "abort":
            for r in list(self.running):
                r.aborted = True
                r.finish_reason = "abort"
                self._finish(r, self.clock.now())
            self.running.clear()
        now = self.clock.now()
        self._advance_to(now)
        if not self._frozen:
            self.stats.pauses += 1
            self._frozen_at = now
        self._frozen = True
        self._wake.set()

    def resume(self) -> None:
        now = self.clock.now()
        self._advance_to(now)
        if self._frozen:
            self.stats.paused_s += now - self._frozen_at
            if self._stall_until > self._frozen_at:
                self._stall_until += now - self._frozen_at  # prefill work was frozen too
        self._admission_paused = False
        self._frozen = False
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------

    def _advance_to(self, now: float) -> None:
        """Account the interval since the last call, moving running requests forward.

        The part of the interval before ``_stall_until`` is prefill: the whole batch waits, as
        decode steps wait for a prefill chunk in vLLM. The rest is decode. Progress comes from the
        elapsed time, so a late wake-up (event-loop granularity, a busy core) delays one event
        instead of inflating the prefill or skewing every request: completion times stay exact.
        """
        start = self._last
        dt = now - start
        self._last = now
        if dt <= 0:
            return
        self.stats.waiting_s += len(self.waiting) * dt
        if self._frozen:
            self._account_memory(now)
            return
        if self._mem_blocked:
            self.stats.mem_blocked_s += dt
        stall = min(max(self._stall_until - start, 0.0), dt)
        if stall > 0:
            self.stats.busy_s += stall
            self.stats.prefill_s += stall
            self.stats.seq_s += stall * len(self.running)
        dt -= stall
        t = start + stall
        # Exact piecewise advance: between completions the batch, hence the step time, is
        # constant; a request finishing inside the interval finishes at its exact time, and the
        # replica is idle (not busy) for whatever remains once the batch empties.
        while dt > 1e-12 and self.running:
            batch = len(self.running)
            step = self.config.step_seconds(batch)
            first = min(r.remaining for r in self.running)
            span = min(first * step, dt)
            progress = span / step
            t += span
            dt -= span
            self.stats.busy_s += span
            self.stats.decode_s += span
            self.stats.seq_s += span * batch
            still: list[SimRequest] = []
            self._account_memory(t)  # finishing requests release blocks at t
            for r in self.running:
                r.remaining -= progress
                if r.remaining <= 1e-9:
                    self._finish(r, t)
                else:
                    still.append(r)
            self.running = still
        self._account_memory(now)
        if not self.running:
            self._drained.set()

    def _account_memory(self, t: float) -> None:
        """Add the blocks held since the last mark to the usage integral (call before the
        held blocks change)."""
        if t > self._kv_t:
            self.stats.kv_block_s += self.cache.used_blocks * (t - self._kv_t)
            self._kv_t = t

    def restart_stats(self) -> None:
        """Zero the counters from now on."""
        self.stats = EngineStats()
        self.cache.reset_counters()
        self._kv_t = max(self._kv_t, self.clock.now())

    def _finish(self, r: SimRequest, now: float) -> None:
        r.finished = now
        if r.aborted:  # keep what was generated before the abort
            r.output = r.output[: max(len(r.output) - math.ceil(r.remaining), 0)]
        if r.alloc is not None:
            bs = self.config.block_size
            n_prompt_full = len(r.prompt) // bs
            seq = r.prompt + r.output
            parent = r.hashes[n_prompt_full - 1] if n_prompt_full else None
            out_hashes = self.hash_blocks(seq, r.adapter, bs, start=n_prompt_full, parent=parent)
            self.cache.release(r.alloc, out_hashes)
            r.alloc = None
        self.stats.finished += 1
        self.stats.generated_tokens += len(r.output)
        self.stats.log.append(
            (
                r.arrival,
                r.admitted,
                r.first_token,
                r.finished,
                len(r.prompt),
                r.hit_tokens,
                len(r.output),
                r.number,
            )
        )
        if not r.done.done():
            r.done.set_result(None)

    def _admit(self, now: float) -> list[SimRequest]:
        bs = self.config.block_size
        admitted: list[SimRequest] = []
        self._mem_blocked = False
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            r = self.waiting[0]
            total = -(-(len(r.prompt) + len(r.output)) // bs)
            alloc = self.cache.allocate(r.hashes, (len(r.prompt) - 1) // bs, total)
            if alloc is None:  # head-of-line blocking until running requests free blocks
                self._mem_blocked = True
                break
            self.waiting.popleft()
            r.alloc = alloc
            r.admitted = now
            r.hit_tokens = alloc.hit_blocks * bs
            self.stats.queries_tokens += len(r.prompt)
            self.stats.hit_tokens += r.hit_tokens
            self.stats.prefilled_tokens += len(r.prompt) - r.hit_tokens
            admitted.append(r)
        return admitted

    async def _sleep_or_wake(self, sim_seconds: float) -> None:
        loop = asyncio.get_running_loop()
        handle = loop.call_later(self.clock.real_delay(sim_seconds), self._wake.set)
        try:
            await self._wake.wait()
        finally:
            handle.cancel()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock.now()
            self._advance_to(now)
            if self._frozen:
                await self._wake.wait()
                continue
            if not self._admission_paused:
                admitted = self._admit(now)
                if admitted:
                    # Prefills run one after another, after any prefill still in progress.
                    uncached = sum(len(r.prompt) - r.hit_tokens for r in admitted)
                    start = max(self._stall_until, now)
                    self._stall_until = start + uncached * self.config.prefill_us_per_token / 1e6
                    for r in admitted:
                        r.first_token = self._stall_until
                        r.remaining = float(len(r.output))
                        self.running.append(r)
            if not self.running:
                await self._wake.wait()
                continue
            step = self.config.step_seconds(len(self.running))
            first_done = min(r.remaining for r in self.running) * step
            await self._sleep_or_wake(max(self._stall_until - now, 0.0) + first_done)


# --------------------------------------------------------------------------------------------
# One replica: adapters, request validation, OpenAI-shaped answers, the HTTP app.


def _error_response(exc: VllmError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


_bad = bad_request


def _parse_prompt(raw: object) -> list[int]:
    if isinstance(raw, str):
        try:
            tokens = [int(t) for t in raw.split()]
        except ValueError:
            raise _bad(
                "simulator: a text prompt must be space-separated token ids (no tokenizer here)"
            ) from None
    elif isinstance(raw, list) and all(type(t) is int for t in raw):
        tokens = list(raw)
    else:
        raise _bad("prompt must be a list of token ids (or a string of space-separated ids)")
    if not tokens:
        raise _bad("prompt must not be empty")
    return tokens


def _draw_length(rng: random.Random, config: SimConfig) -> int:
    return max(1, round(rng.lognormvariate(math.log(config.gen_median_tokens), config.gen_sigma)))


def completion_length(config: SimConfig, seed: int, max_tokens: int) -> int:
    """How many tokens a replica generates for a request with this ``seed`` and budget (lets
    a workload size its working set without serving it)."""
    return min(_draw_length(random.Random(seed), config), max_tokens)


class Replica:
    """State of one simulated vLLM server, independent of the HTTP framework."""

    def __init__(self, config: SimConfig, clock: SimClock, index: int = 0) -> None:
        self.config = config
        self.index = index
        self.engine = Engine(config, clock)
        self.adapters = Adapters()  # name -> path, in load order
        self._created = int(time.time())
        self._ids = 0

    def model_key(self, name: object) -> tuple[str, str] | None:
        adapter = self.adapters.resolve(name, self.config.model)
        return None if adapter is None else (adapter, self.adapters[adapter])

    def sample_output(self, seed: int, max_tokens: int) -> tuple[list[int], str]:
        rng = random.Random(seed)
        length = _draw_length(rng, self.config)
        reason = "stop"
        if length >= max_tokens:
            length, reason = max_tokens, "length"
        ids = array("I", rng.randbytes(4 * length))
        tokens = [t % self.config.vocab_size for t in ids]
        if reason == "stop":
            tokens[-1] = self.config.eos_token_id
        return tokens, reason

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """Serve one /v1/completions body the way vLLM answers TRL."""
        adapter = self.model_key(body.get("model"))
        prompt = _parse_prompt(body.get("prompt"))
        if body.get("stream"):
            raise _bad("simulator: streaming is not modelled")
        if body.get("n", 1) != 1:
            raise _bad("simulator: only n=1 is modelled (TRL sends one request per sample)")
        max_tokens = body.get("max_tokens", 16)
        if type(max_tokens) is not int or max_tokens < 1:
            raise _bad("max_tokens must be a positive integer", "max_tokens")
        if max_tokens > self.config.max_model_len:
            raise _bad(
                f"max_tokens={max_tokens} cannot be greater than max_model_len="
                f"{self.config.max_model_len}. Please request fewer output tokens. "
                f"(parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )
        if len(prompt) + max_tokens > self.config.max_model_len:
            raise _bad(
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                f"messages, {max_tokens} in the completion)."
            )
        seed = body.get("seed")
        if seed is None:
            seed = hash(tuple(prompt))
        elif type(seed) is not int:
            raise _bad("seed must be an integer")
        output, reason = self.sample_output(seed, max_tokens)
        hashes = self.engine.hash_blocks(prompt, adapter, self.config.block_size)
        loop = asyncio.get_running_loop()
        self._ids += 1
        req = SimRequest(
            prompt,
            output,
            adapter,
            hashes,
            self.engine.clock.now(),
            loop.create_future(),
            number=self._ids,
        )
        await self.engine.generate(req)
        if req.aborted:
            output, reason = req.output, "abort"
        choice: dict[str, Any] = {
            "index": 0,
            "text": "<" + "><".join(map(str, output)) + ">" if output else "",  # "<id><id>..."
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
            "prompt_logprobs": None,
            "routed_experts": None,
        }
        if body.get("logprobs") is not None:
            rng = random.Random(seed ^ 0x5EED)
            lps = [-(b / 64.0) for b in rng.randbytes(len(output))]
            toks = [f"token_id:{t}" for t in output]
            choice["logprobs"] = {
                "text_offset": list(range(len(output))),
                "token_logprobs": lps,
                "tokens": toks,
                "top_logprobs": [{t: lp} for t, lp in zip(toks, lps, strict=True)],
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = output
            choice["prompt_token_ids"] = prompt
        return {
            "id": f"cmpl-sim{self.index}-{req.number}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.config.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(output),
                "total_tokens": len(prompt) + len(output),
                # What vLLM reports with --enable-prompt-tokens-details.
                "prompt_tokens_details": {"cached_tokens": req.hit_tokens},
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "service_tier": None,
            "system_fingerprint": "vllm-simulator",
            "metrics": None,
        }

    async def load_adapter(self, body: dict[str, Any]) -> str:
        name, path = self.adapters.check_load(body)
        await asyncio.sleep(self.engine.clock.real_delay(self.config.lora_load_s))
        return self.adapters.add(name, path)

    def unload_adapter(self, body: dict[str, Any]) -> str:
        return self.adapters.unload(body)

    def models(self) -> dict[str, Any]:
        return models_payload(
            self.config.model, self.config.max_model_len, self.adapters, created=self._created
        )

    def server_info(self) -> dict[str, Any]:
        c = self.config
        return server_info_json(
            c.model,
            c.max_model_len,
            block_size=c.block_size,
            num_gpu_blocks=c.kv_blocks,
            max_loras=c.max_loras,
            max_lora_rank=c.max_lora_rank,
            max_num_seqs=c.max_num_seqs,
        )

    def metrics(self) -> str:
        e = self.engine
        labels = f'engine="0",model_name="{self.config.model}"'
        return metrics_text(
            self.config.model,
            running=len(e.running),
            waiting=len(e.waiting),
            block_size=self.config.block_size,
            num_gpu_blocks=self.config.kv_blocks,
            prefix_cache_queries=e.stats.queries_tokens,
            prefix_cache_hits=e.stats.hit_tokens,
            extra=[
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {e.cache.used_blocks / e.cache.capacity}",
                "# TYPE vllm:lora_requests_info gauge",
                f'vllm:lora_requests_info{{max_lora="{self.config.max_loras}",'
                f'running_lora_adapters="{",".join(self.adapters)}",waiting_lora_adapters=""}} '
                f"{time.time()}",
            ],
        )

    def reset_stats(self) -> None:
        """Start a measurement cold: zero the counters and empty the prefix cache."""
        self.engine.restart_stats()
        self.engine.cache.reset()

    def sim_stats(self, include_log: bool = True) -> dict[str, Any]:
        s = self.engine.stats
        out: dict[str, Any] = {
            "replica": self.index,
            "busy_s": s.busy_s,
            "prefill_s": s.prefill_s,
            "decode_s": s.decode_s,
            "seq_s": s.seq_s,
            "queries_tokens": s.queries_tokens,
            "hit_tokens": s.hit_tokens,
            "requests": s.requests,
            "finished": s.finished,
            "generated_tokens": s.generated_tokens,
            "prefilled_tokens": s.prefilled_tokens,
            "max_waiting": s.max_waiting,
            "cache_resets": s.resets,
            "paused_s": s.paused_s,
            "pauses": s.pauses,
            "evictions": self.engine.cache.evictions,
            "recomputed_tokens": self.engine.cache.recomputed_blocks * self.config.block_size,
            "kv_block_s": s.kv_block_s,
            "mem_blocked_s": s.mem_blocked_s,
            "waiting_s": s.waiting_s,
            "kv_blocks": self.config.kv_blocks,
            "cached_blocks": self.engine.cache.cached_blocks,
            "adapters": list(self.adapters),
            "last_pause_mode": self.engine.last_pause_mode,
            "config": dataclasses.asdict(self.config),
        }
        if include_log:
            out["log"] = [list(row) for row in s.log]
        return out


async def _json_body(request: Request) -> dict[str, Any]:
    # orjson, not request.json(): the simulator's own CPU per request competes with the router
    # under test for this machine's two cores, so it is kept as small as the wire shape allows
    # (an 8k-token agentic prompt parses ~3x faster); identical for every router.
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raise validation_error("body: JSON decode error", "body.0") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def create_app(replica: Replica) -> Starlette:
    """The ASGI app of one replica. The engine starts with the app's lifespan (or call
    ``replica.engine.start()`` when driving the app without one, e.g. through ASGITransport)."""

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse(replica.models())

    async def server_info(request: Request) -> Response:
        if request.query_params.get("config_format", "text") == "json":
            return JSONResponse(replica.server_info())
        return JSONResponse(server_info_text(replica.config.model, replica.config.max_model_len))

    async def completions(request: Request) -> Response:
        try:
            answer = await replica.complete(await _json_body(request))
            return Response(orjson.dumps(answer), media_type="application/json")
        except VllmError as exc:
            return _error_response(exc)

    async def load(request: Request) -> Response:
        try:
            # vLLM answers a bare text body without a Content-Type header.
            return Response((await replica.load_adapter(await _json_body(request))).encode())
        except VllmError as exc:
            return _error_response(exc)

    async def unload(request: Request) -> Response:
        try:
            return Response(replica.unload_adapter(await _json_body(request)).encode())
        except VllmError as exc:
            return _error_response(exc)

    async def pause(request: Request) -> Response:
        try:
            mode = pause_mode(request.query_params.get("mode"))
            clear = query_flag(request.query_params.get("clear_cache"), default=True)
        except VllmError as exc:
            return _error_response(exc)
        await replica.engine.pause(mode)
        if clear:
            replica.engine.reset_cache()
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        replica.engine.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": replica.engine.paused})

    async def reset_prefix_cache(request: Request) -> Response:
        replica.engine.reset_cache()
        return JSONResponse({"success": True})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(replica.metrics(), media_type="text/plain; version=0.0.4")

    async def sim_stats(request: Request) -> Response:
        include_log = request.query_params.get("log", "1") != "0"
        return JSONResponse(replica.sim_stats(include_log))

    async def sim_reset(request: Request) -> Response:
        replica.reset_stats()
        return JSONResponse({"status": "reset"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        replica.engine.start()
        try:
            yield
        finally:
            await replica.engine.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/reset", sim_reset, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


# --------------------------------------------------------------------------------------------
# Serving a fleet from one process.


def _bind(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit TCP_NODELAY from the listener (Linux). Without it, an answer
    # written in two sends (headers, then body) waits for the client's delayed ACK on a
    # kept-alive connection: 40 ms per request (measured: aiohttp 44 ms, a fresh curl 2 ms),
    # which time_scale magnifies into a simulated fraction of a second for every router.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve_fleet(count: int, config: SimConfig, host: str = "127.0.0.1") -> None:
    """Serve ``count`` replicas (one shared simulated clock) until SIGTERM or SIGINT.

    All replicas share one event loop: on 2 cores one process costs less than eight, and each
    replica's work is a few wake-ups per request.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the fleet handles signals itself
            yield

    clock = SimClock(config.time_scale)
    sockets = [_bind(host) for _ in range(count)]
    servers = []
    publishers: list[Any] = []
    for i in range(count):
        replica = Replica(config, clock, index=i)
        if config.kv_events:
            from bench.harness.kv_events_publisher import publish_events

            publishers.append(publish_events(replica.engine, config.block_size, host))
        app = create_app(replica)
        cfg = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=30
        )
        servers.append(_Server(cfg))
    loop = asyncio.get_running_loop()

    def _stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop)
    tasks = [
        asyncio.create_task(s.serve(sockets=[sock]))
        for s, sock in zip(servers, sockets, strict=True)
    ]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.01)
    ports = [sock.getsockname()[1] for sock in sockets]
    kv = {"kv_events": [f"{p.endpoint}|{p.replay_endpoint}" for p in publishers]}
    print(json.dumps({"ports": ports, **(kv if publishers else {})}), flush=True)
    await asyncio.gather(*tasks)
    for p in publishers:
        await p.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.harness.simulator", description="Serve simulated vLLM replicas."
    )
    parser.add_argument("--replicas", type=int, default=2, help="number of replicas (default 2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--config",
        default="{}",
        help="JSON object of SimConfig overrides, e.g. '{\"kv_blocks\": 4096}'",
    )
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    try:
        overrides = json.loads(args.config)
        if not isinstance(overrides, dict):
            raise ValueError("--config must be a JSON object")
        config = SimConfig.from_overrides(overrides)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    asyncio.run(serve_fleet(args.replicas, config, args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
