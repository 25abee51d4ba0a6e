"""Run ``python -m trainer`` on a CPU-only machine: TRL 1.16 patched where it assumes a GPU.

    python scripts/cpu_trainer.py [any `python -m trainer` flag ...]

Used by ``make demo`` (``scripts/demo.py``) and the trainer's CPU end-to-end test
(``tests/e2e/test_trainer_e2e.py``). The patches live here, outside ``trainer/``, on purpose: the
real (GPU) path runs TRL unpatched, and nothing under ``trainer/`` imports this module.

What TRL's AsyncGRPOTrainer needs on a CPU-only machine without vLLM installed:

- ``AsyncRolloutWorker`` refuses to start unless ``vllm`` is importable, although it only talks
  HTTP to the server: its import check is answered True.
- ``get_peak_flops_per_device`` calls ``torch.cuda.get_device_name``: answered None (MFU metrics
  off, as TRL does for devices it does not know).
- Tree-packed attention calls FlashAttention-3 from a Hub kernel (``kernels`` package, CUDA only,
  and a download): replaced by ``varlen_attention``, a plain-torch implementation of the same
  ``flash_attn_varlen_func`` contract.

And what accelerate needs for the recipe's FSDP2 launch (``accelerate launch --config_file
deploy/accelerate/fsdp2.yaml --num_processes 2``) on CPU:

- accelerate 1.15 turns an FSDP launch into ``DistributedType.FSDP`` only for GPU-class device
  types (``AcceleratorState.__init__``'s list: MULTI_GPU, MULTI_XPU, ...); on CPU the processes
  join over gloo as ``MULTI_CPU`` and the FSDP plugin is dropped, so training silently runs as
  plain data parallel with full replicas and full checkpoints. torch 2.13's FSDP2
  (``fully_shard``, DTensor, reduce-scatter and all-gather over gloo) works on CPU, so the state
  is switched to FSDP with the plugin accelerate built from the launch config - exactly what the
  GPU branch does (``distributed_type = FSDP; fsdp_plugin = fsdp_plugin``).

Environment: ``CPU_TRAINER_RENAME_LOG=PATH`` appends one JSON line per ``os.rename`` call of the
trainer process to PATH, so a test can show adapters are published by an atomic rename.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The TRL release these patches were written against (the trainer extra pins it). Another release
# may have moved what is patched; apply() then fails with the names it could not find.
TRL_VERSION = "1.16.0"
RENAME_LOG_ENV = "CPU_TRAINER_RENAME_LOG"


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
    """``flash_attn_varlen_func`` in plain torch.

    ``q`` is (total_q, H, D), ``k``/``v`` are (total_k, H_kv, D) with H a multiple of H_kv (GQA).
    Segment ``s`` attends its queries ``cu_q[s]:cu_q[s+1]`` to keys ``cu_k[s]:cu_k[s+1]``. As in
    FlashAttention, the causal mask and the sliding window are aligned to the bottom right: query
    ``i`` of a segment with ``lq`` queries and ``lk`` keys sits at key position ``i + lk - lq``, and
    ``window_size=(left, right)`` (-1: unbounded) keeps keys within ``[pos - left, pos + right]``.
    Computed in float32, returned in ``q``'s dtype. ``max_seqlen_*`` are accepted for the
    signature only: nothing here is sized by them.
    """
    import torch

    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected (tokens, heads, dim) tensors, got {q.shape}, {k.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k describe different numbers of segments")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    groups = q.shape[1] // k.shape[1]
    left, right = window_size
    outputs = []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        if qe == qs:
            continue
        qi = q[qs:qe].transpose(0, 1).float()  # H, Lq, D
        ki = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        vi = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1).float()
        scores = (qi @ ki.transpose(-1, -2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        lq, lk = qe - qs, ke - ks
        pos = torch.arange(lq).unsqueeze(1) + (lk - lq)  # each query's key position
        cols = torch.arange(lk).unsqueeze(0)
        masked = torch.zeros(lq, lk, dtype=torch.bool)
        if causal:
            masked |= cols > pos
        if left >= 0:
            masked |= cols < pos - left
        if right >= 0 and not causal:
            masked |= cols > pos + right
        scores = scores.masked_fill(masked, float("-inf"))
        # A query with every key masked (possible only with lq > lk) gets zeros, as in FA.
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        outputs.append((probs @ vi).transpose(0, 1).to(q.dtype))
    if not outputs:
        return q.new_zeros(q.shape)
    return torch.cat(outputs, 0)


def record_renames(log_path: str | os.PathLike[str]) -> None:
    """Wrap ``os.rename`` (process-wide) so every call is appended to ``log_path`` as JSON."""
    path = os.fspath(log_path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    real_rename = os.rename
    lock = threading.Lock()

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        real_rename(src, dst, *args, **kwargs)
        entry = {"t": time.time(), "src": os.fspath(src), "dst": os.fspath(dst)}
        with lock, open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    os.rename = rename


def enable_fsdp_on_cpu() -> None:
    """Let an FSDP launch on CPU (gloo) become FSDP, as it does on GPUs (see the module doc)."""
    from accelerate.state import AcceleratorState  # type: ignore[import-untyped]
    from accelerate.utils import DistributedType  # type: ignore[import-untyped]

    real_init = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        real_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def _require(module: ModuleType, name: str, missing: list[str]) -> None:
    if not hasattr(module, name):
        missing.append(f"{module.__name__}.{name}")


def apply(rename_log: str | os.PathLike[str] | None = None) -> None:
    """Patch TRL in this process (call before the trainer is built). Raises RuntimeError naming
    what is missing if the installed TRL does not have what these patches replace."""
    import importlib.metadata

    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    missing: list[str] = []
    _require(async_rollout_worker, "is_vllm_available", missing)
    _require(async_grpo_trainer, "get_peak_flops_per_device", missing)
    _require(packing, "_flash_attn", missing)
    if missing:
        raise RuntimeError(
            f"cpu_trainer: trl {importlib.metadata.version('trl')} has no {', '.join(missing)}; "
            f"these CPU patches were written for trl=={TRL_VERSION}"
        )
    async_rollout_worker.is_vllm_available = lambda *a, **k: True
    async_grpo_trainer.get_peak_flops_per_device = lambda *a, **k: None
    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    enable_fsdp_on_cpu()
    if rename_log:
        record_renames(rename_log)


def main(argv: Sequence[str] | None = None) -> int:
    """Apply the patches, then run ``python -m trainer``'s main with ``argv``."""
    # The recipe is TRL's experimental AsyncGRPO by design; its import warning says nothing new.
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        apply(os.environ.get(RENAME_LOG_ENV) or None)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2
    from trainer.__main__ import main as trainer_main

    # trainer_main tears the process group down itself (trainer/__main__.py), also for the
    # ranks started from here.
    return trainer_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    # Run by path, sys.path[0] is scripts/; the trainer package sits at the repository root.
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
    from trainer.__main__ import exit_process

    exit_process(main())
