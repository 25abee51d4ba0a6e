"""The torch-backed fake vLLM replica answers like vLLM 0.33 and serves the adapter it loaded.

The trainer e2e test trusts this fake to tell a right served policy from a wrong one, so its
sampling math (checked against transformers + PEFT) and its vLLM status codes are tested here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("fake_vllm")
    model_dir = Path(build_tiny_model(root / "model").path)
    paths = {"model": model_dir}
    for name, rank, seed in (("a", 1, 1), ("b", 1, 2), ("c", 1, 3), ("r8", 8, 4)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = get_peft_model(
            base,
            LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False
            ),
        )
        peft.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.fixture
async def replica(
    assets: dict[str, Path], tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    from tests.e2e.trainer_support.fake_vllm import Engine, create_app

    engine = Engine(str(assets["model"]), "tiny", max_loras=2, max_lora_rank=1, max_model_len=128)
    record = tmp_path / "record.jsonl"
    transport = httpx.ASGITransport(create_app(engine, record))
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        yield client, record


def _completion(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": 5,
        **extra,
    }


async def _load(client: httpx.AsyncClient, name: str, path: Path) -> httpx.Response:
    return await client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path), "load_inplace": False},
    )


async def test_adapter_endpoints_answer_like_vllm(
    replica: tuple[httpx.AsyncClient, Path], assets: dict[str, Path]
) -> None:
    client, _ = replica
    ok = await _load(client, "trl-policy-v1", assets["a"])
    assert ok.status_code == 200 and ok.text.startswith("Success")
    again = await _load(client, "trl-policy-v1", assets["b"])
    assert again.status_code == 400
    assert (
        again.json()["error"]["message"]
        == "The lora adapter 'trl-policy-v1' has already been loaded."
    )
    missing = await _load(client, "trl-policy-v2", assets["a"].parent / "not-there")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert "No adapter found for" in missing.json()["error"]["message"]
    too_big = await _load(client, "big", assets["r8"])
    assert too_big.status_code == 500 and "max_lora_rank" in too_big.json()["error"]["message"]
    assert (await client.post("/v1/load_lora_adapter", json={"lora_name": "x"})).status_code == 400

    models = (await client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "trl-policy-v1"]
    assert models[0]["max_model_len"] == 128 and models[1]["max_model_len"] is None
    assert models[1]["root"] == str(assets["a"]) and models[1]["parent"] == "tiny"

    unknown = await client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert unknown.status_code == 404
    assert (
        await client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    ).status_code == 200
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["tiny"]

    info = (await client.get("/server_info", params={"config_format": "json"})).json()[
        "vllm_config"
    ]
    assert (
        info["lora_config"]["max_loras"] == 2 and info["parallel_config"]["data_parallel_size"] == 1
    )


async def test_completions_errors(replica: tuple[httpx.AsyncClient, Path]) -> None:
    client, _ = replica
    unknown = await client.post("/v1/completions", json=_completion("trl-policy-v9", [1, 2, 3]))
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {
            "message": "The model `trl-policy-v9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    too_long = await client.post(
        "/v1/completions", json=_completion("tiny", list(range(3, 120)), max_tokens=20)
    )
    assert (
        too_long.status_code == 400
        and "maximum context length is 128" in too_long.json()["error"]["message"]
    )


async def test_samples_with_the_adapter_it_loaded(
    replica: tuple[httpx.AsyncClient, Path], assets: dict[str, Path]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client, _ = replica
    assert (await _load(client, "trl-policy-v1", assets["a"])).status_code == 200
    prompt = list(range(5, 30))
    first = (
        await client.post("/v1/completions", json=_completion("trl-policy-v1", prompt))
    ).json()["choices"][0]
    second = (
        await client.post("/v1/completions", json=_completion("trl-policy-v1", prompt))
    ).json()["choices"][0]
    assert first["token_ids"] == second["token_ids"], "same seed, same sample"
    assert len(first["token_ids"]) == len(first["logprobs"]["token_logprobs"]) >= 1
    assert first["finish_reason"] in ("stop", "length")

    base = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(assets["a"])).eval()
    ids = torch.tensor([prompt + first["token_ids"]])
    with torch.no_grad():
        adapter_lp = torch.log_softmax(model(ids).logits[0], -1)
        with model.disable_adapter():
            base_lp = torch.log_softmax(model(ids).logits[0], -1)
    positions = range(len(prompt) - 1, ids.shape[1] - 1)
    served = first["logprobs"]["token_logprobs"]
    expected = [float(adapter_lp[p, t]) for p, t in zip(positions, first["token_ids"], strict=True)]
    unadapted = [float(base_lp[p, t]) for p, t in zip(positions, first["token_ids"], strict=True)]
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(served, unadapted, strict=True)) > 1e-2

    scored = (
        await client.post(
            "/v1/completions", json=_completion("trl-policy-v1", prompt, prompt_logprobs=0)
        )
    ).json()
    prompt_lp = scored["choices"][0]["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(prompt)
    got = [next(iter(entry.values()))["logprob"] for entry in prompt_lp[1:]]
    want = [float(adapter_lp[i, t]) for i, t in enumerate(prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


async def test_pause_keep_freezes_requests_until_resume(
    replica: tuple[httpx.AsyncClient, Path],
) -> None:
    client, record = replica
    assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
    assert (await client.get("/is_paused")).json() == {"is_paused": True}
    pending = asyncio.create_task(
        client.post("/v1/completions", json=_completion("tiny", [1, 2, 3]))
    )
    await asyncio.sleep(0.5)
    assert not pending.done(), "a request ran while the replica was paused"
    resumed = await client.post("/resume")
    assert resumed.json() == {"status": "resumed"}
    assert (await asyncio.wait_for(pending, 30)).status_code == 200
    assert (await client.get("/is_paused")).json() == {"is_paused": False}
    paths = [json.loads(line)["path"] for line in record.read_text().splitlines()]
    assert paths[:2] == ["/pause", "/resume"] and paths[-1] == "/v1/completions"


async def test_lru_eviction_reloads_from_disk_and_fails_without_the_files(
    replica: tuple[httpx.AsyncClient, Path], assets: dict[str, Path], tmp_path: Path
) -> None:
    client, record = replica
    gone = tmp_path / "a-copy"
    shutil.copytree(assets["a"], gone)
    for name, path in (("v1", gone), ("v2", assets["b"]), ("v3", assets["c"])):  # max_loras=2
        assert (await _load(client, name, path)).status_code == 200
    events = [json.loads(line) for line in record.read_text().splitlines()]
    assert {"event": "evict", "name": "v1"}.items() <= next(
        e for e in events if "event" in e
    ).items()
    assert (await client.post("/v1/completions", json=_completion("v1", [1, 2]))).status_code == 200
    assert any(
        json.loads(line).get("event") == "reload" for line in record.read_text().splitlines()
    )
    # v1 is resident again and v2 was evicted; without its files v2 cannot come back.
    shutil.rmtree(assets["b"].parent / "b-moved", ignore_errors=True)
    shutil.move(str(assets["b"]), str(assets["b"].parent / "b-moved"))
    try:
        failed = await client.post("/v1/completions", json=_completion("v2", [1, 2]))
    finally:
        shutil.move(str(assets["b"].parent / "b-moved"), str(assets["b"]))
    assert (
        failed.status_code == 500
        and "reloading evicted adapter v2 failed" in failed.json()["error"]["message"]
    )
