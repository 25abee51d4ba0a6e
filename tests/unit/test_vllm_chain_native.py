"""vLLM's exact block digests in C (proxy/core/_native.c's vllm_chain) against the reference
(proxy/core/hashing.py's VllmHasher.digests: pickle / cbor2 and hashlib / xxhash per block).

Random token ids drawn around every width boundary of pickle's and CBOR's integer encodings,
every algorithm, block sizes around pickle's TUPLE1-3 / MARK..TUPLE switch, adapters, cache
salts and seeds; then the same through ``VllmHasher.hash_tokens`` (the memoised path the router
calls), which must also have taken the C path (no silent fallback), and vLLM's own vectors.
Skipped where the extension is not built."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.hashing import (
    VLLM_HASH_ALGOS,
    Namespace,
    VllmHasher,
    _cbor,
    _pickle,
    event_hash,
)
from tests.conftest import VLLM_VECTORS

native = pytest.importorskip("proxy.core._native", reason="the C extension is not built")

EDGES = [0, 1, 23, 24, 255, 256, 65_535, 65_536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63]
IDS = st.one_of(
    st.sampled_from(EDGES),
    st.integers(0, 151_935),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
)
NAMES = st.text(min_size=1, max_size=12)
NAMESPACES = st.builds(
    Namespace,
    NAMES,
    st.none() | st.sampled_from(["/adapters/v1", "a", "x" * 300]) | NAMES,
    st.none() | st.sampled_from(["", "salt", "s" * 300]) | NAMES,
    st.just(0),  # no purge epoch: vLLM's digests never carry one
)


def _reference_keys(hasher: VllmHasher, tokens: list[int], ns: Namespace) -> list[int]:
    return [event_hash(d) for d in hasher.digests(tokens, ns)]


@settings(max_examples=300, deadline=None)
@given(
    algo=st.sampled_from(VLLM_HASH_ALGOS),
    block_size=st.sampled_from([1, 2, 3, 4, 5, 16]),
    tokens=st.lists(IDS, max_size=70),
    ns=NAMESPACES,
    seed=st.none() | st.sampled_from(["0", "42"]),
)
def test_hash_tokens_in_c_equals_the_reference(
    algo: str, block_size: int, tokens: list[int], ns: Namespace, seed: str | None
) -> None:
    c = VllmHasher(block_size, algo, seed, use_native=True)
    reference = VllmHasher(block_size, algo, seed, use_native=False)
    want = _reference_keys(reference, tokens, ns)
    assert c.hash_tokens(tokens, ns) == want
    assert reference.hash_tokens(tokens, ns) == want
    if want:
        # The C path ran: the extras were encoded (not left to the reference) ...
        assert c._encoded[(ns.model, ns.lora_path, ns.cache_salt, True)] is not None
    # ... and again from the memo, and past a remembered prefix (the chain resumed in C).
    assert c.hash_tokens(tokens, ns) == want
    longer = tokens + [7] * block_size
    assert c.hash_tokens(longer, ns) == _reference_keys(reference, longer, ns)


@settings(max_examples=300, deadline=None)
@given(
    algo=st.sampled_from(VLLM_HASH_ALGOS),
    block_size=st.sampled_from([1, 3, 4, 16]),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    start=st.integers(0, 5),
    ns=NAMESPACES,
)
def test_vllm_chain_from_any_block_and_any_parent(
    algo: str, block_size: int, tokens: list[int], start: int, ns: Namespace
) -> None:
    hasher = VllmHasher(block_size, algo, use_native=True)
    full = len(tokens) // block_size
    start = min(start, full)
    encoded = hasher._encoded_extras(ns, True)
    assert encoded is not None
    digests = hasher.digests(tokens, ns)
    parent = digests[start - 1] if start else hasher._root
    want = [(event_hash(d), d) for d in digests[start:]]
    algo_id = VLLM_HASH_ALGOS.index(algo)
    for form in (tokens, tuple(tokens), array("I", tokens)):
        got = native.vllm_chain(algo_id, parent, form, start, full, block_size, *encoded)
        assert got == want


def test_inputs_only_the_reference_encodes_are_declined() -> None:
    hasher = VllmHasher(4, use_native=True)
    encoded = hasher._encoded_extras(Namespace("m"), True)
    assert encoded is not None
    root = hasher._root
    # bools and int subclasses pickle differently; negatives and ids past 64 bits do not fit
    for tokens in ([1, 2, True, 4], [1, 2, -3, 4], [1, 2, 2**64, 4], [1.0, 2, 3, 4]):
        assert native.vllm_chain(0, root, tokens, 0, 1, 4, *encoded) is None
    for typecode in "iQ":  # only uint32 arrays (what extract.py packs) are read in C
        assert native.vllm_chain(0, root, array(typecode, [1, 2, 3, 4]), 0, 1, 4, *encoded) is None
    assert native.vllm_chain(0, root, iter([1, 2, 3, 4]), 0, 1, 4, *encoded) is None
    with pytest.raises(ValueError):
        native.vllm_chain(0, root, [1, 2, 3, 4], 0, 2, 4, *encoded)  # past the last full block
    with pytest.raises(ValueError):
        native.vllm_chain(9, root, [1, 2, 3, 4], 0, 1, 4, *encoded)
    with pytest.raises(TypeError):
        native.vllm_chain(0, "root", [1, 2, 3, 4], 0, 1, 4, *encoded)
    # ... and hash_tokens still answers them, through the reference
    ref = VllmHasher(4, use_native=False)
    for tokens in ([1, 2, True, 4, 5, 6, 7, 8], [1, 2, 3, 4, False, 6, 7, 8]):
        assert hasher.hash_tokens(tokens, Namespace("m")) == ref.hash_tokens(tokens, Namespace("m"))


@pytest.mark.parametrize("algo", VLLM_HASH_ALGOS)
def test_an_extra_the_template_cannot_place_takes_the_reference(algo: str) -> None:
    # A cache salt past pickle's 64 KiB frame target splits the frame: the per-namespace check
    # refuses the encoding and the reference hashes the blocks (CBOR has no frames: accepted).
    ns = Namespace("m", None, "s" * 70_000)
    c, ref = VllmHasher(2, algo, use_native=True), VllmHasher(2, algo, use_native=False)
    tokens = list(range(9))
    assert c.hash_tokens(tokens, ns) == ref.hash_tokens(tokens, ns)
    placed = c._encoded[("m", None, ns.cache_salt, True)]
    assert (placed is None) == (not algo.endswith("_cbor"))


@pytest.mark.parametrize("case", json.loads(VLLM_VECTORS.read_text())["cases"])
def test_vllm_vectors_through_c(case: dict[str, Any]) -> None:
    hasher = VllmHasher(case["block_size"], case["algo"], case["pythonhashseed"], use_native=True)
    ns = Namespace(case["lora_name"] or "base", case["lora_path"], case["cache_salt"])
    assert hasher.hash_tokens(case["token_ids"], ns) == case["event_block_hashes"]
    if case["event_block_hashes"]:  # a prompt shorter than a block hashes nothing
        assert hasher._encoded[(ns.model, ns.lora_path, ns.cache_salt, True)] is not None


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_in_c_is_hashlibs(algo: str) -> None:
    """vllm_chain's SHA-256 (libcrypto's, linked where setup.py finds it) against hashlib's, on
    encoded blocks of every length modulo SHA-256's 64-byte block: every padding case."""
    if not native.SHA256_IN_C:
        pytest.skip("built without libcrypto: the sha256 algorithms are hashed in Python")
    encode = _cbor if algo.endswith("_cbor") else _pickle
    residues = set()
    for size in range(1, 70):
        hasher = VllmHasher(size, algo, use_native=True)
        encoded = hasher._encoded_extras(Namespace("m"), True)
        assert encoded is not None
        for token in (0, 256, 65_536, 2**31):  # each encoded in a different width
            tokens = [token] * size
            got = native.vllm_chain(
                VLLM_HASH_ALGOS.index(algo), hasher._root, tokens, 0, 1, size, *encoded
            )
            assert got is not None
            assert [d for _, d in got] == hasher.digests(tokens, Namespace("m"))
            residues.add(len(encode((hasher._root, tuple(tokens), None))) % 64)
    assert residues == set(range(64))


def test_sha256_runs_in_c_where_libcrypto_is_installed() -> None:
    """This project's machines and the image have OpenSSL 3's headers (libssl-dev): a build
    that silently lost libcrypto would hash every sha256 block in Python again."""
    if Path("/usr/include/openssl/evp.h").exists():
        assert native.SHA256_IN_C == 1


@pytest.mark.parametrize("algo", VLLM_HASH_ALGOS)
def test_a_chain_the_extension_declines_is_hashed_by_the_reference(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a build without libcrypto does for sha256 (vllm_chain returns None): the namespace's
    probe refuses the encoding and every block is hashed in Python, the keys unchanged."""
    c, ref = VllmHasher(4, algo, use_native=True), VllmHasher(4, algo, use_native=False)
    monkeypatch.setattr(c, "_vllm_chain", lambda *args: None)
    tokens = list(range(4 * 5 + 3))
    assert c.hash_tokens(tokens, Namespace("m")) == ref.hash_tokens(tokens, Namespace("m"))
    assert c._encoded[("m", None, None, True)] is None
