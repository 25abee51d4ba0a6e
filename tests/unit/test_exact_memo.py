"""The exact hasher's memo (proxy/core/exact_memo.py): memoised vLLM keys equal fresh ones.

Every property compares a long-lived, memoising ``VllmHasher`` with the reference computation
(``VllmHasher.digests``, which never reads the memo, checked against vLLM's own vectors in
test_hashing.py) across namespaces, adapters, cache salts and purge epochs, with memos small
enough that eviction happens all the time.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.exact_memo import ExactMemo
from proxy.core.hashing import Namespace, VllmHasher, event_hash
from proxy.core.native import MODULE

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

namespaces = st.builds(
    Namespace,
    model=st.sampled_from(["base", "trl-policy-v1", "trl-policy-v2"]),
    lora_path=st.none() | st.sampled_from(["/a/v1", "/a/v2"]),
    cache_salt=st.none() | st.sampled_from(["", "s1", "s2"]),
    epoch=st.integers(0, 3),
)
# The reference hashes the blocks the memo lacks in Python, the extension in C (when built).
implementations = st.sampled_from([False] if MODULE is None else [False, True])
# Few distinct token values, so prompts share prefixes (what the memo exists for) and differ.
token_lists = st.lists(st.integers(0, 3), max_size=40)


def fresh_keys(hasher: VllmHasher, tokens: list[int], ns: Namespace) -> list[int]:
    """What vLLM's events would report, epoch mixed in as the index does: no memo involved."""
    reference = VllmHasher(hasher.block_size, hasher.algo, memo_blocks=0)
    keys = [event_hash(d) for d in reference.digests(tokens, ns)]
    return reference._mix_epoch(keys, ns)


@PROPS
@given(
    requests=st.lists(st.tuples(token_lists, namespaces), min_size=1, max_size=12),
    block_size=st.integers(1, 5),
    capacity=st.integers(0, 12),
    algo=st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    use_native=implementations,
)
def test_memoised_keys_equal_fresh_ones_whatever_was_evicted(
    requests: list[tuple[list[int], Namespace]],
    block_size: int,
    capacity: int,
    algo: str,
    use_native: bool,
) -> None:
    hasher = VllmHasher(block_size, algo, memo_blocks=capacity, use_native=use_native)
    for tokens, ns in requests * 2:  # the second pass reads what the first remembered
        assert hasher.hash_tokens(tokens, ns) == fresh_keys(hasher, tokens, ns)
        assert len(hasher.memo.digests) <= capacity


@PROPS
@given(
    head=token_lists,
    tail=token_lists,
    noise=st.lists(st.tuples(token_lists, namespaces), max_size=6),
    ns=namespaces,
    capacity=st.integers(0, 8),
    use_native=implementations,
)
def test_extending_a_remembered_chain_equals_hashing_the_whole(
    head: list[int],
    tail: list[int],
    noise: list[tuple[list[int], Namespace]],
    ns: Namespace,
    capacity: int,
    use_native: bool,
) -> None:
    hasher = VllmHasher(4, memo_blocks=capacity, use_native=use_native)
    head = head[: len(head) // 4 * 4]
    first = hasher.hash_tokens(head, ns)
    for tokens, other in noise:  # other requests in between evict the memo's entries
        hasher.hash_tokens(tokens, other)
    more = hasher.extend(first[-1], tail, ns) if first else None
    whole = fresh_keys(hasher, head + tail, ns)
    if more is not None:
        assert first + more == whole
    assert hasher.hash_tokens(head + tail, ns) == whole


def test_namespaces_sharing_tokens_never_share_digests() -> None:
    # Same tokens, same fast chain: only the namespace id tells these apart in the memo.
    hasher = VllmHasher(4)
    tokens = list(range(16))
    spaces = [
        Namespace("base"),
        Namespace("a", "/p1"),
        Namespace("a", "/p2"),  # same adapter name, new path: vLLM keys differ
        Namespace("base", cache_salt="s"),
        Namespace("a", "/p1", "s"),
    ]
    keys = [tuple(hasher.hash_tokens(tokens, ns)) for ns in spaces]
    assert len(set(keys)) == len(spaces)
    assert [list(k) for k in keys] == [fresh_keys(hasher, tokens, ns) for ns in spaces]


def test_a_group_prompt_and_a_next_turn_hash_only_their_new_blocks() -> None:
    hasher = VllmHasher(16)
    ns = Namespace("trl-policy-v3", "/adapters/v3")
    prompt = list(range(1000, 1000 + 256))  # 16 blocks
    hasher.hash_tokens(prompt, ns)
    assert (hasher.memo.hits, hasher.memo.misses) == (0, 16)
    for _ in range(7):  # the group's other rollouts
        hasher.hash_tokens(prompt, ns)
    assert (hasher.memo.hits, hasher.memo.misses) == (7 * 16, 16)
    turn2 = prompt + list(range(64))  # prompt + completion + tool output: 4 new blocks
    assert hasher.hash_tokens(turn2, ns) == fresh_keys(hasher, turn2, ns)
    assert (hasher.memo.hits, hasher.memo.misses) == (8 * 16, 20)
    # A purge epoch changes index keys, not digests: the purged name reuses the memo.
    assert hasher.hash_tokens(prompt, Namespace(ns.model, ns.lora_path, epoch=2)) == fresh_keys(
        hasher, prompt, Namespace(ns.model, ns.lora_path, epoch=2)
    )
    assert hasher.memo.misses == 20


def test_namespace_ids_are_never_reused_after_the_table_is_emptied() -> None:
    memo = ExactMemo(8)
    bases = {memo.namespace_base(("m", None, f"salt-{i}")) for i in range(5000)}
    assert len(bases) == 5000
