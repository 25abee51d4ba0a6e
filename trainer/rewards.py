"""The recipe's reward: 1.0 when the last ``\\boxed{...}`` answer equals the gold answer, else 0.0.

Equivalence is decided by ``math-verify`` (symbolic: ``\\frac12`` == ``0.5`` == ``\\frac{2}{4}``),
after a normalized string comparison that also covers golds math-verify cannot parse (text answers
such as ``\\text{Monday}``, multiple-choice letters). An unparseable gold never raises: it scores
by the string comparison alone, so a sample is never dropped from training for it.

TRL calls reward functions in its spawned rollout process, through ``asyncio.to_thread``: off the
main thread, where math-verify's ``signal.alarm`` timeouts cannot work (they raise). There the
timeouts are disabled and work is bounded by ``MAX_ANSWER_CHARS`` instead.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Sized from the recipe's dataset: MATH gold answers are at most a few dozen characters; a boxed
# "answer" longer than this is degenerate text whose symbolic parse can take seconds, and with
# timeouts disabled off the main thread a length cap is the only bound left.
MAX_ANSWER_CHARS = 512
# math-verify's own defaults, used only where signals work (the main thread).
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# LaTeX spellings that do not change a value; stripped before the string comparison.
_NOISE = (
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\ ", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("$", ""),
)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    ``None`` when there is none or its braces never close (a truncated completion). ``\\boxed 5``
    (no braces, single token) is accepted as ``5``, as LaTeX renders it.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd_len = next(len(c) for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + cmd_len :]
    body = rest.lstrip()
    if not body:
        return None
    if body[0] != "{":
        if not rest[0].isspace():  # "\boxedfoo" is another command, not a box
            return None
        return body.split(maxsplit=1)[0].rstrip(".$") or None
    depth = 0
    for i, char in enumerate(body):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return body[1:i]
    return None


def normalize_answer(answer: str) -> str:
    """A canonical spelling for the string fast path: whitespace, sizing commands, ``$`` removed."""
    text = answer.strip()
    for old, new in _NOISE:
        text = text.replace(old, new)
    text = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", text)
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def _as_boxed(answer: str) -> str:
    # math-verify parses LaTeX only inside an anchor ($...$ or \boxed{}); a bare "x^2+1" or
    # "\frac{1}{2}" is otherwise read as plain text or not at all.
    return answer if any(cmd in answer for cmd in _BOX_COMMANDS) else f"\\boxed{{{answer}}}"


def is_equivalent(answer: str, gold: str) -> bool:
    """Whether ``answer`` is mathematically the same as ``gold`` (math-verify), never raising."""
    if normalize_answer(answer) == normalize_answer(gold):
        return True
    if len(answer) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify  # type: ignore[import-untyped]

    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout = PARSE_TIMEOUT_S if on_main else None
    verify_timeout = VERIFY_TIMEOUT_S if on_main else None
    try:
        parsed_gold = parse(_as_boxed(gold), parsing_timeout=parse_timeout)
        if not parsed_gold:
            logger.debug("gold answer %r is not parseable by math-verify; string match only", gold)
            return False
        parsed_answer = parse(_as_boxed(answer), parsing_timeout=parse_timeout)
        if not parsed_answer:
            return False
        return bool(verify(parsed_gold, parsed_answer, timeout_seconds=verify_timeout))
    except Exception:  # math-verify wraps sympy; a pathological expression must not end the run
        logger.debug("math-verify failed on answer=%r gold=%r", answer, gold, exc_info=True)
        return False


def completion_text(completion: Any) -> str:
    """The generated text of one completion, as TRL hands it over (message list or plain string)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        # Conversational: a list of messages; the answer is in the assistant turns' content.
        parts = [
            str(m.get("content") or "")
            for m in completion
            if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        ]
        return "\n".join(parts)
    raise TypeError(f"unexpected completion type {type(completion).__name__}")


def boxed_math_reward(completions: Sequence[Any], solution: Sequence[Any], **_: Any) -> list[float]:
    """TRL reward function: 1.0 per completion whose last boxed answer equals its ``solution``.

    ``solution`` is the gold column the trainer's data loader produces. Signature follows TRL's
    contract (keyword arguments, extra columns ignored); module level so it pickles into TRL's
    spawned rollout process.
    """
    if len(completions) != len(solution):
        raise ValueError(f"{len(completions)} completions but {len(solution)} solutions")
    rewards: list[float] = []
    for completion, gold in zip(completions, solution, strict=True):
        answer = last_boxed(completion_text(completion))
        if answer is None or gold is None:
            rewards.append(0.0)
            continue
        rewards.append(1.0 if is_equivalent(answer, str(gold)) else 0.0)
    return rewards
