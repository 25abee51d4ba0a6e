"""TRL 1.16's own VLLMClient (what AsyncGRPOTrainer's main process uses) against the proxy in
front of two fake replicas, plus a rollout posted exactly as TRL's rollout worker posts it."""

from __future__ import annotations

import random
import warnings

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient


def tiny_peft_model(rank: int = 1):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = Qwen2ForCausalLM(config)
    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    )


def test_trl_vllm_client_through_the_proxy(make_fleet, tmp_path) -> None:
    from accelerate import PartialState

    PartialState()  # TRL logs through accelerate, which needs its state initialised
    h = make_fleet(2)
    client = VLLMClient(h.proxy.url, server_timeout=10)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() == 4096

    info = client.get_server_info()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=4, bf16=False, use_cpu=True)
    assert select_adapter_sync(info, tiny_peft_model(rank=1), args) is True
    with pytest.raises(ValueError, match="max-lora-rank"):
        select_adapter_sync(info, tiny_peft_model(rank=8), args)

    for version in (1, 2):
        path = tmp_path / f"trl-policy-v{version}"
        path.mkdir()
        client.pause()
        client.load_lora_adapter(f"trl-policy-v{version}", str(path))
        client.resume()
    client.unload_lora_adapter("trl-policy-v1")
    for fake in h.fakes:
        assert fake.adapters == {"trl-policy-v2": str(tmp_path / "trl-policy-v2")}
        assert [p for p, _ in fake.control_calls()] == [
            "/pause?mode=keep",
            "/v1/load_lora_adapter",
            "/resume",
            "/pause?mode=keep",
            "/v1/load_lora_adapter",
            "/resume",
            "/v1/unload_lora_adapter",
        ]
    # These fakes have no weight-transfer endpoints: the proxy's error names each replica and
    # TRL stops at once (test_merged_weights.py runs the merged path against replicas that do).
    with pytest.raises(KeyError):
        client.get_world_size()


async def test_rollout_request_as_trl_sends_it(make_fleet) -> None:
    import aiohttp

    h = make_fleet(2)
    h.client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "trl-policy-v1", "lora_path": "/b/1", "load_inplace": False},
    )
    prompt_ids = [random.Random(0).randrange(100_000) for _ in range(300)]
    payload = {  # field for field what _AsyncRolloutLoop._generate_one_turn posts
        "model": "trl-policy-v1",
        "prompt": prompt_ids,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": random.getrandbits(63),
    }
    timeout = aiohttp.ClientTimeout(total=30)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8))
    try:
        async with session.post(
            f"{h.proxy.url}/v1/completions", json=payload, timeout=timeout
        ) as response:
            response.raise_for_status()
            assert response.content_type == "application/json"
            output = await response.json()
    finally:
        await session.close()
    choice = output["choices"][0]
    token_ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(token_ids) == len(logprobs) == 16
    served = [f for f in h.fakes if f.served]
    assert len(served) == 1 and served[0].served[0]["body"] == payload
