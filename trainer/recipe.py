"""The published recipe as one validated settings object; every default is the recipe's value.

Source of the recipe (REFERENCE.md section 4, and the Precision-RL LoRA script it was taken from,
``oat/scripts/lora/bf16_grpo_tis_lora.sh``): Qwen/Qwen2.5-Math-1.5B, ``sail/Sanity-Test-R1D-1.5B``,
LoRA r=1 alpha=2 on all linear layers, lr 4e-5 constant, 8 samples per prompt, 128 completions per
optimizer step (one sample per micro-batch, as the reference ran it), up to 3,000 generated tokens
in a 4,096-token context, max_staleness 4 with an adapter published every 4 steps, 500 steps.

How values arrive is ``trainer.config``'s job (flag > env ``TRAIN_*`` > config file > default).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Ranks vLLM builds stacked LoRA buffers for (`--max-lora-rank` must be one of them).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Recipe(BaseModel):
    """Every knob of ``rollout-train``. Field descriptions double as ``--help`` text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- model and adapter -------------------------------------------------------------------
    model: str = Field(
        "Qwen/Qwen2.5-Math-1.5B",
        description="Base model (Hub id or local directory); every replica must serve it.",
    )
    lora_r: int = Field(1, ge=1, description="LoRA rank (recipe: rank-1 suffices for RL).")
    lora_alpha: int = Field(2, ge=1, description="LoRA alpha; the recipe keeps alpha = 2 x rank.")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout (recipe: none).")
    lora_target_modules: str = Field(
        "all-linear",
        description="'all-linear' or a comma-separated list of module names. lm_head and "
        "embeddings are not servable as vLLM adapters and TRL refuses them.",
    )
    lora_init_weights: bool = Field(
        True,
        description="PEFT's init_lora_weights: true = B starts at zero (the adapter starts as the "
        "base model, the recipe); false = random A and B, so the served policy differs from "
        "the base from the first sync (tests use it to make a wrong served policy visible).",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="dtype the trainer loads weights in. float32 master weights (TRL's default): "
        "the importance ratio is measured against it.",
    )
    bf16: Literal["auto"] | bool = Field(
        "auto",
        description="bf16 autocast for training: 'auto' = on when CUDA is available (GPU path), "
        "off on CPU, where bf16 matmuls are slow and would not match an fp32 test server.",
    )
    gradient_checkpointing: bool = Field(
        True,
        description="Recompute activations in the backward (TRL's default, low memory). The "
        "reference's fastest run turned it off on H200s: about one forward less per step.",
    )

    # --- data --------------------------------------------------------------------------------
    dataset: str = Field(
        "sail/Sanity-Test-R1D-1.5B",
        description="Hub dataset id, or a local .parquet/.jsonl/.json/.csv file or directory.",
    )
    dataset_split: str = Field("train", description="Split to read from a Hub dataset.")
    prompt_column: str = Field(
        "prompt", description="Column holding the chat-format prompt (or a plain string)."
    )
    answer_column: str = Field(
        "reward_model.ground_truth",
        description="Column holding the gold answer; a dotted path reads into a struct column.",
    )
    dataset_limit: int | None = Field(
        None, ge=1, description="Use only the first N prompts (after shuffling); for smoke runs."
    )
    shuffle: bool = Field(
        True,
        description="Shuffle prompts once, seeded by `seed`, so a resumed run sees the same order.",
    )

    # --- generation --------------------------------------------------------------------------
    num_generations: int = Field(8, ge=2, description="Samples per prompt (the GRPO group size).")
    completions_per_step: int = Field(
        128,
        ge=1,
        description="Completions per optimizer step when token_budget = 0; gradient accumulation "
        "is derived from it (128 / (per_device_train_batch_size x processes)).",
    )
    max_completion_length: int = Field(3000, ge=1, description="Max generated tokens per sample.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")

    # --- optimization ------------------------------------------------------------------------
    learning_rate: float = Field(4e-5, gt=0.0, description="AdamW learning rate (constant).")
    adam_beta2: float = Field(
        0.95, gt=0.0, lt=1.0, description="AdamW beta2; oat's default, which the recipe ran with."
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (recipe: none).")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    lr_scheduler_type: str = Field("constant", description="transformers scheduler name.")
    max_steps: int = Field(500, ge=1, description="Optimizer steps (the recipe's 500).")
    per_device_train_batch_size: int = Field(
        1,
        ge=1,
        description="Samples per micro-batch per process when token_budget = 0 (reference: 1).",
    )
    gradient_accumulation_steps: int | None = Field(
        None,
        ge=1,
        description="Micro-batches per optimizer step. Unset: derived from completions_per_step "
        "(fixed-count batching); required with token_budget > 0.",
    )
    token_budget: int = Field(
        0,
        ge=0,
        description="0 = fixed-count micro-batches (the recipe's exact 128 completions/step); "
        "> 0 = pack rows to this many tokens (faster; samples per step become variable).",
    )
    seed: int = Field(42, description="Seed for the adapter init, shuffling and TRL.")

    # --- async pipeline ----------------------------------------------------------------------
    max_staleness: int = Field(
        4,
        ge=0,
        description="Policy versions a sample may lag before it is dropped. The replicas need "
        "--max-loras >= max_staleness + 2.",
    )
    weight_sync_steps: int = Field(
        4, ge=1, description="Optimizer steps between adapter publications (recipe: 4)."
    )
    max_inflight_tasks: int = Field(
        128,
        ge=1,
        description="Concurrent rollout requests. The reference ran 128 (one step's completions); "
        "raise it (e.g. 384) when replicas are idle.",
    )
    queue_maxsize: int | None = Field(
        None,
        ge=1,
        description="Buffered scored samples. Unset: max_staleness x completions_per_step, the "
        "staleness window - a deeper queue only holds samples that go stale before use.",
    )
    request_timeout: int = Field(
        600, ge=1, description="Seconds per rollout request (TRL default)."
    )
    vllm_server_timeout: float = Field(
        240.0, gt=0.0, description="Seconds to wait for the proxy to report healthy (TRL default)."
    )

    # --- server / preflight ------------------------------------------------------------------
    vllm_server_base_url: str = Field(
        "http://127.0.0.1:8000", description="The rollout proxy's URL (TRL sees it as one vLLM)."
    )
    preflight: bool = Field(
        True, description="Check the proxy and its replicas before loading the model."
    )
    sweep_stale_adapters: bool = Field(
        True,
        description="Unload trl-policy-* adapters an earlier run left on the replicas (a reused "
        "name is answered 400, fatal to TRL). Assumes one trainer per proxy.",
    )
    allow_base_model_mismatch: bool = Field(
        False,
        description="Proceed when the served base model's name differs from `model` (e.g. a "
        "local copy served under another name). Off: a mismatch stops the run.",
    )

    # --- output and resume -------------------------------------------------------------------
    output_dir: str = Field(
        "/lora/rollout-train",
        description="Checkpoints, published adapters (.vllm_lora/) and metrics. Must resolve to "
        "the same path on every replica (the shared bucket mount).",
    )
    save_steps: int = Field(
        50,
        ge=1,
        description="Checkpoint every N steps (the reference's 50). Each holds the adapter and its "
        "AdamW state: ~14 MB for r=1 on the 1.5B model (1.15 M adapter parameters, fp32).",
    )
    save_total_limit: int | None = Field(
        None,
        ge=1,
        description="Keep only the newest N checkpoints (unset: keep all, ~140 MB per 500 steps).",
    )
    resume: str = Field(
        "auto",
        description="'auto' = continue from the newest checkpoint in output_dir if any; 'never'; "
        "or a checkpoint directory.",
    )
    save_final_adapter: bool = Field(
        True, description="Write the trained adapter to <output_dir>/final-adapter at the end."
    )

    # --- logging -----------------------------------------------------------------------------
    logging_steps: int = Field(1, ge=1, description="Log every N steps.")
    report_to: str = Field(
        "none", description="Comma-separated transformers integrations (e.g. 'trackio,wandb')."
    )
    run_name: str | None = Field(None, description="Run name for the reporting integrations.")
    log_completions: bool = Field(False, description="Print sample completions as they are scored.")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.token_budget > 0 and self.gradient_accumulation_steps is None:
            raise ValueError(
                "token_budget > 0 packs a variable number of samples per micro-batch, so "
                "completions_per_step cannot set the accumulation: set gradient_accumulation_steps"
            )
        if self.resume not in ("auto", "never") and not self.resume.strip():
            raise ValueError("resume must be 'auto', 'never' or a checkpoint directory")
        targets = [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]
        if not targets:
            raise ValueError("lora_target_modules is empty")
        if any(t in ("lm_head", "embed_tokens") for t in targets):
            raise ValueError(
                "lora_target_modules must not include lm_head or embed_tokens: vLLM cannot serve "
                "them as an adapter and TRL would fall back to full merged-weight sync"
            )
        if self.lora_r > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"lora_r={self.lora_r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
            )
        return self

    # --- derived values ----------------------------------------------------------------------
    @property
    def min_adapter_slots(self) -> int:
        """``--max-loras`` the replicas need: in-flight samples may name max_staleness + 1
        versions, and each sync loads the next one before unloading the oldest."""
        return self.max_staleness + 2

    @property
    def target_modules(self) -> str | list[str]:
        """PEFT's ``target_modules``: the ``all-linear`` shorthand, or the explicit list."""
        if self.lora_target_modules.strip() == "all-linear":
            return "all-linear"
        return [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]

    def effective_queue_maxsize(self) -> int:
        return self.queue_maxsize or max(self.max_staleness, 1) * self.completions_per_step

    def effective_gradient_accumulation(self, num_processes: int) -> int:
        """Micro-batches per optimizer step for ``num_processes`` data-parallel ranks."""
        if self.gradient_accumulation_steps is not None:
            return self.gradient_accumulation_steps
        per_micro = self.per_device_train_batch_size * num_processes
        if self.completions_per_step % per_micro:
            raise ValueError(
                f"completions_per_step={self.completions_per_step} is not a multiple of "
                f"per_device_train_batch_size x processes = {self.per_device_train_batch_size} x "
                f"{num_processes}; adjust one of them or set gradient_accumulation_steps"
            )
        return self.completions_per_step // per_micro

    def use_bf16(self, cuda_available: bool) -> bool:
        return cuda_available if self.bf16 == "auto" else bool(self.bf16)
