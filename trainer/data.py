"""Training prompts: the recipe's dataset from the Hub or a local parquet/jsonl file.

Every source ends up as a ``datasets.Dataset`` with exactly two columns, the shape TRL's rollout
worker and ``trainer.rewards.boxed_math_reward`` expect:

- ``prompt``: a list of chat messages (``{"role", "content"}``); a plain string becomes one user
  turn.
- ``solution``: the gold answer as a string, read from ``answer_column`` - a top-level column or a
  dotted path into a struct column (the recipe's ``reward_model.ground_truth``).

A source that does not fit fails here, naming the missing column and listing the ones present,
instead of as a ``KeyError`` inside TRL's spawned rollout process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset  # type: ignore[import-untyped]

logger = logging.getLogger(__name__)

PROMPT = "prompt"
SOLUTION = "solution"

# Local file formats, by suffix, and the `datasets` builder that reads each.
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


class DataError(ValueError):
    """The dataset cannot be used as configured; the message says what to change."""


def _read(source: str, split: str) -> Dataset:
    from datasets import Dataset, load_dataset

    path = Path(source)
    if path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"{source}: unsupported file type {path.suffix!r}; use one of {sorted(_BUILDERS)}"
            )
        # A local file has a single implicit split, which `datasets` names "train".
        ds = load_dataset(builder, data_files=str(path), split="train")
    elif path.is_dir():
        ds = load_dataset(str(path), split=split)
    elif source.startswith((".", "/", "~")) or source.endswith(tuple(_BUILDERS)):
        raise DataError(f"dataset file {source} does not exist")
    else:
        ds = load_dataset(source, split=split)
    if not isinstance(ds, Dataset):
        raise DataError(
            f"{source}: expected a map-style dataset for split {split!r}, got {type(ds)}"
        )
    return ds


def _getter(answer_column: str, columns: Sequence[str], source: str) -> Callable[[Any], Any]:
    """A reader of ``answer_column`` (possibly dotted) for one row, checked against the schema."""
    head, *rest = answer_column.split(".")
    if head not in columns:
        raise DataError(
            f"{source}: answer column {head!r} (from answer_column={answer_column!r}) not found; "
            f"columns present: {sorted(columns)}"
        )

    def get(row: Mapping[str, Any]) -> Any:
        value: Any = row[head]
        for i, key in enumerate(rest):
            if not isinstance(value, Mapping) or key not in value:
                where = ".".join([head, *rest[:i]])
                present = sorted(value) if isinstance(value, Mapping) else type(value).__name__
                raise DataError(
                    f"{source}: answer field {key!r} not found under {where!r} "
                    f"(answer_column={answer_column!r}); it holds {present}"
                )
            value = value[key]
        return value

    return get


def to_messages(prompt: Any, source: str = "dataset") -> list[dict[str, str]]:
    """A prompt cell as chat messages: a string is one user turn; a message list is checked."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt:
        messages = []
        for message in prompt:
            if (
                not isinstance(message, Mapping)
                or "role" not in message
                or "content" not in message
            ):
                raise DataError(
                    f"{source}: prompt messages need 'role' and 'content' keys, got {message!r}"
                )
            messages.append({"role": str(message["role"]), "content": str(message["content"])})
        return messages
    raise DataError(
        f"{source}: a prompt must be a string or a non-empty list of messages, got {prompt!r}"
    )


def load_prompts(
    source: str,
    *,
    split: str = "train",
    prompt_column: str = "prompt",
    answer_column: str = "reward_model.ground_truth",
    limit: int | None = None,
    shuffle_seed: int | None = None,
) -> Dataset:
    """Read ``source`` and return the ``prompt``/``solution`` dataset described in the module doc.

    Rows whose gold answer is missing or empty are dropped with a warning (they can only score 0.0
    and would dilute every group they are in); a source with no usable row is an error.
    ``shuffle_seed`` shuffles deterministically, so a resumed run sees the same order and TRL's
    saved prompt index still points at the right prompt.
    """
    ds = _read(source, split)
    columns = list(ds.column_names)
    if prompt_column not in columns:
        raise DataError(
            f"{source}: prompt column {prompt_column!r} not found; "
            f"columns present: {sorted(columns)}"
        )
    get_answer = _getter(answer_column, columns, source)

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        gold = get_answer(row)
        return {
            PROMPT: to_messages(row[prompt_column], source),
            SOLUTION: "" if gold is None else str(gold).strip(),
        }

    # The source's own `prompt` column is replaced, every other column removed: TRL forwards all
    # remaining columns to the reward function and pickles them into its rollout process.
    out = ds.map(convert, remove_columns=columns, keep_in_memory=True, desc="prompts")
    before = len(out)
    out = out.filter(
        lambda row: bool(row[SOLUTION]), keep_in_memory=True, desc="drop rows without a gold answer"
    )
    if len(out) < before:
        logger.warning(
            "%s: dropped %d of %d rows without a gold answer", source, before - len(out), before
        )
    if len(out) == 0:
        raise DataError(f"{source}: no row has both a prompt and a gold answer")
    if shuffle_seed is not None:
        out = out.shuffle(seed=shuffle_seed, keep_in_memory=True).flatten_indices(
            keep_in_memory=True
        )
    if limit is not None:
        out = out.select(range(min(limit, len(out))))
    return out


def drop_long_prompts(dataset: Dataset, tokenizer: Any, max_prompt_tokens: int) -> Dataset:
    """Remove prompts whose rendered chat template exceeds ``max_prompt_tokens`` tokens.

    vLLM rejects a request whose prompt plus ``max_tokens`` exceeds its ``--max-model-len`` with a
    400, which TRL's rollout worker retries for minutes before failing the run; dropping the few
    over-long prompts up front turns that into one warning.
    """

    def fits(row: dict[str, Any]) -> bool:
        ids = tokenizer.apply_chat_template(
            row[PROMPT], add_generation_prompt=True, return_dict=False
        )
        return len(ids) <= max_prompt_tokens

    before = len(dataset)
    kept = dataset.filter(fits, keep_in_memory=True, desc="drop over-long prompts")
    if len(kept) < before:
        logger.warning(
            "dropped %d of %d prompts longer than %d tokens (server max_model_len minus "
            "max_completion_length)",
            before - len(kept),
            before,
            max_prompt_tokens,
        )
    if len(kept) == 0:
        raise DataError(
            f"every prompt is longer than {max_prompt_tokens} tokens; raise the server's "
            "--max-model-len or lower max_completion_length"
        )
    return kept
