"""Recipe -> TRL ``AsyncGRPOTrainer`` -> ``train()``, with preflight, resume and a final adapter.

Verified against TRL 1.16.0 (``trl/experimental/async_grpo``), transformers 5.24, PEFT 0.21,
accelerate 1.15 (pinned in the ``trainer`` extra). Facts this module relies on, read from TRL:

- Adapter-only sync is chosen by TRL itself from ``/server_info`` (``select_adapter_sync``); each
  sync saves ``<output_dir>/.vllm_lora/.trl-policy-vN.tmp``, renames it to ``trl-policy-vN``, loads
  it on the server under that name, resumes, unloads ``v(N - max_staleness - 1)``.
- Versions continue across a resume: TRL 1.16 writes ``model_version`` into each checkpoint's
  ``rollout_state.json`` and restores it, so the first sync after a resume publishes
  ``v(model_version + 1)``. A checkpoint without the field (older TRL) restarts at v1, which is
  only safe after the stale-adapter sweep (or the preflight's collision check, sweep disabled).
- The merged-weight fallback (NCCL) cannot work through a proxy of N replicas, so a run where TRL
  did not pick adapter-only sync is stopped before training.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, LoadedConfig, describe
from trainer.preflight import Requirements, ServerFacts, run_preflight
from trainer.recipe import Recipe

logger = logging.getLogger("trainer")

ROLLOUT_STATE = "rollout_state.json"
TRAINER_STATE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"
FINAL_ADAPTER = "final-adapter"
LORA_NAME = "trl-policy"  # TRL's fixed adapter name prefix

# Response template for ChatML chat templates TRL does not recognize (Qwen2.5-Math's among them):
# the assistant turn opens with `<|im_start|>assistant\n` and its text runs to `<|im_end|>` or to
# the end of a truncated completion.
CHATML_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*|$", "content": "text"}},
}


def setup_logging() -> None:
    """INFO for this package and TRL (sync timings, stale-sample drops) on stderr; other
    libraries stay at WARNING. A root handler is added only if none exists (an embedding
    application's or pytest's logging is left alone)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    for name in ("trainer", "trl"):
        logging.getLogger(name).setLevel(logging.INFO)


def ensure_response_template(tokenizer: Any) -> str:
    """Give the tokenizer a response parser TRL's rollout worker can use; return which one.

    TRL's worker calls ``add_response_schema`` itself when none is set, and that raises
    "Unrecognized chat template" inside its spawned process for templates it does not know
    (Qwen2.5-Math's ChatML with a math system prompt). Setting it here fails early instead.
    """
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return "tokenizer"
    from trl.chat_template_utils import add_response_schema

    try:
        add_response_schema(tokenizer)
        return "trl"
    except ValueError:
        pass
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True
    )
    if isinstance(rendered, str) and rendered.endswith(CHATML_RESPONSE_TEMPLATE["start_anchor"]):
        tokenizer.response_template = CHATML_RESPONSE_TEMPLATE
        return "chatml"
    raise ConfigError(
        "the model's chat template is neither one TRL recognizes nor ChatML, so completions cannot "
        "be parsed; set `response_template` on the tokenizer (transformers response parsing docs)"
    )


