"""The recipe's reward: last \\boxed{} answer vs gold, decided by math-verify."""

from __future__ import annotations

import pickle
import threading

import pytest

from trainer.rewards import (
    MAX_ANSWER_CHARS,
    boxed_math_reward,
    completion_text,
    is_equivalent,
    last_boxed,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{5}.", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1}, then corrected: \\boxed{2}", "2"),
        ("\\boxed{\\left(1, \\{2\\}\\right)}", "\\left(1, \\{2\\}\\right)"),
        ("\\fbox{7}", "7"),
        ("\\boxed {8}", "8"),
        ("\\boxed 9.", "9"),
        ("no box here", None),
        ("truncated \\boxed{\\frac{1}{", None),
        ("\\boxed", None),
        ("\\boxedfoo{3}", None),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\frac{2}{4}", "\\frac12"),
        ("1+x^2", "x^2+1"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
        ("(1, 2)", "(1,2)"),
        ("\\text{Monday}", "Monday"),  # text golds: the string comparison covers them
        ("10", "10.0"),
        ("\\$5", "5"),
        ("\\left( 3 \\right)", "(3)"),
    ],
)
def test_equivalent_forms_score_one(answer: str, gold: str) -> None:
    assert boxed_math_reward([f"thus \\boxed{{{answer}}}"], [gold]) == [1.0]


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("\\boxed{3}", "4"),
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("\\boxed{x^2-1}", "x^2+1"),
        ("\\boxed{4} was wrong, it is \\boxed{5}", "4"),  # the last box counts
        ("The answer is 4.", "4"),  # missing box
        ("\\boxed{4", "4"),  # box never closed (truncated completion)
        ("", "4"),
    ],
)
def test_wrong_or_missing_answers_score_zero(completion: str, gold: str) -> None:
    assert boxed_math_reward([completion], [gold]) == [0.0]


@pytest.mark.parametrize("gold", ["}{", "\\frac{", "\\text{(C) none of these}", "???", ""])
def test_unparseable_gold_scores_zero_without_raising(gold: str) -> None:
    assert boxed_math_reward(["\\boxed{7}"], [gold]) == [0.0]


@pytest.mark.parametrize("gold", ["\\text{(C) none of these}", "???", "\\text{Tuesday}"])
def test_unparseable_gold_still_matches_the_same_answer(gold: str) -> None:
    assert boxed_math_reward([f"\\boxed{{{gold}}}"], [gold]) == [1.0]


def test_missing_gold_scores_zero() -> None:
    assert boxed_math_reward(["\\boxed{7}"], [None]) == [0.0]


def test_oversized_answers_are_not_parsed() -> None:
    huge = "+".join(["x"] * MAX_ANSWER_CHARS)
    assert not is_equivalent(huge, "x")
    assert is_equivalent(huge, huge)  # still equal as a string


def test_works_off_the_main_thread() -> None:
    # TRL scores through asyncio.to_thread; math-verify's signal timeouts fail there.
    results: list[list[float]] = []
    thread = threading.Thread(
        target=lambda: results.append(boxed_math_reward(["\\boxed{\\frac12}"], ["0.5"]))
    )
    thread.start()
    thread.join(30)
    assert results == [[1.0]]


def test_conversational_completions_and_batch_shape() -> None:
    completions = [
        [{"role": "assistant", "content": "It is \\boxed{2}."}],
        [{"role": "assistant", "content": "\\boxed{9}"}],
        "plain text \\boxed{3}",
    ]
    assert boxed_math_reward(completions, ["2", "8", "3"], prompts=["ignored"] * 3) == [
        1.0,
        0.0,
        1.0,
    ]
    with pytest.raises(ValueError, match="3 completions but 2 solutions"):
        boxed_math_reward(completions, ["2", "8"])
    with pytest.raises(TypeError):
        completion_text(42)


def test_reward_pickles_for_trls_rollout_process() -> None:
    assert pickle.loads(pickle.dumps(boxed_math_reward)) is boxed_math_reward
