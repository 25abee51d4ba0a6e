"""The recipe's distributed path on CPU: ``accelerate launch --num_processes 2`` with FSDP2 (gloo).

The same stack as ``test_trainer_e2e.py`` (a tiny Qwen2 model, two torch-backed fake vLLM
replicas, the real proxy), but the trainer is launched the way the recipe launches it on GPUs:
``accelerate launch --config_file deploy/accelerate/fsdp2.yaml --num_processes 2``, with the one
change CPU requires, ``--mixed_precision no`` (bf16 autocast on CPU would not match the fp32
replicas; on GPU the trainer's own bf16=auto turns it on). Every adapter tensor is then a DTensor
sharded across the two ranks, so this checks what the single-process test cannot:

- the collective adapter save (every rank joins ``full_tensor()``, rank 0 publishes);
- the control calls come from rank 0 only: one pause / load / resume per sync at the replicas;
- TRL's importance ratio stays at 1 on every step (the gathered adapter is the trained one);
- the published adapter equals the trained weights, read back from the sharded checkpoint;
- the sharded checkpoint (``SHARDED_STATE_DICT``) resumes, continuing the adapter versions, and
  the first adapter published after the resume is the checkpoint's, byte for byte.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fakes.net import free_port
from tests.e2e.test_trainer_e2e import (
    CPU_TRAINER,
    MAX_STALENESS,
    REPO,
    Stack,
    TrainRun,
    _check_run,
    _control,
    _loads,
    _timing,
    running_stack,
)
from tests.e2e.trainer_support import procs

# The first test also builds the model, starts the fleet and runs the first training: ~2-3 min
# alone on 2 cores, but pytest's 300 s default (per test, fixtures included) is too close while
# the shared machine runs other suites. A bound for a hang, not a timing check.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

FSDP2_CONFIG = REPO / "deploy" / "accelerate" / "fsdp2.yaml"
PROCESSES = 2
# checkpoint-4 is written at the end of run 1. 4 steps of 4 groups: a group has mixed rewards (a
# gradient) with probability 0.34 (test_trainer_e2e.py), so the policy stays put with probability
# 0.66**16 ~ 0.1%; with 2 steps it was 0.66**8 ~ 3.6%, and one full run saw it happen.
FIRST_STEPS, RESUMED_STEPS = 4, 5


def _launch(stack: Stack, max_steps: int, name: str) -> TrainRun:
    before = [len(procs.read_jsonl(r)) for r in stack.records]
    config = stack.root / f"{name}.yaml"
    config.write_text(
        "\n".join(
            [
                f"model: {stack.model}",
                f"dataset: {stack.dataset}",
                "num_generations: 4",
                # 8 completions per process per step: two groups of 4 on each rank.
                "completions_per_step: 16",
                "per_device_train_batch_size: 8",
                "max_completion_length: 16",
                "max_inflight_tasks: 16",
                "weight_sync_steps: 1",
                "gradient_checkpointing: false",
                "save_steps: 2",
                f"max_staleness: {MAX_STALENESS}",
                "vllm_server_timeout: 60",
            ]
        )
        + "\n"
    )
    env = {
        **stack.env,
        "CPU_TRAINER_RENAME_LOG": str(stack.rename_log),
        # One thread per rank: two ranks on a 2-core machine, and the replicas need CPU too.
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(FSDP2_CONFIG),
        "--num_processes",
        str(PROCESSES),
        "--main_process_port",
        str(free_port()),
        # The one CPU adaptation of the recipe's file (see the module docstring).
        "--mixed_precision",
        "no",
        str(CPU_TRAINER),
        "--config",
        str(config),
        "--vllm-server-base-url",
        stack.proxy_url,
        "--output-dir",
        str(stack.out),
        "--max-steps",
        str(max_steps),
    ]
    trainer = procs.start(name, cmd, stack.root / "logs" / f"{name}.log", env)
    t0 = time.monotonic()
    try:
        returncode = trainer.popen.wait(300)
    finally:
        procs.stop(trainer)
    _timing(f"trainer {name} ({PROCESSES} processes, {max_steps} steps)", t0)
    records = [procs.read_jsonl(r)[n:] for r, n in zip(stack.records, before, strict=True)]
    return TrainRun(returncode, trainer.log.read_text(errors="replace"), records)


def _sharded_adapter(checkpoint: Path) -> dict[str, Any]:
    """The LoRA tensors of a SHARDED_STATE_DICT checkpoint, gathered from every rank's shard
    (torch.distributed.checkpoint, read without a process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (model_dir,) = [p for p in checkpoint.glob("pytorch_model_fsdp_*") if p.is_dir()]
    buffer = checkpoint / "gathered.pt"
    dcp_to_torch_save(model_dir, buffer)
    state = torch.load(buffer, weights_only=True)
    buffer.unlink()
    flat = state.get("model", state)
    return {k: v for k, v in flat.items() if "lora_" in k}


def _published_adapter(path: Path) -> dict[str, Any]:
    from safetensors.torch import load

    return load((path / "adapter_model.safetensors").read_bytes())


def _same_tensors(published: dict[str, Any], trained: dict[str, Any]) -> None:
    """PEFT drops the adapter name from saved keys (``lora_A.default.weight`` -> ``lora_A.weight``)
    and prefixes ``base_model.model.``; match on the module path and the A/B role."""
    import torch

    def key(name: str) -> str:
        name = name.replace(".default.", ".").replace("_fsdp_wrapped_module.", "")
        return name[name.index("layers.") :]

    trained_by_key = {key(k): v for k, v in trained.items()}
    assert len(trained_by_key) == len(published) > 0, (sorted(trained_by_key), sorted(published))
    for name, tensor in published.items():
        other = trained_by_key[key(name)]
        assert tensor.shape == other.shape, (name, tensor.shape, other.shape)
        assert torch.equal(tensor, other.to(tensor.dtype)), f"{name}: published != trained"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory) as made:
        yield made


