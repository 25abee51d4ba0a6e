"""The oracle a router's prefix-cache hit rate is compared with.

Definition (also printed in the report): one LRU cache holding the whole fleet's capacity
(``replicas * kv_blocks`` blocks) that sees every request of the run, in the order the client sent
them, as if every request had been routed to the replica holding its prefix and replicas pooled
their memory. For each request, at its send time, it counts the longest cached chain of full
blocks of the prompt (at most ``(len(prompt) - 1) // block_size`` blocks, vLLM's cap) as hit
tokens and caches the prompt's full blocks; at its receive time it caches the generated full
blocks (as a replica does: a clear in between leaves the prompt part uncached). The cache is
cleared when the client sent a call that cleared the replicas' caches (TRL's
``/pause?mode=keep``: vLLM resets the prefix cache on pause). Blocks are keyed by adapter
``(name, path)`` like the simulator's.

It is an upper bound for any router on the same trace: a replica sees a prompt no earlier than the
oracle does, registers blocks no earlier, and has at most a share of the pooled capacity; pinned
running blocks, which a replica cannot evict, are ignored by the oracle.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.harness.simulator import SimConfig, block_hashes
from bench.harness.workload import RequestRecord


@dataclass(frozen=True)
class OracleResult:
    hit_tokens: int
    query_tokens: int
    # Hit tokens of each successful record, in the order given (for per-request comparisons).
    per_request: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int], limit: int) -> int:
        n = 0
        for h in hashes[: max(limit, 0)]:
            if h not in self._d:
                break
            n += 1
        return n

    def touch(self, hashes: Iterable[int]) -> None:
        d = self._d
        for h in hashes:
            if h in d:
                d.move_to_end(h)
            else:
                d[h] = None
        while len(d) > self.capacity:
            d.popitem(last=False)

    def refresh(self, hashes: Iterable[int]) -> None:
        """Mark present ``hashes`` as recently used; absent ones stay absent."""
        d = self._d
        for h in hashes:
            if h in d:
                d.move_to_end(h)

    def clear(self) -> None:
        self._d.clear()


def oracle_hits(
    records: Iterable[RequestRecord],
    cache_clears: Iterable[float],
    *,
    capacity_blocks: int,
    block_size: int,
) -> OracleResult:
    """Replay ``records`` (successful ones) and ``cache_clears`` (send times of the calls that
    cleared the replicas' caches) through one pooled LRU cache."""
    if capacity_blocks <= 0 or block_size <= 0:
        raise ValueError("capacity_blocks and block_size must be > 0")
    # (time, kind, index, record): at equal times clears go first, then arrivals, then completions.
    events: list[tuple[float, int, int, RequestRecord | None]] = []
    for t in cache_clears:
        events.append((t, 0, 0, None))
    for i, record in enumerate(records):
        if record.error is not None:
            continue
        events.append((record.t_send, 1, i, record))
        events.append((record.t_recv, 2, i, record))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    cache = _LRU(capacity_blocks)
    per: dict[int, int] = {}
    queries = 0
    for _, kind, i, rec in events:
        if rec is None:
            cache.clear()
            continue
        adapter = (rec.model, rec.adapter_path)
        if kind == 1:
            hashes = block_hashes(rec.prompt, adapter, block_size)
            n = cache.match(hashes, (len(rec.prompt) - 1) // block_size)
            per[i] = n * block_size
            queries += len(rec.prompt)
            cache.touch(hashes)
        else:
            # Like a replica: the prompt's blocks were cached on arrival (a clear since then
            # dropped them); the reply adds the generated full blocks.
            n_prompt = len(rec.prompt) // block_size
            hashes = block_hashes(rec.prompt + rec.completion, adapter, block_size)
            cache.refresh(hashes[:n_prompt])
            cache.touch(hashes[n_prompt:])
    ordered = tuple(per[i] for i in sorted(per))
    return OracleResult(sum(ordered), queries, ordered)


def throughput_ceiling(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    oracle_hit_tokens: Sequence[int],
    *,
    replicas: int,
    concurrency: int,
    sim: SimConfig,
) -> float:
    """Generated tokens/s (simulated) of a router with perfect affinity and perfect balance.

    The same successful requests (their prompt and completion lengths), each prefilling only
    what the oracle could not hit (``oracle_hit_tokens``), on ``replicas`` replicas that all run
    the same batch for the whole run: ``concurrency`` requests (TRL's rollouts in flight) shared
    evenly, at most the batch slots. Each replica spends its share of the prefill time plus its
    share of the decode time (prefill holds the batch, as in the simulator). Decode tokens/s
    grow with the batch, and no router's average batch exceeds this one, so it bounds every
    router from above; KV capacity is not a bound here (concurrent requests of a group share
    their prompt's blocks), nor are syncs, ramp-up and drain, so no router reaches it.
    """
    if replicas < 1 or concurrency < 1:
        raise ValueError("replicas and concurrency must be >= 1")
    if not len(prompt_tokens) == len(completion_tokens) == len(oracle_hit_tokens):
        raise ValueError("one prompt, completion and oracle figure per request")
    generated = sum(completion_tokens)
    if not generated:
        return math.nan
    prefill_tokens = sum(prompt_tokens) - sum(oracle_hit_tokens)
    batch = min(concurrency / replicas, sim.max_num_seqs)
    decode_tok_s = batch / sim.step_seconds(batch)
    prefill_s = prefill_tokens * sim.prefill_us_per_token / 1e6
    return generated / ((prefill_s + generated / decode_tok_s) / replicas)
