"""CPU cost of precise routing (PROXY_KV_EVENTS), per event and per request, and its memory.

    python -m bench.runners.run_kv_events_micro            # prints a markdown table

Per event: decoding one scheduler step's batch (msgpack, and msgspec's typed decoder when
installed) and applying it to a replica's view, the work the subscriber does per message,
divided by the events in it. Per request: what routing
adds -- the exact vLLM block hashes the events require (vs the default fast hashes) and the
precise match over the views (vs the index's own match) -- plus the one regex over the answer
that checks the prediction. All timings are measured side by side in this one process; compare
the ratios, not the absolute figures with another run.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
import tracemalloc
from array import array
from collections.abc import Callable
from typing import Any

import msgpack

from proxy.core.extract import RoutingKey
from proxy.core.hashing import FastHasher, Namespace, VllmHasher
from proxy.core.kv_view import BlockEvent, PreciseMatcher, ReplicaView
from proxy.core.policy import PrefixAffinity
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router
from proxy.kv_events import decode, decode_typed

BLOCK = 16


def per_call_us(fn: Callable[[], object], min_s: float = 0.3) -> float:
    """Best of 9 rounds of the mean over enough calls to take ``min_s`` (the best round is the
    one least disturbed by other work on a shared machine)."""
    n, elapsed = 1, 0.0
    while elapsed < min_s / 9:
        n *= 2
        t0 = time.process_time()
        for _ in range(n):
            fn()
        elapsed = time.process_time() - t0
    best = float("inf")
    for _ in range(9):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t0) / n)
    return best * 1e6


def removed_event(rng: random.Random) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64)], "medium": "GPU"}


def stored_event(rng: random.Random, blocks: int) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
            "parent_block_hash": rng.getrandbits(64),
            "token_ids": [rng.randrange(151_000) for _ in range(blocks * BLOCK)],
            "block_size": BLOCK, "lora_id": 1, "medium": "GPU", "lora_name": "trl-policy-v7",
            "extra_keys": [["trl-policy-v7"]] * blocks}  # fmt: skip


def event_costs(rng: random.Random) -> list[tuple[str, float]]:
    """A decode step (one block for each of 64 running sequences, plus 8 evictions) and a
    prefill step (8 new 1,024-token prompts: 64 blocks each)."""
    rows = []
    cases: dict[str, list[dict[str, object]]] = {
        "decode step: 64 x BlockStored(1 block) + 8 x BlockRemoved": [
            *(stored_event(rng, 1) for _ in range(64)),
            *(removed_event(rng) for _ in range(8)),
        ],
        "prefill step: 8 x BlockStored(64 blocks)": [stored_event(rng, 64) for _ in range(8)],
        # What one request of the memory-tight benchmark causes: its new blocks stored, as many
        # evicted, one BlockRemoved each (bench/results/kv_events.md counts ~140 per request).
        "evicting prefill: BlockStored(140 blocks) + 140 x BlockRemoved": [
            stored_event(rng, 140),
            *(removed_event(rng) for _ in range(140)),
        ],
    }
    for name, events in cases.items():
        payload = msgpack.packb([time.time(), events, 0])
        view = ReplicaView(1 << 20)
        view.apply(0, [0.0, [], 0])
        seq = [1]

        def step(payload: bytes = payload, view: ReplicaView = view, seq: list[int] = seq) -> None:
            view.apply(seq[0], decode(payload))
            seq[0] += 1

        total = per_call_us(step)
        rows.append((f"{name}: per batch ({len(payload) / 1024:.0f} KiB)", total))
        rows.append((f"{name}: per event", total / len(events)))
        if decode_typed(payload) is None:
            continue  # msgspec is not installed: the subscriber decodes generically

        # What the subscriber does once the hashes are confirmed (proxy/kv_events.py): msgspec's
        # typed decoder, which skips the fields the view does not read (token ids above all).
        def typed_step(
            payload: bytes = payload, view: ReplicaView = view, seq: list[int] = seq
        ) -> None:
            typed = decode_typed(payload)
            assert typed is not None
            view.apply_events(seq[0], typed[1])
            seq[0] += 1

        typed = per_call_us(typed_step)
        rows.append((f"{name}: per batch, typed msgspec decoding", typed))
        rows.append((f"{name}: per event, typed msgspec decoding", typed / len(events)))
    return rows


def request_costs(rng: random.Random, prompt_tokens: int) -> list[tuple[str, float]]:
    tokens = [rng.randrange(151_000) for _ in range(prompt_tokens)]
    ns = Namespace("trl-policy-v7", "/adapters/trl-policy-v7")
    fast, exact = FastHasher(BLOCK), VllmHasher(BLOCK, "sha256")
    # The same hashes without the memo (proxy/core/exact_memo.py): every block sha256-hashed,
    # what a prompt nobody sent before costs.
    cold = VllmHasher(BLOCK, "sha256", memo_blocks=0)
    # An agent's next turn: this prompt + a 600-token completion + a 64-token tool answer, new
    # each call (2,048 of them, more blocks than the memo holds, so none is remembered when it
    # comes round again) while the prompt's own blocks stay remembered.
    prompt_ids = array("I", tokens)
    turns = [array("I", (rng.randrange(151_000) for _ in range(664))) for _ in range(2048)]
    turn_no = itertools.count()
    keys = exact.hash_tokens(tokens, ns)
    matchable = keys[: (prompt_tokens - 1) // BLOCK]
    index = PrefixIndex(1 << 19)
    router = Router(exact, index, PrefixAffinity(8))
    for r in range(4):
        index.record(keys[: len(keys) // (r + 1)], r)
    views = {r: ReplicaView() for r in range(4)}
    for r, view in views.items():
        view.apply(0, [0.0, [{"type": "BlockStored", "block_hashes": keys[: len(keys) >> r]}]])
        # A realistic view: ~100k other blocks cached on the replica.
        others = [rng.getrandbits(64) for _ in range(100_000)]
        view.apply(1, [0.0, [{"type": "BlockStored", "block_hashes": others}]])
    matcher = PreciseMatcher(views)
    replicas = list(range(4))
    body = (
        b'{"id":"cmpl-1","choices":[{"index":0,"text":"...","token_ids":['
        + b",".join(b"%d" % t for t in tokens[:600])
        + b']}],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":600,'
        b'"prompt_tokens_details":{"cached_tokens":%d}}}' % (prompt_tokens, prompt_tokens, 512)
    )
    from proxy.kv_events import _CACHED_TOKENS, first_match

    # The same answer carrying its prompt's ids too (return_token_ids: what the routing
    # benchmark's client asks for, to learn completions).
    with_prompt = body.replace(
        b'"token_ids":[', b'"prompt_token_ids":[' + b",".join(b"%d" % t for t in tokens) + b'],'
        b'"token_ids":['
    )  # fmt: skip

    key = RoutingKey("trl-policy-v7", tokens, None, None, False, 1)
    loads = [(r, 0.0) for r in replicas]
    plain = Router(exact, PrefixIndex(1 << 19), PrefixAffinity(8))
    precise = Router(exact, PrefixIndex(1 << 19), PrefixAffinity(8))
    precise.precise = PreciseMatcher(views)
    precise_cold = Router(cold, PrefixIndex(1 << 19), PrefixAffinity(8))
    precise_cold.precise = PreciseMatcher(views)
    # Remembering a 600-token completion (Router.record_completion): both modes extend the
    # prompt's chain (the exact hasher remembers recent prompts' last full digest; before it
    # did, the exact mode hashed prompt and completion again: 776 us vs 36 fast at 4,096).
    # A new completion each call (as turns above), so the exact mode hashes its blocks.
    completions = [[rng.randrange(151_000) for _ in range(600)] for _ in range(2048)]
    fast_router = Router(fast, PrefixIndex(1 << 19), PrefixAffinity(8))
    fast_decision, exact_decision = fast_router.route(key, loads), plain.route(key, loads)
    return [
        (f"{prompt_tokens}-token prompt: fast hashes (default mode)", per_call_us(
            lambda: fast.hash_tokens(tokens, ns))),
        (f"{prompt_tokens}-token prompt: exact vLLM hashes, prompt not seen before (sha256 "
         "every block)", per_call_us(lambda: cold.hash_tokens(tokens, ns))),
        (f"{prompt_tokens}-token prompt: exact vLLM hashes, prompt remembered (a group's other "
         "rollouts)", per_call_us(lambda: exact.hash_tokens(tokens, ns))),
        (f"{prompt_tokens}-token prompt: exact vLLM hashes, next turn (+664 new tokens)",
         per_call_us(lambda: exact.hash_tokens(prompt_ids + turns[next(turn_no) % 2048], ns))),
        (f"{prompt_tokens}-token prompt: fast hashes, next turn (+664 new tokens)",
         per_call_us(lambda: fast.hash_tokens(prompt_ids + turns[next(turn_no) % 2048], ns))),
        (f"{prompt_tokens}-token prompt: index match (Router.specific_matches)", per_call_us(
            lambda: router.specific_matches(matchable, replicas))),
        (f"{prompt_tokens}-token prompt: precise match over 4 live views", per_call_us(
            lambda: matcher.specific_matches(index, matchable, matchable, replicas))),
        (f"{prompt_tokens}-token prompt: whole route(), exact, index only", per_call_us(
            lambda: plain.route(key, loads))),
        (f"{prompt_tokens}-token prompt: whole route(), exact, 4 live views, prompt not seen "
         "before", per_call_us(lambda: precise_cold.route(key, loads))),
        (f"{prompt_tokens}-token prompt: whole route(), exact, 4 live views, prompt remembered",
         per_call_us(lambda: precise.route(key, loads))),
        (f"{prompt_tokens}-token prompt: record a 600-token completion, fast", per_call_us(
            lambda: fast_router.record_completion(
            key, fast_decision, completions[next(turn_no) % 2048]))),
        (f"{prompt_tokens}-token prompt: record a 600-token completion, exact", per_call_us(
            lambda: plain.record_completion(
            key, exact_decision, completions[next(turn_no) % 2048]))),
        ("answer check: cached_tokens regex over a 600-token answer", per_call_us(
            lambda: _CACHED_TOKENS.search(body))),
        ("answer check: cached_tokens, find + match (first_match), 600-token answer",
         per_call_us(lambda: first_match(_CACHED_TOKENS, b'"cached_tokens"', body))),
        (f"answer check: cached_tokens regex, answer with its {prompt_tokens} prompt ids "
         f"({len(with_prompt) // 1024} KiB)", per_call_us(
            lambda: _CACHED_TOKENS.search(with_prompt))),
        (f"answer check: cached_tokens, find + match, answer with its {prompt_tokens} prompt "
         "ids", per_call_us(lambda: first_match(_CACHED_TOKENS, b'"cached_tokens"', with_prompt))),
    ]  # fmt: skip


def exact_hash_costs(rng: random.Random, rounds: int = 3) -> list[tuple[str, float]]:
    """The exact vLLM hashes with the digests the memo lacks computed in C (PROXY_NATIVE,
    _native.c's vllm_chain) and in Python (the reference: pickle + hashlib per block; the
    memo's XXH3 prefix chains in C in both), on a
    4,096-token adapter prompt: not seen before (memo off: every block hashed), remembered
    (a group's other rollouts: no block hashed), an agent's next turn (+664 new tokens: 41
    blocks hashed) and a 600-token completion recorded after it was routed (37 blocks).
    Interleaved, C then Python, ``rounds`` times; the best of each."""
    tokens = array("I", (rng.randrange(151_000) for _ in range(4096)))
    ns = Namespace("trl-policy-v7", "/adapters/trl-policy-v7")
    turns = [array("I", (rng.randrange(151_000) for _ in range(664))) for _ in range(2048)]
    completions = [[rng.randrange(151_000) for _ in range(600)] for _ in range(2048)]
    key = RoutingKey("trl-policy-v7", tokens, None, None, False, 1)
    loads = [(r, 0.0) for r in range(4)]
    setups = {}
    for native in (True, False):
        warm = VllmHasher(BLOCK, "sha256")
        cold = VllmHasher(BLOCK, "sha256", memo_blocks=0)
        if not native:  # the memo's prefix chains in C, the digests in Python
            warm._vllm_chain = cold._vllm_chain = None
        router = Router(warm, PrefixIndex(1 << 19), PrefixAffinity(8))
        setups[native] = (warm, cold, router, router.route(key, loads))
    turn_no = itertools.count()
    best: dict[tuple[str, bool], float] = {}
    for _ in range(rounds):
        for native, (warm, cold, router, decision) in setups.items():
            cases = _exact_cases(warm, cold, router, decision, key, ns, turns, completions, turn_no)
            for name, fn in cases:
                us = per_call_us(fn)
                best[(name, native)] = min(best.get((name, native), us), us)
    order = sorted(best.items(), key=lambda x: (x[0][0], not x[0][1]))
    return [(f"exact hashes, digests in {'C' if native else 'Python'}: 4096-token "
             f"prompt, {name}", us) for (name, native), us in order]  # fmt: skip


def _exact_cases(
    warm: VllmHasher,
    cold: VllmHasher,
    router: Router,
    decision: Any,
    key: RoutingKey,
    ns: Namespace,
    turns: list[array[int]],
    completions: list[list[int]],
    turn_no: itertools.count[int],
) -> list[tuple[str, Callable[[], object]]]:
    tokens = key.tokens
    assert isinstance(tokens, array)

    def unseen() -> object:
        return cold.hash_tokens(tokens, ns)

    def remembered() -> object:
        return warm.hash_tokens(tokens, ns)

    def next_turn() -> object:
        return warm.hash_tokens(tokens + turns[next(turn_no) % 2048], ns)

    def completion() -> object:
        router.record_completion(key, decision, completions[next(turn_no) % 2048])
        return None

    return [("prompt not seen before (memo off)", unseen), ("prompt remembered", remembered),
            ("next turn (+664 new tokens)", next_turn),
            ("record a 600-token completion", completion)]  # fmt: skip


def view_loop_costs(rng: random.Random, rounds: int = 3) -> list[tuple[str, float]]:
    """The views' per-key loops on a tight-benchmark view (1,525 blocks cached, 8 requests in
    flight): a routed 250-block prompt's pin + free (``hold`` + ``release``) and ``expect``, one
    evicting batch (88 new blocks stored, 88 removed: a 1,400-token continuation's new blocks
    and its 600-token output) and the horizon's walk (``doomed`` + ``held_prefix``), ``rounds``
    times; the best of each."""
    setups = {}
    for native in ("Python",):
        view = ReplicaView()
        cached = [rng.getrandbits(63) for _ in range(1525)]
        view.apply(0, [0.0, [{"type": "BlockStored", "block_hashes": cached}]])
        for t in range(8):
            view.hold(t, cached[300 + t * 100 : 400 + t * 100])
        prompt = cached[:250]
        stored = [rng.getrandbits(63) for _ in range(88)]
        payload = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": stored}]
                                 + [{"type": "BlockRemoved", "block_hashes": [k]}
                                    for k in cached[1000:1088]], 0])  # fmt: skip
        back = msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": stored},
                                    {"type": "BlockStored", "block_hashes": cached[1000:1088]}],
                              0])  # fmt: skip
        # The typed decoding the subscriber uses (msgspec), so the batch times the loops.
        forth_events, back_events = decode_typed(payload), decode_typed(back)
        assert forth_events is not None and back_events is not None
        setups[native] = (view, prompt, forth_events[1], back_events[1])
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):
        for native, (view, prompt, forth, back) in setups.items():
            seq = itertools.count(1)

            def pin_free(view: ReplicaView = view, prompt: list[int] = prompt) -> None:
                view.expect(prompt, 0.0)
                view.hold(99, prompt)
                view.release(99)

            def batch(
                view: ReplicaView = view,
                forth: list[BlockEvent] = forth,
                back: list[BlockEvent] = back,
                seq: itertools.count[int] = seq,
            ) -> None:
                view.apply_events(next(seq), forth)
                view.apply_events(next(seq), back)

            def walk(view: ReplicaView = view, prompt: list[int] = prompt) -> None:
                view.held_prefix(prompt, 0.0, view.doomed(1525, 38, 0.0))

            for name, fn, per in (("250-block prompt: expect + hold + release", pin_free, 1),
                                  ("evicting batch, 88 stored + 88 removed (per batch)", batch, 2),
                                  ("doomed + held_prefix, 250-block prompt", walk, 1)):  # fmt: skip
                us = per_call_us(fn) / per
                best[(name, native)] = min(best.get((name, native), us), us)
    return [(f"view loops, {native}: {name}", us) for (name, native), us in best.items()]


def view_bytes_per_block(n: int = 200_000) -> float:
    """A view's memory per block: its dict slot plus the key's int object (each decoded key
    is a fresh int)."""
    rng = random.Random(3)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view = ReplicaView(n)
    keys = [rng.getrandbits(64) | 1 << 63 for _ in range(n)]
    view.apply(0, [0.0, [{"type": "BlockStored", "block_hashes": keys}]])
    del keys  # the view now holds the only references to the key objects
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(view)


def memo_bytes_per_block(n: int = 65_536) -> float:
    """The exact hasher's memo per remembered block: its OrderedDict slot, the int key (the
    namespace id above 64 bits) and the 32-byte digest."""
    rng = random.Random(4)
    tokens = array("I", (rng.randrange(151_000) for _ in range(n * BLOCK)))
    hasher = VllmHasher(BLOCK, "sha256", memo_blocks=n)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    hasher.hash_tokens(tokens, Namespace("trl-policy-v7", "/adapters/trl-policy-v7"))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(hasher.memo.digests)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m bench.runners.run_kv_events_micro", description=__doc__
    ).parse_args(argv)
    rng = random.Random(0)
    rows = view_loop_costs(rng)
    rows += exact_hash_costs(rng)
    rows += event_costs(rng)
    for n in (512, 4096):
        rows += request_costs(rng, n)
    print("| what | CPU us |")
    print("|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    print(f"\nview memory: {view_bytes_per_block():.0f} bytes per cached block (tracemalloc)")
    print(f"exact-hash memo: {memo_bytes_per_block():.0f} bytes per remembered block (tracemalloc)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
