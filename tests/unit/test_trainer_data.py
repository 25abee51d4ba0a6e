"""Loading the recipe's prompts from local files, and the errors a misfit file gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.data import DataError, drop_long_prompts, load_prompts, to_messages

# The shape of sail/Sanity-Test-R1D-1.5B (verl format): chat prompt, gold under reward_model.
ROWS: list[dict[str, Any]] = [
    {
        "data_source": "math",
        "prompt": [
            {"role": "user", "content": f"What is {i} + {i}? Put the answer in \\boxed{{}}."}
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"index": i},
    }
    for i in range(10)
]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_in_the_recipe_format(tmp_path: Path) -> None:
    ds = load_prompts(str(_jsonl(tmp_path / "d.jsonl", ROWS)), shuffle_seed=None)
    assert ds.column_names == ["prompt", "solution"]
    assert len(ds) == 10
    assert ds[3] == {"prompt": ROWS[3]["prompt"], "solution": "6"}


def test_parquet_and_top_level_answer_column(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["1+1?", "2+2?"], "answer": [2, 4]}).to_parquet(path)
    ds = load_prompts(str(path), prompt_column="question", answer_column="answer")
    assert sorted(ds["solution"]) == ["2", "4"]
    assert ds[0]["prompt"][0]["role"] == "user"  # a plain-string prompt becomes one user turn


def test_shuffle_is_deterministic_and_limit_applies_after(tmp_path: Path) -> None:
    path = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    a = load_prompts(path, shuffle_seed=42, limit=4)
    b = load_prompts(path, shuffle_seed=42, limit=4)
    assert len(a) == 4
    assert a["solution"] == b["solution"]
    assert load_prompts(path, shuffle_seed=None)["solution"] == [
        r["reward_model"]["ground_truth"] for r in ROWS
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"prompt_column": "question"},
            "prompt column 'question' not found; columns present: \\['ability'",
        ),
        (
            {"answer_column": "solution"},
            "answer column 'solution' \\(from answer_column='solution'\\) not found",
        ),
        (
            {"answer_column": "reward_model.answer"},
            "answer field 'answer' not found under 'reward_model'",
        ),
        (
            {"answer_column": "data_source.x"},
            "answer field 'x' not found under 'data_source'.*it holds str",
        ),
    ],
)
def test_missing_columns_are_named(tmp_path: Path, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(DataError, match=message):
        load_prompts(str(_jsonl(tmp_path / "d.jsonl", ROWS)), **kwargs)


def test_rows_without_gold_are_dropped_and_none_left_is_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        dict(r, reward_model={"ground_truth": "" if i % 2 else r["reward_model"]["ground_truth"]})
        for i, r in enumerate(ROWS)
    ]
    with caplog.at_level("WARNING", logger="trainer.data"):
        ds = load_prompts(str(_jsonl(tmp_path / "d.jsonl", rows)))
    assert len(ds) == 5
    assert "dropped 5 of 10 rows without a gold answer" in caplog.text
    empty = [dict(r, reward_model={"ground_truth": None}) for r in ROWS]
    with pytest.raises(DataError, match="no row has both a prompt and a gold answer"):
        load_prompts(str(_jsonl(tmp_path / "e.jsonl", empty)))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("missing.jsonl", "dataset file .* does not exist"),
        ("data.txt", "unsupported file type '.txt'"),
    ],
)
def test_bad_sources(tmp_path: Path, source: str, message: str) -> None:
    if source.endswith(".txt"):
        (tmp_path / source).write_text("x")
    with pytest.raises(DataError, match=message):
        load_prompts(str(tmp_path / source))


@pytest.mark.parametrize(
    ("prompt", "ok"),
    [
        ("hello", True),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], True),
        ([{"content": "no role"}], False),
        ([], False),
        (7, False),
    ],
)
def test_prompt_shapes(prompt: Any, ok: bool) -> None:
    if ok:
        assert to_messages(prompt)[-1]["content"] in ("hello", "u")
    else:
        with pytest.raises(DataError, match="prompt"):
            to_messages(prompt)


class _CharTokenizer:
    """One token per character of the rendered conversation."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        return [0] * sum(len(m["content"]) for m in messages)


def test_over_long_prompts_are_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = [dict(ROWS[0], prompt="x" * n) for n in (5, 50, 500)]
    ds = load_prompts(str(_jsonl(tmp_path / "d.jsonl", rows)), shuffle_seed=None)
    with caplog.at_level("WARNING", logger="trainer.data"):
        kept = drop_long_prompts(ds, _CharTokenizer(), 100)
    assert [len(p[0]["content"]) for p in kept["prompt"]] == [5, 50]
    assert "dropped 1 of 3 prompts longer than 100 tokens" in caplog.text
    with pytest.raises(DataError, match="every prompt is longer than 4 tokens"):
        drop_long_prompts(ds, _CharTokenizer(), 4)
