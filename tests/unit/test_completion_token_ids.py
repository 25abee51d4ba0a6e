"""Reading a completion's generated ids without parsing the whole answer (dataplane.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.dataplane import completion_token_ids


def answer(*choices: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps({"id": "c", "choices": list(choices), **extra}).encode()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (answer({"index": 0, "text": "a b", "token_ids": [5, 6, 7]}), [5, 6, 7]),
        (answer({"token_ids": [5, 6]}, prompt_token_ids=[1, 2, 3]), [5, 6]),
        (b'{"choices":[{"token_ids" :  [9 , 8]}]}', [9, 8]),
        (answer({"index": 0, "token_ids": None}), None),
        (answer({"index": 0, "token_ids": []}), None),
        (answer({"index": 0, "text": "no ids"}), None),
        # A string that quotes the key is not the key (its quotes are escaped in JSON).
        (answer({"text": '"token_ids": [1]', "token_ids": [4]}), [4]),
        (answer({"text": '"token_ids": [1]'}), None),
        # Two choices: the full parse decides, and it needs exactly one.
        (answer({"token_ids": [1]}, {"token_ids": [2]}), None),
        (answer({"token_ids": [1], "logprobs": {"token_ids": [3]}}), [1]),
    ],
)
def test_completion_token_ids(content: bytes, expected: list[int] | None) -> None:
    assert completion_token_ids(content) == expected


def test_a_truncated_or_malformed_answer_learns_nothing() -> None:
    assert completion_token_ids(b'{"choices": [{"token_ids": [1, 2') is None
    with pytest.raises(json.JSONDecodeError):  # dataplane.py catches it and logs at debug
        completion_token_ids(b'{"choices": [{"token_ids": [1, 2,]}]}')
