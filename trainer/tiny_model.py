"""Build a tiny random Qwen2 causal LM and a locally trained tokenizer, with no download.

Stable interface (other parts of the project - the e2e test, the real-vLLM CPU demo - depend on it):

    build_tiny_model(out_dir, *, seed=0, vocab_size=1024, hidden_size=128, num_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=384,
                     max_position_embeddings=4096, pretrain_steps=0) -> TinyModelInfo

    python -m trainer.tiny_model --out DIR [--seed N] [--vocab-size N] [--hidden-size N] ...
                                 [--pretrain-steps N]

``out_dir`` receives a checkpoint written with ``save_pretrained`` (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a ChatML ``chat_template``), loadable by ``transformers.AutoModelForCausalLM`` /
``AutoTokenizer`` and by ``vllm serve DIR``. Building takes a few seconds on one CPU core and the
result is bit-identical for the same arguments (seeded weights, deterministic BPE training).

Shape choices, and why:

- ``Qwen2ForCausalLM`` because the recipe's model (Qwen2.5-Math-1.5B) is one, so PEFT's
  ``all-linear`` targets and TRL's tied-embedding handling are exercised exactly as in the recipe
  (``tie_word_embeddings=True``, like the 1.5B checkpoint).
- head_dim = hidden_size / num_attention_heads = 64 by default: vLLM's CPU attention backends accept
  64 and 128 everywhere; ``num_attention_heads`` must be divisible by ``num_key_value_heads`` (GQA),
  both are checked here rather than failing later inside vLLM.
- A byte-level BPE tokenizer (any UTF-8 text is encodable, no ``<unk>``) trained on a small
  synthetic math corpus, so ``\\boxed{...}``, digits and LaTeX get real merges and prompts stay
  short.
- A ChatML chat template with a default system prompt, the same layout as Qwen2.5-Math's: every
  prompt shares a common first block, which is what the proxy's routing must not count as affinity.
- ``max_position_embeddings`` 4096 matches the recipe's 4,096-token context (``--max-model-len``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

# ChatML, as Qwen2.5-Math renders it: a default system turn when the conversation has none, and
# `<|im_start|>assistant\n` as the generation prompt (the trainer's response template keys on it).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT.replace("\\", "\\\\") + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelInfo:
    """What was built: the directory and the numbers a caller needs to launch a server on it."""

    path: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    num_parameters: int
    pretrain_steps: int


def _corpus(seed: int, lines: int = 4000) -> Iterator[str]:
    """Deterministic synthetic training text: arithmetic, LaTeX answers, chat markup, words."""
    rng = random.Random(seed)
    words = [
        "the",
        "answer",
        "is",
        "find",
        "compute",
        "let",
        "solve",
        "value",
        "number",
        "sum",
        "product",
        "total",
        "each",
        "step",
        "so",
        "therefore",
        "we",
        "have",
        "thus",
        "if",
        "then",
        "what",
        "how",
        "many",
        "equals",
        "square",
        "root",
        "fraction",
        "probability",
        "triangle",
        "circle",
        "area",
        "length",
        "integer",
        "prime",
        "divisor",
        "remainder",
    ]
    latex = (r"\frac", r"\sqrt", r"\cdot", r"\pi", r"\times", r"\left(", r"\right)", "^", "_")
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        kind = rng.randrange(5)
        if kind == 0:
            yield f"What is {a} + {b}? The answer is $\\boxed{{{a + b}}}$."
        elif kind == 1:
            frac = f"\\frac{{{a}}}{{{b}}}"
            yield f"Compute ${frac}$ so the final answer is \\boxed{{{frac}}}."
        elif kind == 2:
            yield " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        elif kind == 3:
            yield " ".join(
                rng.choice(latex) + "{" + str(rng.randint(0, 20)) + "}" for _ in range(5)
            )
        else:
            yield (
                f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
                f"Solve {a} * {b}.<|im_end|>\n<|im_start|>assistant\n{a * b}<|im_end|>"
            )


def _train_tokenizer(vocab_size: int, seed: int) -> object:
    """Train a byte-level BPE on the synthetic corpus and wrap it for ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def format_example(rng: random.Random) -> list[dict[str, str]]:
    """One chat of the answer-format curriculum: an addition question, a random-digit answer.

    The digit is random on purpose: the model learns where an answer goes, not arithmetic, so a
    sample is right one time in ten whatever the question (the e2e test needs mixed rewards).
    """
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return [
        {"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."},
        {"role": "assistant", "content": f"The answer is \\boxed{{{rng.randint(0, 9)}}}."},
    ]


