"""Write a small, deterministic, non-zero PEFT LoRA adapter for a local causal-LM checkpoint.

    python scripts/tiny_lora.py --base MODEL_DIR --out ADAPTER_DIR [--rank 1] [--seed 1]

Runs in the project's main venv (``torch``, ``transformers``, ``peft`` from the ``trainer`` extra);
no download. The result is what TRL's AsyncGRPOTrainer saves at each weight sync
(``save_pretrained`` of a ``LoraConfig(target_modules="all-linear")`` model: ``adapter_config.json``
+ ``adapter_model.safetensors``), so vLLM's ``/v1/load_lora_adapter`` treats both alike.

Why not PEFT's default initialisation: it zeroes ``lora_B``, so a fresh adapter is the identity and
cannot show that a replica really serves it. ``init_lora_weights=False`` keeps ``nn.Linear``'s own
(seeded) uniform init for both factors; with ``lora_alpha = 2 * rank`` (the recipe's r=1, alpha=2)
the update is a few times larger than the tiny model's 0.02-std weights, which reliably changes
greedy tokens. The tests assert that change on the real servers rather than trusting this comment.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_tiny_lora(base: str | Path, out: str | Path, *, rank: int = 1, seed: int = 1) -> Path:
    """Save a LoRA adapter of ``rank`` on all linear layers of ``base`` into ``out``; return it."""
    if rank < 1:
        raise ValueError(f"rank={rank}: must be >= 1")
    base_dir = Path(base)
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"{base_dir} has no config.json: not a model directory")

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules="all-linear",
        init_lora_weights=False,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def build_assets(
    work: Path, adapters: Mapping[str, tuple[int, int]], python: str = sys.executable
) -> dict[str, Path]:
    """The trainer's tiny model in ``work/model`` and one adapter per ``name: (rank, seed)`` in
    ``work/name``; returns {"model": ..., name: ...}.

    Each build runs in its own interpreter: torch/transformers stay out of the caller (a test
    process with warnings-as-errors, or a launcher), and the adapters build in parallel.
    """
    model = work / "model"
    _run([python, "-m", "trainer.tiny_model", "--out", str(model)], "trainer.tiny_model")
    procs = {
        name: subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--base", str(model), "--out", str(work / name)]
            + ["--rank", str(rank), "--seed", str(seed)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=REPO_ROOT,
        )
        for name, (rank, seed) in adapters.items()
    }
    failures = []
    for name, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode != 0:
            failures.append(
                f"{name} (exit {proc.returncode}):\n{err.decode(errors='replace')[-2000:]}"
            )
    if failures:
        raise RuntimeError("building LoRA adapters failed: " + "\n".join(failures))
    return {"model": model, **{name: work / name for name in adapters}}


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/tiny_lora.py",
        description="Write a small non-zero PEFT LoRA adapter for a local model (no download).",
    )
    parser.add_argument("--base", required=True, help="base model directory")
    parser.add_argument("--out", required=True, help="adapter output directory (created)")
    parser.add_argument("--rank", type=int, default=1, help="LoRA rank (the recipe uses 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the adapter's weights")
    args = parser.parse_args(argv)
    try:
        out = build_tiny_lora(args.base, args.out, rank=args.rank, seed=args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"path": str(out.resolve()), "rank": args.rank, "seed": args.seed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
