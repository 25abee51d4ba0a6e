"""Routing: a request's key -> block hashes -> specific prefix matches -> the policy's pick.

The "common prefix" rule decides which matched blocks count as affinity. A block is common when

1. every eligible replica has already been sent it (no replica is special for it), or
2. two or more *different* next blocks have followed it (a chat template or system prompt
   that many prompts share) -- unless it is the last full block of an earlier request.

Common is inherited by ancestors: if block i is common, blocks 0..i are a shared preamble too.
A replica's affinity is the number of blocks it holds *beyond* the deepest common block.

The exception in rule 2 improves on the published proxy's rule. A multi-turn rollout sends
``prompt + completion + tool output`` as its next prompt, so the rollouts of one group branch
exactly where their previous prompt ended. Under the plain rule the whole original prompt turns
"common" as soon as two rollouts continue it, and every later continuation loses its affinity
and re-prefills the prompt on whichever replica is least loaded. A shared template, by contrast,
is never where a request ends (prompts are longer than their template), so it still becomes
common after the second distinct prompt. tests/unit/test_router.py shows both cases.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from proxy.core.extract import RoutingKey
from proxy.core.hashing import BlockHasher, FastHasher, Namespace
from proxy.core.kv_view import PreciseMatcher
from proxy.core.policy import Candidate, Decision, Policy
from proxy.core.prefix_index import PrefixIndex
from proxy.core.reach import specific

# Namespaces kept ready to reuse, by (model, adapter path, cache salt, epoch): a run names a few
# adapters, but a client may send a fresh cache salt per request, so the cache is emptied when it
# reaches this size rather than grown (building one costs ~20 lookups).
MAX_CACHED_NAMESPACES = 1024

# Names whose purge epoch we remember. Only purged names get an entry; a run publishes a few
# hundred adapter versions, so 4096 is ample, and forgetting the oldest is harmless: its blocks
# have long aged out of the index.
MAX_TRACKED_EPOCHS = 4096


class Router:
    def __init__(
        self,
        hasher: BlockHasher,
        index: PrefixIndex,
        policy: Policy,
        precise: PreciseMatcher | None = None,
    ) -> None:
        self.index = index
        self.policy = policy
        self._epochs: OrderedDict[str, int] = OrderedDict()
        self._next_epoch = 1
        self._namespaces: dict[tuple[str, str | None, str | None, int], Namespace] = {}
        # Given when PROXY_KV_EVENTS is on: scores replicas by the blocks they report (kv_view.py).
        self.precise = precise
        # Each replica's KV cache in tokens, once scraped (health.py); absent: unknown. The
        # matcher's own dict when there is one, so that its views see the same capacities.
        self.kv_capacity_tokens: dict[int, int] = (
            precise.capacity_tokens if precise is not None else {}
        )
        self.use_hasher(hasher)

    def use_hasher(self, hasher: BlockHasher) -> None:
        """Route and learn with ``hasher`` from now on (the replicas' block size or hash
        algorithm, once learned): everything derived from the hasher is rebound with it, so a
        completion's chain continues in the new hasher's blocks."""
        self.hasher = hasher
        # A completion's chain continued in one call where the hasher can (FastHasher: in C when
        # the extension runs); other hashers continue it from the concatenated ids.
        self._extend_tail = hasher.extend_tail if isinstance(hasher, FastHasher) else None

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def namespace(self, key: RoutingKey, lora_path: str | None = None) -> Namespace:
        fields = (key.model, lora_path, key.cache_salt, self._epochs.get(key.model, 0))
        namespace = self._namespaces.get(fields)
        if namespace is None:
            if len(self._namespaces) >= MAX_CACHED_NAMESPACES:
                self._namespaces.clear()
            namespace = self._namespaces[fields] = Namespace(*fields)
        return namespace

    def block_keys(self, key: RoutingKey, lora_path: str | None = None) -> list[int]:
        ns = self.namespace(key, lora_path)
        if key.tokens is not None:
            return self.hasher.hash_tokens(key.tokens, ns)
        assert key.text is not None
        return self.hasher.hash_text(key.text, ns)

    def specific_matches(self, blocks: Sequence[int], replicas: Sequence[int]) -> dict[int, int]:
        """For each replica, how many blocks beyond the common preamble it was already sent."""
        return self.matches(blocks, replicas)[0]

    def matches(self, blocks: Sequence[int], replicas: Sequence[int]) -> tuple[dict[int, int], int]:
        """(specific matches per replica, depth of the common preamble in blocks)."""
        values = self.index.lookup(blocks)
        reach, common = self.index.reach(values, len(values), replicas)
        return specific(reach, common), common

    def route(
        self,
        key: RoutingKey,
        loads: Sequence[tuple[int, float]],
        lora_path: str | None = None,
    ) -> Decision:
        """Pick one of ``loads`` (replica index, current load) for ``key`` and remember that
        the chosen replica now holds the request's prefix."""
        if not loads:
            raise ValueError("no eligible replica")
        policy = self.policy
        if not policy.uses_prefix:
            return policy.choose([Candidate(r, load, 0) for r, load in loads])
        tokens = key.tokens
        hasher = self.hasher
        namespace = self.namespace(key, lora_path)
        if tokens is not None:
            blocks = hasher.hash_tokens(tokens, namespace)
            length = len(tokens)
        else:
            assert key.text is not None
            blocks = hasher.hash_text(key.text, namespace)
            length = key.length
        bs = hasher.block_size
        # vLLM always recomputes the last prompt token, so at most (len-1)//bs blocks can hit.
        matchable = (length - 1) // bs if length else 0
        # One lookup of every block: scoring reads the matchable ones, recording reuses them all.
        index = self.index
        values = index.lookup(blocks)
        # Text prompts without a tokenizer hash approximately: only token ids match vLLM's keys.
        precise = self.precise if tokens is not None else None
        replicas = [r for r, _ in loads]
        if precise is None:
            reach, common = index.reach(values, matchable, replicas)
        else:
            event_keys = self._event_keys(key, lora_path, blocks[:matchable])
            reach, common = precise.reach(index, values[:matchable], event_keys, replicas)
        capacity = self.kv_capacity_tokens
        # What a replica holds beyond the common preamble is its match. With KV events,
        # prefill is priced from what this replica reports holding (its reach): a preamble
        # common because it branches (rule 2) may have been evicted there, and is then
        # prefilled again (kv_events.md, section 2). The index cannot see evictions and prices
        # the common preamble as held everywhere: that is what spreads new prompts sharing a
        # system prompt over the fleet instead of sending each one after the first (priced as
        # missing where never sent, 12 groups in a row went to one of 2 idle replicas:
        # test_group_of_eight_lands_on_one_replica...).
        floor = -1 if precise is not None else common
        candidates = [
            Candidate(
                r,
                load,
                reach[r] - common if reach[r] > common else 0,
                length - (reach[r] if reach[r] > floor else common) * bs,
                length,
                capacity.get(r, 0),
            )
            for r, load in loads
        ]
        decision = policy.choose(candidates)
        index.record(blocks, decision.replica, values)
        # The policy's decision is a fresh object of this request's: completed in place.
        decision.blocks = blocks
        if precise is not None:
            precise.routed(decision, decision.replica)
        return decision

    def _event_keys(self, key: RoutingKey, lora_path: str | None, blocks: list[int]) -> list[int]:
        """``blocks`` as vLLM keys them: the index keys, unless a purge epoch is mixed in."""
        if not self._epochs.get(key.model) or key.tokens is None:
            return blocks
        ns = Namespace(key.model, lora_path, key.cache_salt, 0)
        return self.hasher.hash_tokens(key.tokens, ns)[: len(blocks)]

    @property
    def learns_completions(self) -> bool:
        """Whether ``record_completion`` learns anything: only a prefix-aware policy reads the
        index, so the data path skips reading a completion's ids for the others."""
        return self.policy.uses_prefix

    def record_completion(
        self,
        key: RoutingKey,
        decision: Decision,
        completion: Sequence[int],
        lora_path: str | None = None,
    ) -> None:
        """The replica now also caches the generated tokens: remember ``prompt + completion``.

        A multi-turn rollout's next prompt is ``prompt + completion + tool output``; without
        this the continuation matches only the original prompt, and a request that was frozen
        by a cache-clearing pause and finished afterwards would not be remembered at all."""
        if key.tokens is None or not completion or not self.policy.uses_prefix:
            return
        bs = self.block_size
        full = len(key.tokens) // bs
        if full and len(decision.blocks) == full:
            last = decision.blocks[-1]
            more: list[int] | None
            if self._extend_tail is not None:
                more = self._extend_tail(last, key.tokens, full * bs, completion)
            else:
                tail = list(key.tokens[full * bs :]) + list(completion)
                more = self.hasher.extend(last, tail, self.namespace(key, lora_path))
            if more is not None:
                # The prompt's blocks were recorded when the request was routed; unless the
                # index was cleared meanwhile (a pause), only its last block needs touching
                # again, to link it to what follows. One lookup of that chain says both (it
                # stops at the first unknown block: empty when the last block is unknown).
                keys = [last, *more]
                known = self.index.lookup(keys)
                if known:
                    self.index.record(keys, decision.replica, known)
                else:
                    self.index.record(list(decision.blocks) + more, decision.replica)
                return
        ns = self.namespace(key, lora_path)
        keys = self.hasher.hash_tokens(list(key.tokens) + list(completion), ns)
        self.index.record(keys, decision.replica)

    def purge_model(self, model: str) -> None:
        """Make every block of ``model`` unreachable (adapter unloaded): O(1), the stale
        entries age out of the index."""
        self._epochs[model] = self._next_epoch
        self._epochs.move_to_end(model)
        self._next_epoch += 1
        while len(self._epochs) > MAX_TRACKED_EPOCHS:
            self._epochs.popitem(last=False)

    def purge_all(self) -> None:
        self.index.clear()

    def forget_replica(self, replica: int) -> None:
        self.index.forget_replica(replica)
