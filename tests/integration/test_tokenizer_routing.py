"""PROXY_TOKENIZER: chat and text prompts are tokenized (chat through the model's template), so
they share blocks with the token-id prompts TRL sends for the same conversation."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from trainer.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny")
    build_tiny_model(out)
    return out


def test_chat_routes_like_its_token_prompt(make_fleet, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    h = make_fleet(2, tokenizer=str(tokenizer_dir))
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    messages = [{"role": "user", "content": "What is 12 times 13? " * 12}]
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert len(ids) >= 48

    first = h.client.post("/v1/completions", json={"model": "tiny/base", "prompt": list(ids)})
    chat = h.client.post("/v1/chat/completions", json={"model": "tiny/base", "messages": messages})
    assert chat.status_code == first.status_code == 200
    assert chat.headers["x-proxy-replica"] == first.headers["x-proxy-replica"]
    # The chat request matched the token prompt's blocks: no new blocks were indexed.
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == len(ids) // 16


def test_text_prompt_is_tokenized(make_fleet, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    h = make_fleet(1, tokenizer=str(tokenizer_dir))
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    text = "the quick brown fox jumps over the lazy dog " * 10
    r = h.client.post("/v1/completions", json={"model": "tiny/base", "prompt": text})
    assert r.status_code == 200
    expected = len(tok.encode(text, add_special_tokens=True)) // 16
    assert h.client.get("/admin/fleet").json()["routing"]["index_blocks"] == expected
