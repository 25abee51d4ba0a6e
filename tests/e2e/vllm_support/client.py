"""Small synchronous helpers for talking to a vLLM replica (or the proxy) the way TRL does."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

# Token ids 0-2 are the tiny model's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>);
# prompts avoid them so that nothing but the ids under test reaches the model.
FIRST_PLAIN_TOKEN = 3


def random_prompt(rng: random.Random, length: int, vocab_size: int = 1024) -> list[int]:
    """A token-id prompt no other test sends (the caller's rng makes it unique)."""
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length)]


def trl_completion_body(
    model: str,
    prompt: Sequence[int],
    *,
    max_tokens: int = 8,
    temperature: float = 0.0,
    seed: int = 1234,
) -> dict[str, Any]:
    """The body TRL 1.16's AsyncGRPOTrainer posts per rollout (REFERENCE.md section 1)."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    replica: str | None  # the proxy's X-Proxy-Replica header, when through the proxy


def complete(client: httpx.Client, base_url: str, body: dict[str, Any]) -> Completion:
    """POST /v1/completions and read what TRL reads; any non-200 fails with vLLM's message."""
    resp = client.post(f"{base_url}/v1/completions", json=body)
    if resp.status_code != 200:
        raise AssertionError(
            f"{base_url} answered {resp.status_code} for model {body['model']!r}: {resp.text}"
        )
    choice = resp.json()["choices"][0]
    return Completion(
        token_ids=list(choice["token_ids"]),
        logprobs=list(choice["logprobs"]["token_logprobs"]),
        replica=resp.headers.get("x-proxy-replica"),
    )


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` whose labels include ``labels`` (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@dataclass(frozen=True)
class PrefixCounters:
    """vLLM's prefix-cache counters, in tokens."""

    queries: float
    hits: float


def prefix_counters(client: httpx.Client, base_url: str) -> PrefixCounters:
    text = client.get(f"{base_url}/metrics").text
    return PrefixCounters(
        queries=metric_sum(text, "vllm:prefix_cache_queries_total"),
        hits=metric_sum(text, "vllm:prefix_cache_hits_total"),
    )


def cache_hit_tokens(prompt_len: int, block_size: int) -> int:
    """Tokens a repeated prompt hits in vLLM's prefix cache: whole blocks, and never the last
    prompt token (vLLM recomputes it to get logits), so (len - 1) // block_size blocks."""
    return (prompt_len - 1) // block_size * block_size


def load_adapter(client: httpx.Client, base_url: str, name: str, path: str) -> httpx.Response:
    return client.post(
        f"{base_url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": path, "load_inplace": False},
    )
