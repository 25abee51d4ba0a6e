"""What each replica really holds, from vLLM's KV-cache events (pure: no I/O, no asyncio, no zmq).

``ReplicaView`` keeps one replica's cached block keys (the low 64 bits of vLLM's block digests,
which ``proxy.core.hashing.VllmHasher`` reproduces) and decides from sequence numbers alone
whether they are the whole truth (``live``). ``PreciseMatcher`` scores a replica with a live
view by what it holds, every other by what the proxy sent it. Every field of a batch is
untrusted: a malformed batch is counted, skipped, and drops the view until the next
resynchronisation point. docs/kv-events.md describes the model.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from itertools import count, islice, takewhile
from typing import Any, NamedTuple, Protocol

from proxy.core.policy import CostModel
from proxy.core.prefix_index import PrefixIndex
from proxy.core.reach import mask_of, prefix_reach, specific

_MASK64 = (1 << 64) - 1

# One replica's cache: an H100-80GB serving the recipe's 1.5B model holds ~140k blocks of 16
# tokens (bench/harness/simulator.py sizes it); 2**18 keys leaves room for a 2x larger cache.
DEFAULT_VIEW_CAPACITY = 262_144
# Events lag routing: blocks just sent to a replica count as held until it reports them, or for
# at most the time a request may wait in a busy replica's queue; the recipe's rollouts take
# ~4-30 s end to end, so 30 s bounds the staleness of a claim nothing confirmed.
PENDING_TTL_S = 30.0
# Blocks awaiting confirmation per replica: a few hundred requests in flight x up to 256 blocks.
MAX_PENDING_BLOCKS = 65_536
# Predictions awaiting the replica's answer (one per routed request in flight). TRL keeps at most
# a few hundred rollouts in flight; 65,536 means only a leak could ever push one out.
MAX_PENDING_PREDICTIONS = 65_536
# Requests whose blocks a view counts as pinned (routed there, not yet answered): a few hundred
# in flight fleet-wide; an answer that never comes back is forgotten oldest first past this.
MAX_HELD_REQUESTS = 4_096
# Tokens a request reserves on admission until answers say otherwise: the cost model's figure
# (CostModel says how it is sized), so the eviction horizon and the memory price agree.
EXPECTED_OUTPUT_TOKENS = int(CostModel().expected_output_tokens)
# Then the mean completion of the last OUTPUT_WINDOW answers (``PreciseMatcher.observe_output``):
# what a request really reserves is its own output. 256: a GRPO step's rollouts (TRL's batch x
# group), so the mean follows the policy's answer length from one step to the next.
OUTPUT_WINDOW = 256
# The longest answer counted: the longest context of the models served (131,072 tokens); beyond
# it a replica's figure is nonsense.
MAX_OUTPUT_TOKENS = 131_072

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"
# The proxy's hashes are taken to differ from a replica's once this many blocks predicted there
# expired unreported while none was ever reported (``ReplicaView.hashes_match``). With equal
# hashes new blocks are reported within one scheduler step, so only 16 prompts of 16 blocks that
# all failed before being scheduled could leave 256 unconfirmed.
HASH_REFUTE_AFTER_BLOCKS = 256
# Only blocks in accelerator memory serve prefix hits for routing; vLLM tags them "GPU" (or omits
# the field on older versions). Offloaded tiers ("CPU", connectors) are ignored.
ROUTED_MEDIA = (None, "GPU")
# What msgpack decodes an array to, built once: an inline ``list | tuple`` builds a union at
# every isinstance, several times the check's own cost on the per-event path.
_ARRAY = (list, tuple)


class MalformedBatch(ValueError):
    """A batch that does not have vLLM's documented shape (the message says where)."""


class KvEvent(NamedTuple):
    """One parsed event (~130 per routed request under memory pressure: built by
    ``tuple.__new__``, without the named tuple's Python frame)."""

    kind: str  # STORED, REMOVED or CLEARED
    keys: tuple[int, ...] = ()


_new_tuple = tuple.__new__


class BlockEvent(Protocol):
    """What the view reads of an event: a ``KvEvent``, or the typed decoder's struct
    (proxy/kv_events.py), so a batch need not be copied into tuples."""

    @property
    def kind(self) -> str: ...

    @property
    def keys(self) -> Sequence[int]: ...