@pytest.fixture(scope="module")
def first_run(stack: Stack) -> TrainRun:
    return _launch(stack, FIRST_STEPS, "fsdp1")


def test_fsdp2_two_processes_sync_adapters_once_per_step(
    stack: Stack,
    first_run: TrainRun,
) -> None:
    log = first_run.log
    assert first_run.returncode == 0, log[-8000:]
    assert "2 process(es) x 8 sample(s)" in log, log[-4000:]
    # FSDP really wrapped the model (accelerate's CPU fallback would be plain data parallel, with
    # a full-state checkpoint): the checkpoint is FSDP's sharded one.
    assert (stack.out / f"checkpoint-{FIRST_STEPS}" / "pytorch_model_fsdp_0").is_dir()
    # The same checks as one process: adapter-only sync, identical control sequences on both
    # replicas (each call once: rank 1 sends none), ratio within 1e-3 of 1 on every step,
    # atomically published, same bytes everywhere.
    _check_run(stack, first_run, list(range(1, FIRST_STEPS + 2)), range(1, FIRST_STEPS + 1))
    for records in first_run.records:
        counts = Counter(path for path, _, _ in _control(records))
        syncs = FIRST_STEPS + 1
        assert counts["/pause"] == counts["/resume"] == counts["/v1/load_lora_adapter"] == syncs
    # The final adapter (a collective save too) is the last published policy.
    shas = {e["body"]["lora_name"]: e["sha256"] for e in _loads(first_run.records[0])}
    final = (stack.out / "final-adapter" / "adapter_model.safetensors").read_bytes()
    assert hashlib.sha256(final).hexdigest() == shas[f"trl-policy-v{FIRST_STEPS + 1}"]
    assert shas["trl-policy-v1"] != shas[f"trl-policy-v{FIRST_STEPS + 1}"], (
        "the adapter never moved"
    )


def test_fsdp2_checkpoint_is_sharded_and_holds_the_published_adapter(
    stack: Stack,
    first_run: TrainRun,
) -> None:
    assert first_run.returncode == 0
    checkpoint = stack.out / f"checkpoint-{FIRST_STEPS}"
    shards = sorted(p.name for p in checkpoint.rglob("*.distcp"))
    assert len(shards) >= PROCESSES, f"not a sharded checkpoint: {sorted(checkpoint.rglob('*'))}"
    trained = _sharded_adapter(checkpoint)
    # The last checkpoint is saved after its step's sync, which published the next version from
    # the same weights: every element of every adapter tensor, both ranks' halves, must be what
    # the replicas were given.
    published = _published_adapter(stack.out / "final-adapter")
    _same_tensors(published, trained)
    assert any(float(t.abs().sum()) > 0 for k, t in trained.items() if "lora_B" in k)


def test_fsdp2_sharded_checkpoint_resumes_with_continuing_versions(
    stack: Stack,
    first_run: TrainRun,
) -> None:
    assert first_run.returncode == 0
    resumed = _launch(stack, RESUMED_STEPS, "fsdp2")
    assert resumed.returncode == 0, resumed.log[-8000:]
    first_new = FIRST_STEPS + 2
    assert f"adapters continue at trl-policy-v{first_new}" in resumed.log
    _check_run(
        stack,
        resumed,
        list(range(first_new, first_new + RESUMED_STEPS - FIRST_STEPS + 1)),
        range(FIRST_STEPS + 1, RESUMED_STEPS + 1),
    )
    # The first adapter after the resume is the last checkpoint's policy, byte for byte: both ranks'
    # shards came back from the sharded checkpoint.
    before = {e["body"]["lora_name"]: e["sha256"] for e in _loads(first_run.records[0])}
    after = {e["body"]["lora_name"]: e["sha256"] for e in _loads(resumed.records[0])}
    assert after[f"trl-policy-v{first_new}"] == before[f"trl-policy-v{FIRST_STEPS + 1}"]
