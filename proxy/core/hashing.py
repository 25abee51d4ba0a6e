"""Chained block hashes: the key that says "this replica has seen this prefix".

Block i's hash covers tokens [0, (i+1)*block_size) through chaining: h_i = H(h_{i-1}, block_i),
so a hit on block i implies blocks 0..i match too and one dict lookup per block finds the
longest shared prefix. Only full blocks are hashed, exactly as vLLM's prefix cache does.

* ``FastHasher`` (default): xxh3-64 over the little-endian uint32 bytes of each block, the chain
  carried in xxh3's 64-bit seed, its root seeded with the namespace (adapter name, cache salt,
  purge epoch). Several times faster than the exact mode (docs/routing.md); its values mean
  nothing to vLLM.
* ``VllmHasher``: vLLM 0.33.0's ``get_request_block_hasher`` bit for bit (tested on every case of
  shared/vectors/vllm_block_hashes.json), to compare the proxy's predictions with vLLM's
  KV-cache events: keys are the low 64 bits (big-endian) of vLLM's digest, what events carry.

Both return plain ``int`` keys so the prefix index does not care which one produced them.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias

import cbor2
import xxhash

from proxy.core.exact_memo import DEFAULT_MEMO_BLOCKS, ExactMemo
from proxy.core.native import module_for

HASH_MODES = ("fast", "exact")
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

# vLLM 0.33.0 seeds the chain with H(PYTHONHASHSEED) and, when that is unset, with this string
# for its reproducible algorithms (shared/REFERENCE.md §3; confirmed by the shared vectors).
VLLM_DEFAULT_SEED = "vllm-none-hash"


class Namespace(NamedTuple):
    """What separates caches: the model or adapter, the adapter's path (vLLM keys LoRA blocks by
    name *and* path), the request's cache salt, and the proxy's purge epoch for this name. A
    named tuple: hashed in C, it is the key of the hashers' per-request seed lookup."""

    model: str
    lora_path: str | None = None
    cache_salt: str | None = None
    epoch: int = 0


class BlockHasher(Protocol):
    mode: str
    block_size: int

    def hash_tokens(self, tokens: Sequence[int], namespace: Namespace) -> list[int]: ...

    def hash_text(self, text: bytes, namespace: Namespace) -> list[int]: ...

    def extend(self, parent: int, tokens: Sequence[int], namespace: Namespace) -> list[int] | None:
        """Keys of the blocks that follow the block keyed ``parent`` (``tokens`` start at a
        block boundary), or None when the chain cannot be resumed from a key alone."""
        ...


# What a chain reads as bytes: text, or packed token ids read in place.
Packed: TypeAlias = "bytes | array[int]"


def _token_bytes(tokens: Sequence[int]) -> tuple[Packed, int]:
    """Packed token ids (any buffer the chain reads as bytes) and the width of one id in bytes.
    Ids validated by extract.py arrive packed already and are chained in place: no copy."""
    if isinstance(tokens, array):
        return tokens, tokens.itemsize
    try:
        packed = array("I", tokens)
    except OverflowError:  # a vocabulary beyond 2**32 ids: never seen, but never wrong either
        packed = array("Q", tokens)
    return packed.tobytes(), packed.itemsize


def _chain(data: Packed, step: int, seed: int) -> list[int]:
    digest = xxhash.xxh3_64_intdigest
    view = memoryview(data).cast("B")  # bytes, or an array's bytes in place
    h = seed
    # A comprehension rather than an append loop: this runs for every routed request.
    return [
        (h := digest(view[start : start + step], h))
        for start in range(0, len(view) - step + 1, step)
    ]


# Chain seeds remembered per namespace: computing one (format, encode, hash) cost ~1.2 us on
# every routed request, looking it up ~0.4. Bounded like the router's namespace cache (a fresh
# cache salt per request is possible): emptied when full.
MAX_CACHED_SEEDS = 1024