def _block_key(value: Any) -> int:
    """A block key as the view stores it: vLLM sends uint64 ints (the default) or, with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, the digest bytes (low 64 bits, big-endian)."""
    if type(value) is int and 0 <= value <= _MASK64:  # a bool is no block hash
        return value
    if isinstance(value, bytes | bytearray) and len(value) >= 8:
        return int.from_bytes(value, "big") & _MASK64
    raise MalformedBatch("a block hash is neither a uint64 nor a digest of 8+ bytes")


# Positional layouts of older vLLM versions (array_like events: tag first, then the fields).
_POSITIONAL = {STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium"),
               REMOVED: ("block_hashes", "medium"),
               CLEARED: ()}  # fmt: skip


def parse_event(raw: Any) -> KvEvent | None:
    """One decoded event, or None for a well-formed event of a kind routing does not use
    (an unknown type from a newer vLLM, another storage medium)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, _ARRAY) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_POSITIONAL.get(kind, ()), raw[1:], strict=False))
    else:
        raise MalformedBatch(f"an event is a {type(raw).__name__}, not a map")
    if not isinstance(kind, str):
        raise MalformedBatch("an event has no string 'type'")
    if kind == CLEARED:
        return KvEvent(CLEARED)
    if kind not in (STORED, REMOVED):
        return None
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, _ARRAY):
        raise MalformedBatch(f"{kind}'s block_hashes is not a list")
    # vLLM sends one BlockRemoved per evicted block: a single key skips building a map.
    keys = (_block_key(hashes[0]),) if len(hashes) == 1 else tuple(map(_block_key, hashes))
    if fields.get("medium") not in ROUTED_MEDIA:
        return None
    return _new_tuple(KvEvent, (kind, keys))


def batch_fields(payload: Any) -> tuple[Any, Any] | None:
    """(ts, events) of one decoded batch: ``[ts, events, dp_rank]`` (vLLM <= 0.33, array-like)
    or ``{"ts", "events", "data_parallel_rank"}`` (map-encoded); None for neither."""
    if isinstance(payload, dict):
        return payload.get("ts"), payload.get("events")
    if isinstance(payload, _ARRAY) and len(payload) >= 2:
        return payload[0], payload[1]
    return None


def root_block(payload: Any) -> tuple[list[int], int] | None:
    """From a decoded batch, the token ids and reported key of a block that starts a base-model
    chain (no parent, no LoRA, no salt or other extra keys): the one block whose key depends on
    nothing but the replicas' hash algorithm and seed, so the proxy can check its own hashes
    against it. None when the batch has no such block (or is malformed)."""
    fields = batch_fields(payload)
    if fields is None or not isinstance(fields[1], _ARRAY):
        return None
    for e in fields[1]:
        if not isinstance(e, dict) or e.get("type") != STORED:
            continue
        if e.get("parent_block_hash") is not None or e.get("lora_name") or e.get("lora_id"):
            continue
        extra, hashes, tokens, size = (
            e.get("extra_keys"), e.get("block_hashes"), e.get("token_ids"), e.get("block_size"),
        )  # fmt: skip
        if extra is not None and (not isinstance(extra, list) or not extra or extra[0]):
            continue
        if not (isinstance(hashes, list) and hashes and isinstance(size, int) and size > 0):
            continue
        if not isinstance(tokens, list) or len(tokens) < size:
            continue
        first = tokens[:size]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in first):
            continue
        try:
            return first, _block_key(hashes[0])
        except MalformedBatch:
            continue
    return None


def parse_batch(payload: Any) -> list[KvEvent]:
    """The routed events of one decoded batch (``batch_fields``). Raises MalformedBatch."""
    fields = batch_fields(payload)
    if fields is None or not isinstance(fields[1], _ARRAY):
        raise MalformedBatch("a batch is not [ts, events, rank] with a list of events")
    parsed = (parse_event(e) for e in fields[1])
    return [e for e in parsed if e is not None]


class ReplicaView:
    """One replica's cached block keys, and whether they are the whole truth.

    Past ``capacity`` blocks the oldest-stored keys are forgotten: the view then under-reports,
    which scores the replica lower than it deserves, never higher.
    """

    def __init__(self, capacity: int = DEFAULT_VIEW_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("view capacity must be >= 1 block")
        self.capacity = capacity
        self.blocks: dict[int, None] = {}
        # Sent here, not yet reported stored: key -> deadline (see PENDING_TTL_S).
        self.pending: OrderedDict[int, float] = OrderedDict()
        # The eviction model (``doomed``): vLLM frees a finished request's blocks to the tail of
        # an LRU queue and evicts from its head. Events do not report frees, so a request's
        # prompt blocks are marked freed when its answer comes back (``release``). key -> freed
        # stamp; a plain dict keeps insertion order at half an OrderedDict's cost per pin / free.
        self.freed: dict[int, int] = {}
        self._tick = count()
        self.pins: Counter[int] = Counter()  # key -> requests in flight here that hold it
        # In flight here, oldest first: token -> (prompt keys, blocks it must allocate, time
        # after which it no longer counts as waiting: see ``doomed``).
        self.held: OrderedDict[int, tuple[Sequence[int], int, float]] = OrderedDict()
        self.live = False  # the keys are exactly what the replica holds
        self.next_seq: int | None = None  # the sequence number expected next
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.malformed = 0
        self.resyncs = 0
        self.dropped = 0  # times the view stopped being trusted
        self.overflow = 0  # keys forgotten to respect ``capacity``
        # Whether the proxy's exact hashes reproduce this replica's keys (None: unknown; False:
        # wrong PROXY_VLLM_HASH_SEED or algorithm, routed on the index): docs/kv-events.md,
        # "Hash check".
        self.hashes_match: bool | None = None
        self.predictions_confirmed = 0  # predicted blocks the replica reported
        self.predictions_expired = 0  # predicted blocks that expired unreported

    @property
    def usable(self) -> bool:
        return self.live and self.hashes_match is not False

    def __len__(self) -> int:
        return len(self.blocks)

    def gap_before(self, seq: int) -> int | None:
        """Check ``seq`` before applying its batch. None: apply it now. Otherwise the batches
        from the returned sequence number up to ``seq`` are missing: replay them (``apply``
        each, in order), then ``close_gap(seq)``, then ``apply`` this batch."""
        expected = self.next_seq
        if seq == 0:
            self.next_seq = 0  # a new publisher (``apply`` resets the view)
            return None
        if expected is None:
            self.next_seq = 0  # joined late: everything from the publisher's start is missing
            return 0
        if seq == expected:
            return None
        if seq < expected:
            # Numbers went backwards without a 0: a restarted publisher whose start was missed.
            self.drop()
            self.next_seq = 0
            return 0
        self.gaps += 1
        return expected

    def close_gap(self, seq: int) -> bool:
        """After a replay attempt: True when it filled the gap up to ``seq`` exactly; otherwise
        the view is dropped (it may have missed a removal or a reset) and numbering resumes at
        ``seq``."""
        if self.next_seq == seq:
            return True
        self.drop()
        self.next_seq = seq
        return False

    def apply(self, seq: int, payload: Any) -> bool:
        """Apply the decoded batch numbered ``seq`` if it is the one expected (replays may
        overlap what was already applied)."""
        try:
            events: Sequence[BlockEvent] | None = parse_batch(payload)
        except MalformedBatch:
            events = None
        return self.apply_events(seq, events)

    def apply_events(self, seq: int, events: Sequence[BlockEvent] | None) -> bool:
        """``apply`` for a batch already parsed (None: it was malformed)."""
        if self.next_seq is not None and seq != self.next_seq:
            return False
        self.next_seq = seq + 1
        self.batches += 1
        if seq == 0:
            # A publisher at 0 just started: its cache is empty whatever came before.
            self._reset(True)
        if events is None:
            self.malformed += 1
            self.drop()
            return True
        blocks, pending, freed, pins, tick = (
            self.blocks, self.pending, self.freed, self.pins, self._tick
        )  # fmt: skip
        confirmed = 0
        self.events += len(events)
        for event in events:
            kind = event.kind
            if kind == STORED:
                # Keys nobody pins (generated blocks, another client's) count as freed when stored.
                for key in event.keys:
                    blocks[key] = None  # idempotent: vLLM's "full" report mode re-reports hits
                    if pending and pending.pop(key, None) is not None:
                        confirmed += 1
                    if key not in pins and key not in freed:
                        freed[key] = next(tick)
            elif kind == REMOVED:
                for key in event.keys:
                    blocks.pop(key, None)
                    freed.pop(key, None)
                    if pending and pending.pop(key, None) is not None:
                        confirmed += 1
            else:  # AllBlocksCleared: the cache is empty from here on
                self._reset(True)
                blocks, pending, freed = self.blocks, self.pending, self.freed
        if confirmed:
            self.predictions_confirmed += confirmed
            if self.hashes_match is None:
                self.hashes_match = True
        overflow = len(blocks) - self.capacity
        if overflow > 0:
            for key in list(islice(blocks, overflow)):
                del blocks[key]
                freed.pop(key, None)
            self.overflow += overflow
        return True

    def _reset(self, live: bool) -> None:
        if live and not self.live:
            self.resyncs += 1
        elif self.live and not live:
            self.dropped += 1
        self.live = live
        self.blocks = {}
        self.pending = OrderedDict()
        self.freed = {}

    def drop(self) -> None:
        """Stop trusting the view (a gap that could not be replayed, a malformed batch, the
        replica restarted or left): routing falls back to the index for this replica."""
        self._reset(False)

    def forget(self) -> None:
        """The replica went away (ejected, removed, restarting): start over, wait for seq 0."""
        self.drop()
        self.next_seq = None

    def expect(self, keys: Sequence[int], now: float) -> None:
        """``keys`` were just sent here: count them as held until reported (PENDING_TTL_S)."""
        pending, blocks = self.pending, self.blocks
        deadline = now + PENDING_TTL_S
        for key in keys:
            if key not in blocks:
                pending[key] = deadline
                pending.move_to_end(key)
        while len(pending) > MAX_PENDING_BLOCKS:
            pending.popitem(last=False)

    def hold(self, token: int, keys: Sequence[int], now: float = 0.0) -> None:
        """A request with prompt blocks ``keys`` was just routed here: they are pinned (not
        evictable) until ``release(token)``; the ones not cached must be allocated."""
        pins, freed, blocks = self.pins, self.freed, self.blocks
        new = 0
        for key in keys:
            pins[key] += 1
            freed.pop(key, None)
            if key not in blocks:
                new += 1
        held = self.held
        held[token] = (keys, new, now + PENDING_TTL_S)
        while len(held) > MAX_HELD_REQUESTS:
            self.release(next(iter(held)))

    def release(self, token: int) -> None:
        """The request ``token`` finished: its blocks no other request here pins are freed, to
        the LRU tail in reverse order (its first block is evicted last), as vLLM frees them."""
        entry = self.held.pop(token, None)
        if entry is None:
            return
        pins, freed, blocks, tick = self.pins, self.freed, self.blocks, self._tick
        for key in reversed(entry[0]):
            n = pins[key] - 1
            if n > 0:
                pins[key] = n
                continue
            pins.pop(key, None)
            if key in blocks:
                freed.pop(key, None)
                freed[key] = next(tick)

    def doomed(self, capacity_blocks: int, output_blocks: int, now: float = 0.0) -> int:
        """The freed-stamp up to which cached blocks will have been evicted before a request
        routed here now is admitted, or -1 for none (the allocations fit, or the capacity is
        unknown: 0). vLLM's rules: FCFS admission reserves a request's prompt blocks not held +
        ``output_blocks``; past the free pool each allocation evicts the least recently freed
        unpinned block. So requests routed here and not yet admitted (last prompt block not yet
        reported) evict ``their allocations - free blocks`` from the head of ``freed``; one still
        waiting PENDING_TTL_S after routing no longer counts (its answer may never come back)."""
        freed = self.freed
        if capacity_blocks <= 0 or not freed:
            return -1
        blocks = self.blocks
        waiting = admitted = 0
        for keys, new, deadline in self.held.values():
            if keys and keys[-1] not in blocks:
                if deadline > now:
                    waiting += new + output_blocks
            else:
                admitted += 1
        free = capacity_blocks - len(blocks) - admitted * output_blocks
        evictions = waiting - max(free, 0)
        if evictions <= 0:
            return -1
        if evictions >= len(freed):
            return next(reversed(freed.values()))
        return next(islice(freed.values(), evictions - 1, None))

    def held_prefix(self, keys: Sequence[int], now: float = 0.0, doomed: int = -1) -> int:
        """How many leading ``keys`` the replica holds or was just sent (vLLM's own hit also
        stops at the first missing block), not counting blocks it will have evicted before the
        request is admitted (freed up to the stamp ``doomed``)."""
        blocks, pending = self.blocks, self.pending
        expired = 0
        while pending:
            key, deadline = next(iter(pending.items()))
            if deadline > now:
                break
            del pending[key]
            expired += 1
        if expired:
            self.predictions_expired += expired
            if (
                self.hashes_match is None
                and not self.predictions_confirmed
                and self.predictions_expired >= HASH_REFUTE_AFTER_BLOCKS
            ):
                self.hashes_match = False
        # The held run first at C speed (takewhile), then blocks just sent, only in ``pending``.
        n = len(list(takewhile(blocks.__contains__, keys)))
        if doomed >= 0:
            for i, stamp in enumerate(map(self.freed.get, islice(keys, n))):
                if stamp is not None and stamp <= doomed:
                    return i
        if pending:
            for key in islice(keys, n, None):
                if key not in blocks and key not in pending:
                    break
                n += 1
        return n


class PreciseMatcher:
    """Per-replica specific-prefix lengths with the events view where it is live.

    The common-prefix rule is the router's (proxy/core/reach.py): holding comes from the
    replica's live view, else from the index; branching comes from the index, which records
    every routed request whichever source scores it. With no live view the result is exactly
    ``Router.specific_matches`` (a property test checks it). Per routed decision it remembers
    how many prompt blocks the chosen replica was expected to hold (``routed``), so the
    replica's reported hit can be compared with it.
    """

    def __init__(
        self,
        views: dict[int, ReplicaView],
        clock: Callable[[], float] = time.monotonic,
        block_size: Callable[[], int] = lambda: 16,
    ) -> None:
        self.views = views
        self._clock = clock
        self._block_size = block_size
        # Each replica's KV cache in tokens, as scraped for the router (proxy/health.py fills the
        # router's dict, which is this one). Unknown (absent or 0): no eviction horizon.
        self.capacity_tokens: dict[int, int] = {}
        self._keys: Sequence[int] = ()
        self._reach: dict[int, int] = {}
        self._live_mask = 0
        # Ordered: predictions never read (a streamed answer, a failed request) leave oldest
        # first, in O(1) (a plain dict's front deletions make the next lookup scan).
        self._pending: OrderedDict[int, tuple[int, bool, int]] = OrderedDict()
        # Output tokens a request reserves in the horizon (``doomed``): the answers' running
        # mean once any came back (``observe_output``), the cost model's figure before.
        self.output_tokens = float(EXPECTED_OUTPUT_TOKENS)
        self._outputs = 0

    def live_mask(self, replicas: Sequence[int]) -> int:
        mask = 0
        views = self.views
        for r in replicas:
            view = views.get(r)
            if view is not None and view.usable:
                mask |= 1 << r
        return mask

    def specific_matches(
        self,
        index: PrefixIndex,
        index_keys: Sequence[int],
        event_keys: Sequence[int],
        replicas: Sequence[int],
    ) -> dict[int, int]:
        """As ``Router.specific_matches``. ``index_keys`` key the proxy's index; ``event_keys``
        are the same blocks as vLLM keys them (equal unless the adapter name was reused)."""
        return specific(*self.reach(index, index.lookup(index_keys), event_keys, replicas))

    def reach(
        self,
        index: PrefixIndex,
        values: Sequence[int],
        event_keys: Sequence[int],
        replicas: Sequence[int],
    ) -> tuple[dict[int, int], int]:
        """(reach per replica, common depth) from the index ``values`` just looked up for these
        blocks, with each live view's own reach in place of the index's for its replica."""
        eligible = mask_of(replicas)
        live = self.live_mask(replicas)
        now = self._clock()
        views = self.views
        bs = self._block_size()
        capacity = self.capacity_tokens
        output_blocks = -(-round(self.output_tokens) // bs)
        # What each live view will still hold when the request is admitted there (``doomed``),
        # by reach, shortest first.
        by_reach = sorted(
            (
                views[r].held_prefix(
                    event_keys, now, views[r].doomed(capacity.get(r, 0) // bs, output_blocks, now)
                ),
                r,
            )
            for r in replicas
            if live >> r & 1
        )
        known = len(values)
        depth_limit = max(known, by_reach[-1][0]) if by_reach else known
        held = index.held(values, eligible & ~live)
        branching = index.branching(values)
        if depth_limit > known:
            held += [0] * (depth_limit - known)
            branching += [False] * (depth_limit - known)
        # Each depth gets the live replicas whose views reach past it: one slice per distinct
        # reach, shortest first (a comprehension per slice, not a Python step per depth).
        alive, start = live, 0
        for end, r in by_reach:
            if end > start:
                held[start:end] = [h | alive for h in held[start:end]]
                start = end
            alive &= ~(1 << r)
        reach, common = prefix_reach(held, branching, eligible, replicas)
        self._reach = reach
        self._live_mask = live
        self._keys = event_keys
        if not (live and known):
            return reach, common
        # When the index credits a home (the replica with the longest specific prefix) that no
        # view shows holding less than another: the index's own scoring if the views leave
        # nothing specific anywhere, else the views' reach with the home credited the index's.
        # Why: docs/kv-events.md, "When the views find nothing specific".
        home_reach, home_common = index.reach(values, known, replicas)
        best = max(home_reach.values(), default=0)
        if best <= home_common:
            return reach, common
        if not any(d > common for d in reach.values()):
            return home_reach, home_common
        home = max((r for r in replicas if home_reach[r] == best), key=reach.__getitem__)
        if reach[home] < max(reach.values()) or reach[home] >= best:
            return reach, common
        return {**reach, home: best}, common

    def observe_output(self, tokens: int) -> None:
        """A replica answered with ``tokens`` generated: the mean of the last ~OUTPUT_WINDOW
        answers (an exponential window once that many came back) is what a request reserves."""
        self._outputs = min(self._outputs + 1, OUTPUT_WINDOW)
        # A replica's figure is untrusted: one absurd answer must not move the mean for the
        # next OUTPUT_WINDOW answers, so it counts as at most MAX_OUTPUT_TOKENS.
        tokens = min(max(tokens, 0), MAX_OUTPUT_TOKENS)
        self.output_tokens += (tokens - self.output_tokens) / self._outputs

    def routed(self, decision: object, replica: int) -> None:
        """The last ``reach`` request went to ``replica``: its blocks count as held there until
        its events confirm them, and the prediction is kept for ``outcome``. Keyed by the
        decision's identity: every routed decision is written here when it is made, so a reused
        id is overwritten before it can be read."""
        view = self.views.get(replica)
        token = id(decision)
        if token in self._pending:  # an unanswered decision's id, reused: it is over
            self.outcome(decision)
        if view is not None:
            now = self._clock()
            if view.usable:
                view.expect(self._keys, now)
            view.hold(token, self._keys, now)
        pending = self._pending
        if len(pending) >= MAX_PENDING_PREDICTIONS:
            old, (_, _, at) = pending.popitem(last=False)
            if at in self.views:
                self.views[at].release(old)
        live = bool(self._live_mask >> replica & 1)
        pending[token] = (self._reach.get(replica, 0), live, replica)

    def outcome(self, decision: object) -> tuple[int, bool] | None:
        """(expected blocks, from a live view) for ``decision``, forgetting it: its answer came
        back, so the request no longer pins its blocks on its replica."""
        token = id(decision)
        entry = self._pending.pop(token, None)
        if entry is None:
            return None
        view = self.views.get(entry[2])
        if view is not None:
            view.release(token)
        return entry[0], entry[1]
