"""Request JSON -> routing key, and the 400s for everything malformed."""

from __future__ import annotations

import pytest

from proxy.core.extract import extract_chat, extract_completion
from proxy.errors import InvalidRequest


@pytest.mark.parametrize(
    ("body", "tokens", "text", "count"),
    [
        ({"model": "m", "prompt": [1, 2, 3]}, [1, 2, 3], None, 1),
        ({"model": "m", "prompt": "hi"}, None, b"hi", 1),
        ({"model": "m", "prompt": ["a", "b"]}, None, b"a", 2),
        ({"model": "m", "prompt": [[5, 6], [7]]}, [5, 6], None, 2),
        ({"prompt": [0]}, [0], None, 1),
    ],
)
def test_completion_keys(body, tokens, text, count) -> None:
    k = extract_completion(body)
    assert (list(k.tokens) if k.tokens else None, k.text, k.num_prompts) == (tokens, text, count)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "JSON object"),
        ({"model": "m"}, "'prompt' is required"),
        ({"model": 3, "prompt": "x"}, "'model' must be a string"),
        ({"model": "m", "prompt": []}, "must not be empty"),
        ({"model": "m", "prompt": [1, -2]}, "non-negative"),
        ({"model": "m", "prompt": [1, 2.5]}, "non-negative"),
        ({"model": "m", "prompt": [True, 1]}, "must be a string"),
        ({"model": "m", "prompt": [1, "a"]}, "non-negative"),
        ({"model": "m", "prompt": ["a", 1]}, "all be strings"),
        ({"model": "m", "prompt": [[1], []]}, "non-empty lists"),
        ({"model": "m", "prompt": [[1], [-1]]}, "non-negative"),
        ({"model": "m", "prompt": {"a": 1}}, "must be a string"),
        ({"model": "m", "prompt": 5}, "must be a string"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "'stream' must be a boolean"),
        ({"model": "m", "prompt": "x", "cache_salt": 5}, "cache_salt"),
    ],
)
def test_completion_errors(body, message) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        extract_completion(body)
    assert info.value.status_code == 400


def test_chat_rendering_is_stable_and_role_separated() -> None:
    a = extract_chat({"model": "m", "messages": [{"role": "user", "content": "ab"}]})
    b = extract_chat(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        }
    )
    c = extract_chat({"model": "m", "messages": [{"role": "system", "content": "ab"}]})
    assert a.text == b.text != c.text
    assert a.tokens is None


@pytest.mark.parametrize(
    "messages",
    [
        None,
        [],
        ["hi"],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": ["x"]}],
    ],
)
def test_chat_errors(messages) -> None:
    with pytest.raises(InvalidRequest):
        extract_chat({"model": "m", "messages": messages})


class FakeTokenizer:
    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages) -> list[int]:
        return [len(m["content"]) for m in messages]


def test_tokenizer_makes_text_exact() -> None:
    k = extract_completion({"model": "m", "prompt": "ab"}, FakeTokenizer())
    assert list(k.tokens or []) == [97, 98] and k.text is None
    c = extract_chat(
        {"model": "m", "messages": [{"role": "user", "content": "abc"}]}, FakeTokenizer()
    )
    assert list(c.tokens or []) == [3]