class FastHasher:
    """xxh3-64 chained block hashes for routing (the default).

    ``use_native``: chain the blocks in C (proxy/core/_native.c, the same XXH3-64 from the vendored
    xxhash.h; bench/results/micro_request.md) or with the xxhash module (the reference,
    ``_chain``); None: the C extension when it is built. Both give the same keys
    (tests/unit/test_native.py)."""

    mode = "fast"

    def __init__(self, block_size: int, use_native: bool | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._seeds: dict[Namespace, int] = {}
        module = module_for(use_native)
        self.chain: Callable[[Packed, int, int], list[int]] = (
            module.chain if module is not None else _chain
        )
        self._extend_chain: Callable[..., list[int] | None] | None = (
            module.extend_chain if module is not None else None
        )

    def _seed(self, namespace: Namespace) -> int:
        seed = self._seeds.get(namespace)
        if seed is None:
            if len(self._seeds) >= MAX_CACHED_SEEDS:
                self._seeds.clear()
            # NUL separators: a model name cannot contain one, so fields cannot run into each other.
            material = f"{namespace.model}\0{namespace.cache_salt or ''}\0{namespace.epoch}"
            seed = xxhash.xxh3_64_intdigest(material.encode("utf-8", "surrogatepass"))
            self._seeds[namespace] = seed
        return seed

    def hash_tokens(self, tokens: Sequence[int], namespace: Namespace) -> list[int]:
        data, width = _token_bytes(tokens)
        return self.chain(data, width * self.block_size, self._seed(namespace))

    def extend(self, parent: int, tokens: Sequence[int], namespace: Namespace) -> list[int] | None:
        return self.chain_tokens(tokens, parent)

    def chain_tokens(self, tokens: Sequence[int], seed: int) -> list[int]:
        """The keys of ``tokens``' full blocks chained from ``seed``: a chain's state *is* its
        last key (the next block's seed)."""
        data, width = _token_bytes(tokens)
        return self.chain(data, width * self.block_size, seed)

    def extend_tail(
        self, parent: int, prompt: Sequence[int], start: int, completion: Sequence[int]
    ) -> list[int]:
        """``extend(parent, prompt[start:] + completion)``: the chain continued past a prompt's
        last full block (Router.record_completion); in C when the prompt is packed
        (_native.c's ``extend_chain``), else, or where that declines, here."""
        extend_chain = self._extend_chain
        if extend_chain is not None and isinstance(prompt, array) and prompt.typecode == "I":
            keys = extend_chain(prompt, start, completion, self.block_size, parent)
            if keys is not None:
                return keys
        return self.chain_tokens(list(prompt[start:]) + list(completion), parent)

    def hash_text(self, text: bytes, namespace: Namespace) -> list[int]:
        # 4 bytes per pseudo-token: see proxy/core/extract.py for why.
        return self.chain(text, 4 * self.block_size, self._seed(namespace) ^ 0x7E57)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


# vLLM's block hash per --prefix-caching-hash-algo: an encoding, then a digest.
_VLLM_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: hashlib.sha256(_pickle(obj)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(_cbor(obj)).digest(),
    "xxhash": lambda obj: xxhash.xxh3_128_digest(_pickle(obj)),
    "xxhash_cbor": lambda obj: xxhash.xxh3_128_digest(_cbor(obj)),
}


def _encode_extra(algo: str, extra: tuple[Any, ...] | None, digest_len: int) -> bytes:
    """What ``algo``'s encoder writes for ``extra`` as the last item of vLLM's
    ``(parent, tuple(tokens), extra)``: cbor2's bytes for it (CBOR has no back-references), or
    pickle's between the token tuple and the closing TUPLE3 -- cut from the pickle of a
    template with the same parent length, one token and this very ``extra`` object, so its
    memo numbering (parent 0, tokens 1, then the extra's own objects) is the one a block's
    pickle gives it."""
    if algo.endswith("_cbor"):
        return _cbor(extra)
    whole = _pickle((bytes(digest_len), (0,), extra))
    # PROTO + FRAME (11 bytes), SHORT_BINBYTES + its length + parent + MEMOIZE, then
    # BININT1 0 + TUPLE1 + MEMOIZE; at the end TUPLE3 + MEMOIZE + STOP.
    head = 11 + 2 + digest_len + 1 + 4
    return whole[head:-3]


def event_hash(digest: bytes) -> int:
    """The int vLLM's KV-cache events report for a block: low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")


# Chain tails the exact hasher remembers for ``extend``: a completion is learned a few ms to
# minutes after its prompt was hashed, with up to TRL's max_inflight_tasks (a few hundred)
# rollouts in between; 4,096 covers that ten times over for ~0.7 MB (a 32-byte digest, its
# prefix-chain key and an int key each).
MAX_CHAIN_TAILS = 4096


class VllmHasher:
    """vLLM 0.33.0's prefix-cache block hashes, exactly.

    ``seed`` is the replicas' ``PYTHONHASHSEED`` (None: vLLM's documented default string).
    The chain input is ``(parent_digest, tuple(block_tokens), extra)`` where extra is
    ``(("lora", name, path),)`` on every block of an adapter request, ``("cache_salt", salt)``
    appended on block 0 only, and None when neither applies.

    Each block's digest is remembered by its prefix (proxy/core/exact_memo.py, at most
    ``memo_blocks``), so a prefix seen before -- a GRPO group's prompt, an agent's last turn --
    is not hashed again; ``digests`` is the reference computation and never reads the memo.
    """

    mode = "exact"

    def __init__(
        self,
        block_size: int,
        algo: str = "sha256",
        seed: str | None = None,
        memo_blocks: int = DEFAULT_MEMO_BLOCKS,
        use_native: bool | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if algo not in _VLLM_FUNCTIONS:
            raise ValueError(f"unknown vLLM hash algorithm {algo!r}; one of {VLLM_HASH_ALGOS}")
        self.block_size = block_size
        self.algo = algo
        self._fn = _VLLM_FUNCTIONS[algo]
        self._root = self._fn(seed if seed is not None else VLLM_DEFAULT_SEED)
        # Text prompts and the memo's prefix keys are XXH3 chains: FastHasher's, in C when
        # ``use_native`` allows (PROXY_NATIVE), so both implementations give the same keys.
        self._text = FastHasher(block_size, use_native)
        self.memo = ExactMemo(memo_blocks)
        # vLLM's digests of the blocks the memo lacks, in one C call per prompt (_native.c's
        # vllm_chain); None: in Python, as ``digests`` does.
        module = module_for(use_native)
        self._vllm_chain: Callable[..., list[tuple[int, bytes]] | None] | None = (
            module.vllm_chain if module is not None else None
        )
        self._algo_id = VLLM_HASH_ALGOS.index(algo)
        # Per (namespace, at the chain's root): the encoded extra keys vllm_chain appends, or
        # None where only the reference can encode them. Bounded like FastHasher's seeds.
        self._encoded: dict[tuple[str, str | None, str | None, bool], tuple[bytes, bytes] | None]
        self._encoded = {}
        # The full digest (and prefix-chain key) behind the last key of recently hashed
        # prompts, so that ``extend`` can continue a chain (an index key keeps only 64 of the
        # digest's bits). Insertion ordered, the oldest dropped first.
        self._tails: dict[int, tuple[bytes, int]] = {}

    def _extras(
        self, namespace: Namespace, at_root: bool
    ) -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
        """(extra keys of the first block hashed, of every later block)."""
        lora: tuple[Any, ...] | None = None
        if namespace.lora_path is not None:
            lora = (("lora", namespace.model, namespace.lora_path),)
        if namespace.cache_salt and at_root:
            return (*(lora or ()), ("cache_salt", namespace.cache_salt)), lora
        return lora, lora

    def digests(
        self, tokens: Sequence[int], namespace: Namespace, parent: bytes | None = None
    ) -> list[bytes]:
        """Full vLLM digests (what ``request.block_hashes`` holds inside vLLM); from
        ``parent``'s block on when given (then ``tokens`` start at a block boundary after it).
        Computed afresh: the reference the memoised path is tested against."""
        first_extra, lora = self._extras(namespace, parent is None)
        fn, bs = self._fn, self.block_size
        if parent is None:
            parent = self._root
        out: list[bytes] = []
        for i in range(len(tokens) // bs):
            extra = first_extra if i == 0 else lora
            parent = fn((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra))
            out.append(parent)
        return out

    def _memo_keys(
        self, tokens: Sequence[int], namespace: Namespace, parent: tuple[bytes, int] | None
    ) -> tuple[list[int], bytes, int]:
        """The blocks' event keys as ``digests`` would give them, each block looked up by its
        prefix first and hashed only when not remembered; with the last block's digest and
        prefix-chain key (for ``extend``). Empty keys when no block is full."""
        # The fast mode's chain (seeded 0: the namespace is told apart by the memo's id).
        chain = self._text.chain_tokens(tokens, parent[1] if parent else 0)
        if not chain:
            return [], b"", 0
        memo = self.memo
        # The epoch is not part of a digest: purged names keep their entries.
        base = memo.namespace_base((namespace.model, namespace.lora_path, namespace.cache_salt))
        remembered = memo.digests
        memo_keys = [base | link for link in chain]
        # Remembered blocks are looked up and refreshed (LRU) in C; only the blocks from the
        # first one not remembered on are hashed.
        entries: list[tuple[int, bytes] | None] = list(map(remembered.get, memo_keys))
        try:
            first_miss = entries.index(None)
        except ValueError:
            first_miss = len(entries)
        touch = remembered.move_to_end
        deque(map(touch, memo_keys[:first_miss]), maxlen=0)
        misses = 0
        bs = self.block_size
        if first_miss < len(entries):
            if first_miss:
                digest = entries[first_miss - 1][1]  # type: ignore[index]
            else:
                digest = parent[0] if parent else self._root
            computed = None
            if self._vllm_chain is not None:
                encoded = self._encoded_extras(namespace, parent is None)
                if encoded is not None:
                    computed = self._vllm_chain(
                        self._algo_id, digest, tokens, first_miss, len(entries), bs, *encoded
                    )
            if computed is None:
                at_root = parent is None and not first_miss
                rest = tokens[first_miss * bs :]
                computed = [
                    (event_hash(d), d)
                    for d in self.digests(rest, namespace, None if at_root else digest)
                ]
            # Every block from the first miss on: a remembered one among them keeps its entry
            # (the same digest: the memo holds what vLLM's function gave for that very prefix)
            # and is refreshed.
            for i, fresh in enumerate(computed, first_miss):
                if entries[i] is None:
                    entries[i] = remembered[memo_keys[i]] = fresh
                    misses += 1
                else:
                    touch(memo_keys[i])
        memo.hits += len(chain) - misses
        memo.misses += misses
        if misses:
            memo.trim()
        last = entries[-1]
        assert last is not None
        return [e[0] for e in entries], last[1], chain[-1]  # type: ignore[index]

    def _encoded_extras(self, namespace: Namespace, at_root: bool) -> tuple[bytes, bytes] | None:
        """The bytes vllm_chain writes for the first block's and every later block's extra
        keys, or None when the C encoding does not reproduce the reference for this namespace
        (then the blocks are hashed in Python)."""
        slot = (namespace.model, namespace.lora_path, namespace.cache_salt, at_root)
        try:
            return self._encoded[slot]
        except KeyError:
            pass
        if len(self._encoded) >= MAX_CACHED_SEEDS:
            self._encoded.clear()
        first_extra, lora = self._extras(namespace, at_root)
        encoded: tuple[bytes, bytes] | None = (
            _encode_extra(self.algo, first_extra, len(self._root)),
            _encode_extra(self.algo, lora, len(self._root)),
        )
        # Checked once per namespace against the reference on two blocks (the first with the
        # first block's extras, the second with the rest's), ids of every pickle / CBOR width:
        # an extra the template cannot place (a pickle frame split past 64 KiB, a memo
        # reference out of place) takes the reference path instead of giving wrong keys.
        assert self._vllm_chain is not None and encoded is not None
        probe = [0, 255, 256, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1]
        probe = (probe * (2 * self.block_size // len(probe) + 1))[: 2 * self.block_size]
        got = self._vllm_chain(self._algo_id, self._root, probe, 0, 2, self.block_size, *encoded)
        want = self.digests(probe, namespace, None if at_root else self._root)
        if got is None or [d for _, d in got] != want:
            encoded = None
        self._encoded[slot] = encoded
        return encoded

    def hash_tokens(self, tokens: Sequence[int], namespace: Namespace) -> list[int]:
        return self._keys(*self._memo_keys(tokens, namespace, None), namespace)

    def extend(self, parent: int, tokens: Sequence[int], namespace: Namespace) -> list[int] | None:
        """The chain after the prompt whose last key is ``parent``, when that prompt was hashed
        recently (learning a completion: re-hashing the prompt cost ~20x the completion's own
        blocks in exact mode, bench.run_kv_events_micro); else None, and the caller restarts."""
        tail = self._tails.get(parent)
        if tail is None:
            return None
        return self._keys(*self._memo_keys(tokens, namespace, tail), namespace)

    def _mix_epoch(self, keys: list[int], namespace: Namespace) -> list[int]:
        if namespace.epoch:
            # A purge must make old entries unreachable without changing what vLLM would
            # compute, so the epoch is mixed into the index key, not into the digest.
            mix = xxhash.xxh3_64_intdigest(namespace.epoch.to_bytes(8, "little"))
            keys = [k ^ mix for k in keys]
        return keys

    def _keys(self, keys: list[int], digest: bytes, link: int, namespace: Namespace) -> list[int]:
        keys = self._mix_epoch(keys, namespace)
        if keys:
            tails = self._tails
            tails[keys[-1]] = (digest, link)
            if len(tails) > MAX_CHAIN_TAILS:
                del tails[next(iter(tails))]
        return keys

    def hash_text(self, text: bytes, namespace: Namespace) -> list[int]:
        # vLLM hashes token ids; without a tokenizer no exact prediction exists, so text
        # requests route on the same approximation as the fast mode.
        return self._text.hash_text(text, namespace)


def make_hasher(
    mode: str,
    block_size: int,
    algo: str = "sha256",
    seed: str | None = None,
    use_native: bool | None = None,
) -> BlockHasher:
    """Hasher by name (settings say ``fast`` or ``exact``); ``use_native`` as FastHasher's
    (in exact mode: the XXH3 prefix chains and the vLLM digests the memo lacks)."""
    if mode == "fast":
        return FastHasher(block_size, use_native)
    if mode == "exact":
        return VllmHasher(block_size, algo, seed, use_native=use_native)
    raise ValueError(f"unknown hash mode {mode!r}; one of {HASH_MODES}")