def _checkpoint_step(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _newest_complete_checkpoint(output_dir: Path) -> Path | None:
    candidates = sorted(
        (p for p in output_dir.glob("checkpoint-*") if p.is_dir() and _checkpoint_step(p) >= 0),
        key=_checkpoint_step,
        reverse=True,
    )
    for candidate in candidates:
        if (candidate / TRAINER_STATE).is_file():
            return candidate
        logger.warning("skipping incomplete checkpoint %s (no %s)", candidate, TRAINER_STATE)
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint (None = fresh), the first adapter version it publishes."""

    checkpoint: str | None
    first_version: int


def resolve_checkpoint(recipe: Recipe) -> ResumePoint:
    """The checkpoint to resume from, per ``recipe.resume``, and the version TRL will publish next.

    ``auto`` takes the newest *complete* checkpoint in ``output_dir``: transformers writes
    ``trainer_state.json`` last, so a checkpoint without it was cut short by a preemption and is
    skipped (with a warning) rather than resumed from.
    """
    if recipe.resume == "never":
        return ResumePoint(None, 1)
    if recipe.resume == "auto":
        found = _newest_complete_checkpoint(Path(recipe.output_dir))
        if found is None:
            return ResumePoint(None, 1)
        chosen = found
    else:
        chosen = Path(recipe.resume)
        if not (chosen / TRAINER_STATE).is_file():
            raise ConfigError(
                f"resume={recipe.resume}: not a complete checkpoint (no {TRAINER_STATE})"
            )
    state_file = chosen / ROLLOUT_STATE
    version = (
        json.loads(state_file.read_text()).get("model_version") if state_file.is_file() else None
    )
    if version is None:
        # Older TRL: numbering restarts at v1, which the preflight's sweep (or its collision check)
        # makes safe against replicas still holding that name.
        logger.warning(
            "%s records no adapter version: numbering restarts at %s-v1", chosen, LORA_NAME
        )
        return ResumePoint(str(chosen), 1)
    logger.info(
        "resuming from %s: adapters continue at %s-v%d", chosen, LORA_NAME, int(version) + 1
    )
    return ResumePoint(str(chosen), int(version) + 1)


def _metrics_callback(path: Path) -> Any:
    from transformers import TrainerCallback

    class MetricsFile(TrainerCallback):  # type: ignore[misc]  # transformers is not analysed (pyproject)
        """Append every logged metrics dict as one JSON line (rank 0): the run's machine-readable
        record, independent of any reporting integration."""

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if not state.is_world_process_zero or not logs:
                return
            record = {"step": state.global_step}
            for key, value in logs.items():
                if isinstance(value, float) and not math.isfinite(value):
                    value = None
                record[key] = value
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    return MetricsFile()


def _requirements(recipe: Recipe, first_version: int) -> Requirements:
    return Requirements(
        base_model=recipe.model,
        lora_rank=recipe.lora_r,
        min_adapter_slots=recipe.min_adapter_slots,
        max_completion_length=recipe.max_completion_length,
        allow_base_model_mismatch=recipe.allow_base_model_mismatch,
        first_version=first_version,
    )


def launched_processes() -> int:
    """How many processes the launcher (torchrun, ``accelerate launch``) started: WORLD_SIZE."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_world(num_processes: int, launched: int) -> None:
    """Refuse to train when the launcher started more processes than joined one run: each
    would be a trainer of its own against the same proxy and output directory."""
    if launched > 1 and num_processes != launched:
        raise ConfigError(
            f"launched as {launched} processes (WORLD_SIZE) but accelerate set up a run of "
            f"{num_processes}: every process would train alone, each publishing its own adapters. "
            "Check the accelerate config (distributed_type, use_cpu) for this machine"
        )


def run(loaded: LoadedConfig) -> None:
    """Train per ``loaded.recipe``. Raises ``ConfigError``/``PreflightError``/``DataError`` for
    problems the user can fix; anything else is a bug or an infrastructure failure."""
    recipe = loaded.recipe
    setup_logging()

    import torch
    from accelerate import PartialState  # type: ignore[import-untyped]
    from accelerate.utils import broadcast_object_list  # type: ignore[import-untyped]

    # A CPU-only host must say so to accelerate: without `cpu=True`, a process started by
    # `accelerate launch --num_processes N` (torchrun) finds no GPU backend and falls back to
    # "not distributed", so every rank trains alone as a world of one - N preflights, N sweeps,
    # N identical adapter loads (the second a 400) - instead of one run over gloo.
    cpu = not torch.accelerator.is_available()
    state = PartialState(cpu=cpu)
    check_world(state.num_processes, launched_processes())
    if not state.is_main_process:
        logger.setLevel(logging.WARNING)  # one copy of the run log, from rank 0
    grad_accum = recipe.effective_gradient_accumulation(state.num_processes)
    if state.is_main_process:
        logger.info("configuration (value, source):\n%s", describe(loaded))
        logger.info(
            "%d process(es) x %d sample(s) x %d accumulation step(s) = %s completions per step",
            state.num_processes,
            recipe.per_device_train_batch_size,
            grad_accum,
            "variable (token budget)" if recipe.token_budget else recipe.completions_per_step,
        )

    resume = resolve_checkpoint(recipe)

    # Preflight on the main process only (one set of HTTP calls, one sweep); its outcome is shared
    # so every rank filters prompts the same way. A failure is raised on every rank, so no rank is
    # left waiting in a collective the main process never joins.
    outcome: list[Any] = [None]
    if state.is_main_process and recipe.preflight:
        try:
            outcome[0] = run_preflight(
                recipe.vllm_server_base_url,
                _requirements(recipe, resume.first_version),
                health_timeout_s=recipe.vllm_server_timeout,
                sweep_stale=recipe.sweep_stale_adapters,
            )
        except Exception as exc:
            outcome[0] = exc
    if state.num_processes > 1:
        outcome = broadcast_object_list(outcome, from_process=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    facts: ServerFacts | None = outcome[0]

    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, save_lora_adapter

    from trainer.data import drop_long_prompts, load_prompts
    from trainer.rewards import boxed_math_reward

    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    parser_kind = ensure_response_template(tokenizer)
    logger.info("completion parser: %s", parser_kind)
    dataset = load_prompts(
        recipe.dataset,
        split=recipe.dataset_split,
        prompt_column=recipe.prompt_column,
        answer_column=recipe.answer_column,
        limit=recipe.dataset_limit,
        shuffle_seed=recipe.seed if recipe.shuffle else None,
    )
    if facts is not None:
        dataset = drop_long_prompts(
            dataset, tokenizer, facts.max_model_len - recipe.max_completion_length
        )
    logger.info("training prompts: %d", len(dataset))

    cuda = torch.cuda.is_available()
    args = AsyncGRPOConfig(
        output_dir=recipe.output_dir,
        # transformers rebuilds accelerate's state from these arguments: without it, the
        # multi-process CPU state set up above would be replaced by a non-distributed one.
        use_cpu=cpu,
        seed=recipe.seed,
        bf16=recipe.use_bf16(cuda),
        dtype=recipe.dtype,
        gradient_checkpointing=recipe.gradient_checkpointing,
        learning_rate=recipe.learning_rate,
        adam_beta2=recipe.adam_beta2,
        weight_decay=recipe.weight_decay,
        max_grad_norm=recipe.max_grad_norm,
        lr_scheduler_type=recipe.lr_scheduler_type,
        max_steps=recipe.max_steps,
        per_device_train_batch_size=recipe.per_device_train_batch_size,
        gradient_accumulation_steps=grad_accum,
        token_budget=recipe.token_budget,
        num_generations=recipe.num_generations,
        max_completion_length=recipe.max_completion_length,
        temperature=recipe.temperature,
        top_p=recipe.top_p,
        top_k=recipe.top_k,
        max_staleness=recipe.max_staleness,
        weight_sync_steps=recipe.weight_sync_steps,
        max_inflight_tasks=recipe.max_inflight_tasks,
        queue_maxsize=recipe.effective_queue_maxsize(),
        request_timeout=recipe.request_timeout,
        vllm_server_base_url=recipe.vllm_server_base_url,
        vllm_server_timeout=recipe.vllm_server_timeout,
        save_strategy="steps",
        save_steps=recipe.save_steps,
        save_total_limit=recipe.save_total_limit,
        logging_steps=recipe.logging_steps,
        report_to=[r.strip() for r in recipe.report_to.split(",") if r.strip()] or "none",
        run_name=recipe.run_name,
        log_completions=recipe.log_completions,
    )
    peft_config = LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=recipe.target_modules,
        init_lora_weights=recipe.lora_init_weights,
        bias="none",
        task_type="CAUSAL_LM",
    )
    trainer = AsyncGRPOTrainer(
        model=recipe.model,
        reward_funcs=boxed_math_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[_metrics_callback(Path(recipe.output_dir) / METRICS_FILE)],
    )
    # `_lora_sync` is TRL's own decision (pinned 1.16.0). False means merged-weight sync over NCCL,
    # which a proxy of N replicas cannot take: stop now rather than hang in the first sync.
    if not getattr(trainer, "_lora_sync", False):
        raise ConfigError(
            "TRL did not select adapter-only sync (see its warning above): the proxy cannot relay "
            "merged-weight NCCL sync to several replicas. Check the replicas' --enable-lora and "
            "the LoRA settings (no DoRA, no modules_to_save, rank <= --max-lora-rank)"
        )
    if state.is_main_process:
        Path(recipe.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(recipe.output_dir) / "rollout_train_config.json").write_text(
            json.dumps(recipe.model_dump(), indent=2) + "\n"
        )
    trainer.train(resume_from_checkpoint=resume.checkpoint)
    logger.info("training done at step %d", trainer.state.global_step)

    if recipe.save_final_adapter:
        # Kept outside `.vllm_lora/`, whose versions TRL deletes as they leave the staleness
        # window. Every rank calls this: gathering a sharded adapter parameter is a collective.
        model = trainer.accelerator.unwrap_model(trainer.model)
        final = os.path.join(recipe.output_dir, FINAL_ADAPTER)
        save_lora_adapter(model, trainer.accelerator, model.active_adapters[0], final)
        if state.is_main_process:
            logger.info("final adapter written to %s", final)
