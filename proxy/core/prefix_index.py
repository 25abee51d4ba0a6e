"""Bounded map: block hash -> which replicas served it, and whether the prefix branches there.

Memory is the constraint (a router that tracked every block it ever saw is how peers OOM'd in
production), so each entry is one dict slot whose value is a single packed ``int``:

    bit 0       has_child      a longer prefix through this block has been seen
    bit 1       branching      two different next blocks have been seen
    bit 2       request_end    some request's last full block (a multi-turn branch point)
    bits 3..18  child_fp       16-bit fingerprint of the first next block seen
    next W      holders        bitmask of replicas that were sent this block

(W = ``max_replicas``). A 16-bit fingerprint means a second child is missed as "branching" with
probability 1/65536, which costs nothing worse than one prefix treated as specific.

Eviction is approximately LRU with two generations: entries live in ``young`` until it holds
``capacity // 2`` entries, then ``young`` becomes ``old`` and the previous ``old`` is dropped
whole. A lookup that hits ``old`` promotes the entry back into ``young``. Every operation is O(1)
and there is no per-entry linked list (an ``OrderedDict`` costs ~50 more bytes per entry), so an
entry is just its dict slot plus two ints. The index holds between capacity/2 and capacity
entries once warm; what it forgets first is what was touched least recently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from proxy.core.reach import prefix_reach

HAS_CHILD = 1
BRANCHING = 2
REQUEST_END = 4
_FP_SHIFT = 3
_FP_MASK = 0xFFFF
_HOLDERS_SHIFT = 19
_BRANCH_BITS = BRANCHING | REQUEST_END

# 32 replicas behind one proxy process is far beyond the recipe's 2 and keeps each packed value
# within two 30-bit int digits (32 bytes); raise it with PROXY_MAX_REPLICAS for bigger fleets.
DEFAULT_MAX_REPLICAS = 32


# (reach per replica, depth of the common preamble): reach.py's prefix_reach result.
_Reach = tuple[dict[int, int], int]


class PrefixIndex:
    def __init__(self, capacity: int, max_replicas: int = DEFAULT_MAX_REPLICAS) -> None:
        if capacity < 2:
            raise ValueError("index capacity must be >= 2 blocks")
        if max_replicas < 1:
            raise ValueError("max_replicas must be >= 1")
        self.capacity = capacity
        self.max_replicas = max_replicas
        self._half = capacity // 2
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._replica_mask = (1 << max_replicas) - 1
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    # -- decoding ---------------------------------------------------------------------------

    def holders(self, value: int) -> int:
        return (value >> _HOLDERS_SHIFT) & self._replica_mask

    # -- operations -------------------------------------------------------------------------

    def _get(self, key: int) -> int | None:
        value = self._young.get(key)
        if value is not None:
            return value
        value = self._old.pop(key, None)
        if value is not None:
            self._put(key, value)  # promote: it was just used
        return value

    def _put(self, key: int, value: int) -> None:
        young = self._young
        if key not in young and len(young) >= self._half:
            self.evictions += len(self._old)
            self._old = young
            young = self._young = {}
        young[key] = value

    def lookup(self, keys: Sequence[int]) -> list[int]:
        """Packed values of the leading run of ``keys`` that the index knows (stops at the
        first unknown block: by chaining, nothing after it can match)."""
        # The common case, every block in the young generation, in one C-level pass, told by
        # ``all``: a stored value is never 0 (every write sets HAS_CHILD or REQUEST_END, and
        # forget_replica clears only holders), and truth tests cost half what ``None in
        # found``'s comparisons do; ``None not in`` settles the rare falsy list. The miss is
        # then found by ``index`` (after ``in``: raising ValueError costs more than the search).
        found = list(map(self._young.get, keys))
        if all(found) or None not in found:
            return found  # type: ignore[return-value]
        miss = found.index(None)
        del found[miss:]
        for key in keys[miss:]:
            value = self._get(key)
            if value is None:
                break
            found.append(value)
        return found  # type: ignore[return-value]

    def held(self, values: Sequence[int], eligible: int) -> list[int]:
        """Per looked-up block, the bitmask of the ``eligible`` replicas it was sent to."""
        return [(v >> _HOLDERS_SHIFT) & eligible for v in values]

    @staticmethod
    def branching(values: Sequence[int]) -> list[bool]:
        """Per looked-up block: two different continuations seen, none ending a request there."""
        return [v & _BRANCH_BITS == BRANCHING for v in values]

    def reach(self, values: Sequence[int], count: int, replicas: Sequence[int]) -> _Reach:
        """reach.py's ``prefix_reach`` over the first ``count`` (>= 0) looked-up ``values``: (blocks
        each of ``replicas`` holds from the first on, depth of the common preamble)."""
        if count < len(values):
            values = values[:count]
        eligible = 0
        for r in replicas:
            eligible |= 1 << r
        eligible <<= _HOLDERS_SHIFT
        # One pass keeps each block's holders (masked in place, not shifted down) and its branch
        # bits: on most chains both are the same on every block, which one C-level count says.
        kept = eligible | _BRANCH_BITS
        marks = [v & kept for v in values]
        n = len(marks)
        if not n:
            return dict.fromkeys(replicas, 0), 0
        first = marks[0]
        if marks.count(first) == n:
            holders = first & eligible
            if holders == eligible:
                # Every eligible replica holds the whole chain (a prompt spread over the fleet):
                # it is all common, whatever branches.
                return dict.fromkeys(replicas, n), n
            # Each replica holds all of the chain or none of it; it is common only when every
            # block branches.
            common = n if first & _BRANCH_BITS == BRANCHING else 0
            holders >>= _HOLDERS_SHIFT
            return {r: n if holders >> r & 1 else 0 for r in replicas}, common
        held = [m & eligible for m in marks]
        flags = [m & _BRANCH_BITS for m in marks]
        branching = [f == BRANCHING for f in flags] if BRANCHING in flags else []
        return prefix_reach(held, branching, eligible, replicas, _HOLDERS_SHIFT)

    def record(self, keys: Sequence[int], replica: int, known: Sequence[int] | None = None) -> None:
        """Remember that ``replica`` was sent the prefix ``keys`` (a chain, block 0 first).

        ``known``: what ``lookup(keys)`` returned just before, with nothing recorded in between
        (the router looks a prompt up to score it, then records it where it went): the leading
        blocks are not looked up twice. Blocks past the first unknown one are written fresh:
        no lookup could reach them (it stops at the first unknown block), so whatever they held
        is moot. Two dict operations per block, and none for the new tail beyond one ``update``:
        this runs for every routed request."""
        if not 0 <= replica < self.max_replicas:
            raise ValueError(f"replica index {replica} outside 0..{self.max_replicas - 1}")
        n = len(keys)
        holder = (1 << replica) << _HOLDERS_SHIFT
        if n > self._half:
            self._record_each(keys, holder)  # a tiny index: one generation cannot hold it
            return
        if known is None:
            known = self.lookup(keys)
        end = holder | REQUEST_END
        if len(known) == n and n and known[n - 1] & end == end:
            # A prompt sent here before, the usual case for a group's rollouts: a chain through
            # its last block was recorded for this replica, which gave every block before it this
            # holder and its link to the next (holders leave only all blocks at once, with
            # forget_replica; links only gain bits), so rewriting the chain changes nothing.
            return
        young = self._young
        if len(young) + n > self._half:
            # Make room first, so every block below lands in one generation (known blocks
            # promoted by the lookup linger, stale and never read, in the old one until it is
            # dropped; young and old each stay within capacity / 2).
            self.evictions += len(self._old)
            self._old = young
            young = self._young = {}
        _record_chain(young, keys, known, holder)

    def _record_each(self, keys: Sequence[int], holder: int) -> None:
        values = [self._get(key) or 0 for key in keys]
        for key, value in zip(keys, _updated(keys, values, holder), strict=True):
            self._put(key, value)

    def forget_replica(self, replica: int) -> None:
        """Drop ``replica`` from every entry (it restarted, its cache was reset, or it left).
        O(entries); runs on rare fleet events, never per request."""
        clear = ~((1 << replica) << _HOLDERS_SHIFT)
        for gen in (self._young, self._old):
            for key, value in gen.items():
                gen[key] = value & clear

    def clear(self) -> None:
        self._young = {}
        self._old = {}

    def keys(self) -> Iterable[int]:
        yield from self._young
        yield from self._old


def _record_chain(
    young: dict[int, int], keys: Sequence[int], known: Sequence[int], holder: int
) -> None:
    """Write the chain ``keys`` into ``young``: the ``known`` leading blocks updated, the rest
    fresh links, the last one a request's end."""
    k, n = len(known), len(keys)
    if k:
        young.update(zip(keys, _updated(keys, known, holder), strict=False))  # the known ones
    if k < n:
        linked = holder | HAS_CHILD
        young.update(
            zip(
                keys[k : n - 1],
                [linked | ((nk & _FP_MASK) << _FP_SHIFT) for nk in keys[k + 1 :]],
                strict=True,
            )
        )
        young[keys[n - 1]] = holder | REQUEST_END


# A value's link to its first child: HAS_CHILD and the child's fingerprint.
_LINK_MASK = HAS_CHILD | (_FP_MASK << _FP_SHIFT)


def _updated(keys: Sequence[int], values: Sequence[int], holder: int) -> list[int]:
    """``values`` (of the leading ``keys``) with ``holder`` added and each block's link to the
    next one recorded: a first child's fingerprint, or branching when a different one follows;
    the chain's last block marked as a request's end."""
    k = len(values)
    # One comprehension over the blocks (this runs for every routed request): a block already
    # linked to this very child, the usual case for a prompt seen before, only gains the holder.
    links = [HAS_CHILD | ((nk & _FP_MASK) << _FP_SHIFT) for nk in keys[1 : k + 1]]
    out = [
        v | holder
        if v & _LINK_MASK == link
        else (v | holder | BRANCHING if v & HAS_CHILD else v | holder | link)
        for v, link in zip(values, links, strict=False)  # the last block has no link
    ]
    if k == len(keys):
        out.append(values[k - 1] | holder | REQUEST_END)
    return out