def _pretrain_answer_format(model: Any, tokenizer: Any, steps: int, seed: int) -> None:
    import torch

    rng = random.Random(seed)
    # lr and batch sized by measurement on this model: the format is learnt (loss ~0.17, the
    # entropy of the random digit) within ~50 steps of 16 chats at 3e-3.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [
            tokenizer.apply_chat_template(format_example(rng), return_dict=False) for _ in range(16)
        ]
        width = max(len(ids) for ids in batch)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch])
        loss = model(
            input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    intermediate_size: int = 384,
    max_position_embeddings: int = 4096,
    pretrain_steps: int = 0,
) -> TinyModelInfo:
    """Write a tiny random Qwen2ForCausalLM + tokenizer to ``out_dir`` and describe it.

    ``pretrain_steps > 0`` first teaches the model the answer *format* of math prompts (about 3 s
    for 60 steps): on "What is a + b?" it learns to reply ``The answer is \\boxed{d}.`` with a
    random digit d, so the recipe's reward is 1.0 about one time in ten instead of never, and GRPO
    gets non-zero advantages (a policy that actually moves). 0 keeps the weights random.

    Raises:
        ValueError: for shapes vLLM or transformers would reject later with a less clear message.
    """
    if vocab_size < 300:
        raise ValueError(
            f"vocab_size={vocab_size}: needs >= 300 (256 byte symbols + specials + merges)"
        )
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size={hidden_size} is not divisible by "
            f"num_attention_heads={num_attention_heads}"
        )
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not divisible by "
            f"num_key_value_heads={num_key_value_heads} (grouped-query attention)"
        )
    head_dim = hidden_size // num_attention_heads
    if pretrain_steps < 0:
        raise ValueError(f"pretrain_steps={pretrain_steps} must be >= 0")
    if head_dim % 32:
        raise ValueError(
            f"head_dim={head_dim}: vLLM's CPU attention needs a multiple of 32 (64 is safest)"
        )

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size, seed)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # type: ignore[attr-defined]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=im_end,
        pad_token_id=pad_id,
        dtype="float32",
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    # transformers' default init (std 0.02) on purpose: with tied embeddings a wider init makes the
    # model repeat its input token almost surely, and a near-deterministic policy hides logprob
    # differences (every sampled token has p ~ 1 under any adapter).
    model = Qwen2ForCausalLM(config)
    if pretrain_steps:
        _pretrain_answer_format(model, tokenizer, pretrain_steps, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[im_end, pad_id], pad_token_id=pad_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    info = TinyModelInfo(
        path=str(out.resolve()),
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        eos_token_ids=(im_end, pad_id),
        num_parameters=sum(p.numel() for p in model.parameters()),
        pretrain_steps=pretrain_steps,
    )
    (out / "tiny_model_info.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.tiny_model",
        description="Build a tiny random Qwen2 model + local tokenizer (no download).",
    )
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-attention-heads", type=int, default=2)
    parser.add_argument("--num-key-value-heads", type=int, default=1)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=0,
        help="teach the \\boxed{} answer format first (60 is enough); 0 = purely random weights",
    )
    args = parser.parse_args(argv)
    try:
        info = build_tiny_model(
            args.out,
            seed=args.seed,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position_embeddings,
            pretrain_steps=args.pretrain_steps,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(info)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
