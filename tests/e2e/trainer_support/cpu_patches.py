"""What TRL 1.16's AsyncGRPOTrainer needs patched to run on a CPU-only machine without vLLM.

Applied by ``run_trainer_cpu.py`` inside the trainer subprocess of the e2e test, never by
``trainer/`` (the GPU path runs TRL unpatched):

- ``AsyncRolloutWorker`` refuses to start unless ``vllm`` is importable, although it only talks
  HTTP to the server: the import check is answered True.
- ``get_peak_flops_per_device`` calls ``torch.cuda.get_device_name``: answered None (MFU metrics
  off, as TRL does for unknown devices).
- Tree-packed attention calls FlashAttention-3 from a Hub kernel (``kernels`` package, CUDA only):
  replaced by ``varlen_attention``, a plain-torch implementation of the same
  ``flash_attn_varlen_func`` contract (per-segment causal attention, bottom-right aligned, GQA).

``record_renames`` wraps ``os.rename`` to log each call, so the test can show adapters were
published by an atomic rename of a staging directory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **_: Any,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` in plain torch: ``q`` is (total_q, H, D), ``k``/``v`` are
    (total_k, H_kv, D); segment ``s`` attends its queries ``cu_q[s]:cu_q[s+1]`` to keys
    ``cu_k[s]:cu_k[s+1]``, causally aligned to the end of the keys as FlashAttention does."""
    if window_size != (-1, -1):
        raise NotImplementedError("sliding-window attention is not needed by the tiny test model")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    groups = q.shape[1] // k.shape[1]
    outputs = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        qi = q[qs:qe].transpose(0, 1).float()  # H, Lq, D
        ki = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        vi = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        scores = (qi @ ki.transpose(-1, -2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:
            lq, lk = qe - qs, ke - ks
            rows = torch.arange(lq).unsqueeze(1)
            cols = torch.arange(lk).unsqueeze(0)
            scores = scores.masked_fill(cols > rows + (lk - lq), float("-inf"))
        outputs.append((torch.softmax(scores, -1) @ vi).transpose(0, 1).to(q.dtype))
    return torch.cat(outputs, 0)


def record_renames(log_path: str) -> None:
    real_rename = os.rename
    lock = threading.Lock()

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real_rename(src, dst, *args, **kwargs)
        with lock, open(log_path, "a") as f:
            f.write(
                json.dumps({"t": time.time(), "src": os.fspath(src), "dst": os.fspath(dst)}) + "\n"
            )

    os.rename = rename


def apply() -> None:
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    async_rollout_worker.is_vllm_available = lambda *a, **k: True  # type: ignore[attr-defined]
    async_grpo_trainer.get_peak_flops_per_device = lambda *a, **k: None  # type: ignore[attr-defined]
    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)  # type: ignore[assignment]
    log = os.environ.get("E2E_RENAME_LOG")
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        record_renames(log)
