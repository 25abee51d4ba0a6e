"""Merged-weight sync through the proxy with real vLLM on a GPU: TRL 1.16's own
``WeightTransferClient`` (NCCL) pushes a DoRA model's merged weights to every replica behind the
proxy, three times, and the result is written as JSON. Run by scripts/gpu_merged_weights.sh,
which starts the replicas and the proxy; needs a CUDA GPU, vLLM 0.33 and TRL 1.16 with peft.

Checks, after each sync: the proxy's finish answer lists every replica; each replica's own
/weight_checker checksums (read from the replica directly) agree with the other replica's and
differ from the launch weights; completions through the proxy carry the sync's
X-Proxy-Weight-Version and are answered by both replicas.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import requests
import torch


def checksums(url: str) -> dict[str, str]:
    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=300)
    r.raise_for_status()
    result: dict[str, str] = r.json()["checksums"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--proxy", required=True)
    parser.add_argument("--replicas", nargs="+", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()

    from accelerate import PartialState
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import (
        _iter_vllm_named_params,
        select_adapter_sync,
    )
    from trl.experimental.async_grpo.vllm_client import VLLMClient
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    PartialState()
    result: dict[str, Any] = {"model": args.model, "replicas": args.replicas, "syncs": []}
    client = VLLMClient(args.proxy, server_timeout=600)
    client.wait_for_server_ready()
    info = client.get_server_info()
    dtype = getattr(torch, info["model_config"]["dtype"].removeprefix("torch."))
    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype).to("cuda")
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_dora=True)
    )
    cfg = AsyncGRPOConfig(output_dir="/tmp/gpu-merged-weights", bf16=dtype == torch.bfloat16)
    result["adapter_sync"] = select_adapter_sync(info, model, cfg)  # False: DoRA -> merged
    names, dtypes, shapes = [], [], []
    for name, param in _iter_vllm_named_params(model):
        names.append(name)
        dtypes.append(str(param.dtype).split(".")[-1])
        shapes.append(list(param.shape))
    wt = WeightTransferClient(
        client, {"names": names, "dtype_names": dtypes, "shapes": shapes}, weight_sync_timeout=900
    )
    launch = [checksums(u) for u in args.replicas]
    started = time.time()
    wt.init_weight_transfer()
    result["init_s"] = round(time.time() - started, 2)
    result["world_size"] = requests.get(f"{args.proxy}/get_world_size", timeout=60).json()

    for n in range(1, args.syncs + 1):
        with torch.no_grad():  # move the DoRA adapter so the merged weights change each sync
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.add_(torch.randn_like(p) * 0.01)
        t0 = time.time()
        model.merge_adapter()
        try:
            wt.pause()
            wt.send_weights((nm, p.detach()) for nm, p in _iter_vllm_named_params(model))
            wt.resume()
        finally:
            model.unmerge_adapter()
        sums = [checksums(u) for u in args.replicas]
        headers = []
        for _ in range(8):
            r = requests.post(
                f"{args.proxy}/v1/completions",
                json={"model": args.model, "prompt": "1 + 1 =", "max_tokens": 4},
                timeout=300,
            )
            headers.append(
                (
                    r.status_code,
                    r.headers.get("x-proxy-replica"),
                    r.headers.get("x-proxy-weight-version"),
                )
            )
        health = requests.get(f"{args.proxy}/health", timeout=30).json().get("weights")
        result["syncs"].append(
            {
                "n": n,
                "seconds": round(time.time() - t0, 2),
                "replicas_agree": all(s == sums[0] for s in sums),
                "changed_from_launch": all(s != b for s, b in zip(sums, launch, strict=True)),
                "completions": headers,
                "version_header_ok": all(h[2] == str(n) for h in headers),
                "both_replicas_served": len({h[1] for h in headers}) == len(args.replicas),
                "health_weights": health,
            }
        )
        print(json.dumps(result["syncs"][-1])[:400], flush=True)
    wt.destroy()
    result["ok"] = (
        bool(result["syncs"])
        and all(
            s["replicas_agree"] and s["changed_from_launch"] and s["version_header_ok"]
            for s in result["syncs"]
        )
        and result["adapter_sync"] is False
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("ok" if result["ok"] else "FAILED", args.out)


if __name__ == "__main__":
    main()
