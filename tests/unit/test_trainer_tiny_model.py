"""The tiny Qwen2 model + local tokenizer other tests and the real-vLLM demo build on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.tiny_model import (
    DEFAULT_SYSTEM_PROMPT,
    TinyModelInfo,
    _train_tokenizer,
    build_tiny_model,
    main,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> TinyModelInfo:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", pretrain_steps=2)


def test_loads_with_transformers_and_has_vllm_friendly_shapes(built: TinyModelInfo) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(built.path)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert config.hidden_size // config.num_attention_heads == built.head_dim == 64
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.max_position_embeddings == 4096
    assert len(tokenizer) == config.vocab_size == built.vocab_size <= 1024
    assert set(built.eos_token_ids) == set(model.generation_config.eos_token_id)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, config.vocab_size)


def test_chat_template_is_chatml_with_the_math_system_prompt(built: TinyModelInfo) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built.path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 1?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    own_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenize=False
    )
    assert own_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    # Byte-level BPE: any text round-trips, special tokens are single ids.
    sample = "Ünïcode \\boxed{\\frac{1}{2}} 12345"
    assert tokenizer.decode(tokenizer.encode(sample)) == sample
    assert len(tokenizer.encode("<|im_start|>")) == 1


def test_info_file_matches(built: TinyModelInfo) -> None:
    info = json.loads((Path(built.path) / "tiny_model_info.json").read_text())
    assert info["pretrain_steps"] == 2 and info["head_dim"] == 64


def test_tokenizer_is_deterministic(tmp_path: Path, built: TinyModelInfo) -> None:
    # Same arguments, same tokenizer: token ids in recorded fixtures stay valid across rebuilds.
    _train_tokenizer(1024, 0).save_pretrained(tmp_path)  # type: ignore[attr-defined]
    assert (tmp_path / "tokenizer.json").read_bytes() == (
        Path(built.path) / "tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, "vocab_size=100"),
        ({"hidden_size": 129}, "not divisible by num_attention_heads"),
        (
            {"num_attention_heads": 2, "num_key_value_heads": 3},
            "not divisible by num_key_value_heads",
        ),
        ({"hidden_size": 96, "num_attention_heads": 2}, "head_dim=48"),
        ({"pretrain_steps": -1}, "pretrain_steps=-1"),
    ],
)
def test_rejects_shapes_vllm_would_refuse(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_cli_reports_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "x"), "--hidden-size", "129"]) == 2
    assert "not divisible" in capsys.readouterr().err
