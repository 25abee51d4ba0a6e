"""Block hashing: exact mode against vLLM's own vectors, fast mode's invariants."""

from __future__ import annotations

import json

import pytest

from proxy.core.hashing import FastHasher, Namespace, VllmHasher, event_hash, make_hasher
from tests.conftest import VLLM_VECTORS

VECTORS = json.loads(VLLM_VECTORS.read_text())["cases"]


def _namespace(case: dict) -> Namespace:
    return Namespace(case["lora_name"] or "base", case["lora_path"], case["cache_salt"])


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: f"{c['algo']}-{len(c['token_ids'])}")
def test_exact_mode_reproduces_vllm(case: dict) -> None:
    hasher = VllmHasher(case["block_size"], case["algo"], case["pythonhashseed"])
    ns = _namespace(case)
    digests = hasher.digests(case["token_ids"], ns)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    # the index keys are what vLLM's KV-cache events report
    assert hasher.hash_tokens(case["token_ids"], ns) == case["event_block_hashes"]
    assert [event_hash(d) for d in digests] == case["event_block_hashes"]


def test_vectors_cover_every_algorithm_and_extra_key() -> None:
    assert {c["algo"] for c in VECTORS} == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
    assert any(c["lora_name"] and c["cache_salt"] for c in VECTORS)
    assert any(c["pythonhashseed"] is None for c in VECTORS)
    assert len(VECTORS) == 60


def test_exact_epoch_changes_keys_not_digests() -> None:
    hasher = VllmHasher(16)
    tokens = list(range(64))
    plain = hasher.hash_tokens(tokens, Namespace("m"))
    purged = hasher.hash_tokens(tokens, Namespace("m", epoch=3))
    assert plain != purged and len(plain) == len(purged) == 4
    assert hasher.digests(tokens, Namespace("m")) == hasher.digests(tokens, Namespace("m", epoch=3))


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_chain_property_and_full_blocks_only(mode: str) -> None:
    hasher = make_hasher(mode, 16)
    ns = Namespace("trl-policy-v1", "/p" if mode == "exact" else None)
    a = list(range(100))
    b = a[:48] + [9999] + a[49:]
    ha, hb = hasher.hash_tokens(a, ns), hasher.hash_tokens(b, ns)
    assert len(ha) == 100 // 16
    assert ha[:3] == hb[:3]  # blocks 0..2 cover tokens 0..47: identical
    assert all(x != y for x, y in zip(ha[3:], hb[3:], strict=True))  # chained: all later differ
    assert hasher.hash_tokens(a[:15], ns) == []
    assert hasher.hash_tokens(a[:32], ns) == ha[:2]


def test_fast_namespaces_never_share_blocks() -> None:
    hasher = FastHasher(16)
    tokens = list(range(64))
    keys = {
        tuple(hasher.hash_tokens(tokens, ns))
        for ns in (
            Namespace("trl-policy-v1"),
            Namespace("trl-policy-v2"),
            Namespace("trl-policy-v1", cache_salt="s"),
            Namespace("trl-policy-v1", epoch=1),
        )
    }
    assert len(keys) == 4


def test_fast_is_deterministic_across_instances_and_handles_huge_ids() -> None:
    tokens = [0, 2**32 - 1] * 16
    assert FastHasher(16).hash_tokens(tokens, Namespace("m")) == FastHasher(16).hash_tokens(
        tokens, Namespace("m")
    )
    big = [2**40] * 32
    assert len(FastHasher(16).hash_tokens(big, Namespace("m"))) == 2


def test_text_blocks_are_prefix_preserving() -> None:
    hasher = FastHasher(16)
    shared = b"x" * 200
    h1 = hasher.hash_text(shared + b"first question " * 8, Namespace("m"))
    h2 = hasher.hash_text(shared + b"another question entirely" * 8, Namespace("m"))
    assert h1[:3] == h2[:3]  # 3 blocks of 64 bytes inside the shared 200
    assert h1[3] != h2[3]


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        FastHasher(0)
    with pytest.raises(ValueError):
        VllmHasher(16, "md5")
    with pytest.raises(ValueError):
        make_hasher("slow", 16)
