"""vLLM block digests remembered by prefix, so the exact hasher sha256-hashes each block once.

A block's vLLM digest is a pure function of the namespace (adapter name and path, cache salt)
and every token up to the block's end, which the fast mode's 64-bit xxh3 chain over the same
tokens names: ``(namespace, chain key) -> digest`` is looked up instead of recomputed. A GRPO
group's rollouts share their prompt and an agent's next turn extends its last one, so only new
blocks are hashed by vLLM's function (bench/runners/run_kv_events_micro.py measures both).

Exactness: a hit returns the digest vLLM's function gave for that very prefix, whatever was
evicted before. The one assumption is the prefix index's own: two prefixes of one namespace do
not share a 64-bit chain key (~n^2/2^65 for n remembered blocks: 1e-10 at the default bound).
Namespaces are told apart exactly, by an id never reused. The purge epoch is not part of a
digest (it is mixed into index keys afterwards), so namespaces differing only by epoch share
entries.
"""

from __future__ import annotations

from collections import OrderedDict

# Blocks remembered. What must survive is a prefix between its uses: a group's prompt until its
# rollouts are all routed (milliseconds), a rollout's context until its next turn (seconds), for
# every rollout in flight. TRL keeps up to a few hundred in flight (max_inflight_tasks) at up to
# 256 blocks (4,096 tokens): 2**16 blocks covers 256 such contexts. 279 bytes per entry
# (bench/runners/run_kv_events_micro.py), ~18 MB when full. A miss costs one sha256, never a
# wrong key.
DEFAULT_MEMO_BLOCKS = 65_536
# Namespace ids kept (a client may send a fresh cache salt per request): when full the table is
# emptied and ids continue from where they were, so an old id is never given to another
# namespace; entries under a forgotten id simply age out of the memo.
MAX_NAMESPACE_IDS = 4096


class ExactMemo:
    """Bounded LRU of (event key, digest) per block by (namespace id, prefix chain key)."""

    def __init__(self, capacity: int = DEFAULT_MEMO_BLOCKS) -> None:
        if capacity < 0:
            raise ValueError("memo capacity must be >= 0 blocks")
        self.capacity = capacity
        # One int key per block: the namespace id above the 64-bit chain key (a tuple key costs
        # about twice as much to hash).
        self.digests: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
        self._ids: dict[object, int] = {}
        self._next_id = 1
        self.hits = 0
        self.misses = 0

    def namespace_base(self, namespace: object) -> int:
        """The key prefix of ``namespace``: its id shifted above the chain key's 64 bits."""
        ident = self._ids.get(namespace)
        if ident is None:
            if len(self._ids) >= MAX_NAMESPACE_IDS:
                self._ids.clear()
            ident = self._ids[namespace] = self._next_id
            self._next_id += 1
        return ident << 64

    def trim(self) -> None:
        digests = self.digests
        while len(digests) > self.capacity:
            digests.popitem(last=False)
