"""Property-based tests (hypothesis) of everything that reads untrusted input before a replica
does: request parsing (proxy.core.extract), block hashing and routing on whatever parsing lets
through, the path/credential/adapter checks of proxy.security, and secret redaction.

Bounded to stay fast: max_examples per test below, no deadline (the shared CI machine's timing
is noisy; correctness is what is checked here, speed is measured in bench/).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import random
from typing import Any

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.core.extract import MAX_TOKEN_ID, RoutingKey, extract_chat, extract_completion
from proxy.core.hashing import FastHasher, Namespace, VllmHasher
from proxy.core.policy import make_policy
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router
from proxy.errors import InvalidRequest
from proxy.security.adapter_roots import AdapterRoots
from proxy.security.keys import credential_from
from proxy.security.planes import path_problem
from proxy.security.redaction import redact

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON as json.loads can produce it, including lone surrogates ("\ud800" is valid JSON text)
# and integers of any size.
strings = st.text(max_size=40) | st.sampled_from(["\ud800", "a\udfffb", "", "\x00", "é" * 9])
ints = st.integers(min_value=-(2**70), max_value=2**70) | st.integers(-3, 200_000)
scalars = st.none() | st.booleans() | ints | st.floats(allow_nan=False) | strings
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(strings, children, max_size=6)
    ),
    max_leaves=40,
)
token_ids = st.integers(min_value=0, max_value=MAX_TOKEN_ID)
token_lists = st.lists(st.integers(0, 300_000) | token_ids, min_size=1, max_size=200)
prompts = (
    json_values
    | strings
    | st.lists(strings, max_size=5)
    | token_lists
    | st.lists(token_lists, max_size=4)
    | st.lists(st.integers(-5, 2**65), max_size=30)
    | st.lists(st.lists(json_values, max_size=4), max_size=4)
)
completion_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": strings | json_values,
        "prompt": prompts,
        "stream": st.booleans() | json_values,
        "cache_salt": strings | json_values,
        "n": json_values,
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": strings | json_values},
        optional={
            "content": strings
            | st.none()
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]) | strings},
                    optional={"text": json_values, "image_url": json_values},
                )
                | json_values,
                max_size=3,
            )
            | json_values
        },
    )
    | json_values,
    max_size=4,
)
chat_bodies = st.fixed_dictionaries(
    {}, optional={"model": strings, "messages": messages | json_values, "stream": json_values}
)


class CountingTokenizer:
    """Deterministic stand-in for a Hugging Face tokenizer (one id per code point)."""

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [ord(c) for m in messages for c in str(m.get("content"))]


def _router(mode: str) -> Router:
    hasher = FastHasher(4) if mode == "fast" else VllmHasher(4, mode)
    return Router(hasher, PrefixIndex(4096, 32), make_policy("prefix", 8))


def _check_key(key: RoutingKey) -> None:
    assert isinstance(key.model, str)
    assert (key.tokens is None) != (key.text is None)
    assert key.num_prompts >= 1 and key.length >= 0
    if key.tokens is not None:
        assert all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in key.tokens)
    # Whatever parsing accepts, routing must handle: hash it and route it, in both modes.
    for mode in ("fast", "sha256", "sha256_cbor"):
        decision = _router(mode).route(key, [(0, 0.0), (1, 2.0)], lora_path="/bucket/a")
        assert decision.replica in (0, 1)


@FAST
@given(body=completion_bodies | json_values)
@example(body={"prompt": [2**64]})
@example(body={"prompt": [[1], [2**63]]})
@example(body={"prompt": [True, 1]})
@example(body={"prompt": "\ud800"})
@example(body={"model": "m\ud800", "prompt": [1] * 8})  # found by this test: a 500 in CBOR mode
@example(body={"cache_salt": "\udfff", "prompt": [1] * 8})
@example(body={"model": "a\x00", "prompt": [1] * 8})  # NUL joins namespace parts
@example(body={"prompt": [1] * 8 + [2**32]})  # found by this test: breaks the chain property
def test_completion_parsing_raises_only_invalid_request(body: Any) -> None:
    for tokenizer in (None, CountingTokenizer()):
        try:
            key = extract_completion(body, tokenizer)
        except InvalidRequest as exc:
            assert exc.status_code == 400 and exc.message
            continue
        _check_key(key)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
            assert list(key.tokens or []) == prompt  # token prompts are taken exactly


@FAST
@given(body=chat_bodies | json_values)
def test_chat_parsing_raises_only_invalid_request(body: Any) -> None:
    for tokenizer in (None, CountingTokenizer()):
        try:
            key = extract_chat(body, tokenizer)
        except InvalidRequest as exc:
            assert exc.status_code == 400 and exc.message
            continue
        _check_key(key)


@FAST
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_raw_bytes_through_json_and_parsing(raw: bytes) -> None:
    """What the proxy does with a body: json.loads, then parse. Only ValueError (-> 400 in
    app.py) or InvalidRequest may come out."""
    try:
        body = json.loads(raw)
    except ValueError:
        return
    with contextlib.suppress(InvalidRequest):
        _check_key(extract_completion(body))


# -- hashing --------------------------------------------------------------------------------

# What parsing lets into a namespace: no NUL, no lone surrogate, no empty salt.
clean = st.text(
    alphabet=st.characters(exclude_characters="\0", exclude_categories=("Cs",)), max_size=20
)
namespaces = st.builds(
    Namespace,
    model=clean,
    lora_path=st.none() | clean,
    cache_salt=st.none() | clean.filter(bool),
    epoch=st.integers(0, 10),
)


@FAST
@given(
    tokens=st.lists(token_ids | st.integers(0, 200_000), max_size=120),
    ns=namespaces,
    block_size=st.integers(1, 17),
)
def test_fast_hashes_are_deterministic_and_chain_prefixes(
    tokens: list[int], ns: Namespace, block_size: int
) -> None:
    hasher = FastHasher(block_size)
    blocks = hasher.hash_tokens(tokens, ns)
    assert blocks == FastHasher(block_size).hash_tokens(list(tokens), ns)
    assert len(blocks) == len(tokens) // block_size
    assert all(0 <= b < 2**64 for b in blocks)
    # Chain-prefix: the hashes of any block-aligned prefix are a prefix of the hashes.
    for k in range(len(blocks) + 1):
        assert hasher.hash_tokens(tokens[: k * block_size], ns) == blocks[:k]
    # Appending tokens never changes the hashes of existing full blocks.
    assert hasher.hash_tokens(tokens + [1] * block_size, ns)[: len(blocks)] == blocks


@SLOW
@given(
    tokens=st.lists(token_ids | st.integers(0, 200_000), max_size=40),
    ns=namespaces,
    block_size=st.integers(1, 9),
    algo=st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
)
def test_exact_hashes_are_deterministic_and_chain_prefixes(
    tokens: list[int], ns: Namespace, block_size: int, algo: str
) -> None:
    hasher = VllmHasher(block_size, algo)
    blocks = hasher.hash_tokens(tokens, ns)
    assert blocks == VllmHasher(block_size, algo).hash_tokens(list(tokens), ns)
    for k in range(len(blocks) + 1):
        assert hasher.hash_tokens(tokens[: k * block_size], ns) == blocks[:k]


@FAST
@given(
    text=st.binary(max_size=300),
    ns=namespaces,
    block_size=st.integers(1, 9),
)
def test_text_hashes_chain_prefixes(text: bytes, ns: Namespace, block_size: int) -> None:
    hasher = FastHasher(block_size)
    blocks = hasher.hash_text(text, ns)
    assert blocks == hasher.hash_text(bytes(text), ns)
    step = 4 * block_size
    for k in range(len(blocks) + 1):
        assert hasher.hash_text(text[: k * step], ns) == blocks[:k]


@FAST
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=8, max_size=64),
    a=namespaces,
    b=namespaces,
)
def test_namespaces_separate_caches(tokens: list[int], a: Namespace, b: Namespace) -> None:
    hasher = FastHasher(4)
    same = (a.model, a.cache_salt, a.epoch) == (b.model, b.cache_salt, b.epoch)
    # 64-bit hashes: a collision between distinct namespaces would be a bug, not bad luck.
    assert (hasher.hash_tokens(tokens, a)[0] == hasher.hash_tokens(tokens, b)[0]) == same


# -- security checks ------------------------------------------------------------------------


@FAST
@given(path=st.text(max_size=60), raw=st.none() | st.binary(max_size=60))
@example(path="/v1/../pause", raw=None)
@example(path="/v1/a b/é", raw=None)
def test_a_canonical_path_reaches_the_replica_unchanged(path: str, raw: bytes | None) -> None:
    """The point of the path check: a path it accepts is exactly the path httpx sends
    upstream (no '..' resolution, no query or fragment split, no re-escaping)."""
    if path_problem(path, raw) is not None:
        return
    url = httpx.URL("http://replica:8000" + path)
    assert url.path == path
    assert not url.query and not url.fragment


@FAST
@given(
    header=st.none()
    | st.text(max_size=80)
    | st.binary(max_size=60).map(lambda b: b.decode("latin-1"))
)
def test_credentials_never_raise(header: str | None) -> None:
    value = credential_from(header)
    assert value is None or (isinstance(value, str) and value)


segments = st.sampled_from(["a", "b", ".", "..", "", "x y", "é", "..a", "a..", "~"])


@FAST
@given(
    parts=st.lists(segments | st.text(max_size=6), max_size=8),
    prefix=st.sampled_from(["/bucket/", "/bucket", "//bucket/", "/", "", "bucket/", "/bucketX/"]),
    trailing=st.booleans(),
)
def test_an_accepted_adapter_path_never_escapes_its_root(
    parts: list[str], prefix: str, trailing: bool
) -> None:
    path = prefix + "/".join(parts) + ("/" if trailing else "")
    roots = AdapterRoots(["/bucket"])
    try:
        roots.check(path)
    except InvalidRequest as exc:
        assert exc.param == "lora_path"
        return
    assert path.startswith("/") and ".." not in path.split("/")
    resolved = "/" + posixpath.normpath(path).lstrip("/")
    assert resolved == "/bucket" or resolved.startswith("/bucket/")


@SLOW
@given(value=json_values, where=st.randoms(use_true_random=False))
def test_redaction_removes_the_token_wherever_it_is(value: Any, where: random.Random) -> None:
    token = "hf_" + "Z9" * 17
    planted = _plant(value, token, where)
    out = redact(planted, (token,))
    assert token not in json.dumps(out)
    assert json.dumps(redact(out, (token,))) == json.dumps(out)  # idempotent


def _plant(value: Any, token: str, rng: random.Random) -> Any:
    if isinstance(value, dict):
        return {k: _plant(v, token, rng) for k, v in value.items()} | (
            {"HF_TOKEN": token} if rng.random() < 0.3 else {}
        )
    if isinstance(value, list):
        return [_plant(v, token, rng) for v in value] + ([token] if rng.random() < 0.3 else [])
    if isinstance(value, str) and rng.random() < 0.5:
        return value + f" Bearer {token} " + value
    return value
