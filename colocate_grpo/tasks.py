"""Built-in tasks: prompt datasets and their programmatic rewards.

A task is a dataset with a ``prompt`` column (plain text or chat messages) plus
whatever columns its reward functions read; TRL passes every dataset column to
each reward function as a keyword argument of per-completion lists.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

ARITHMETIC_MAX_OPERAND = 19


def arithmetic_problems(max_operand: int = ARITHMETIC_MAX_OPERAND) -> list[tuple[int, int]]:
    """Every ordered pair (a, b) with 0 <= a, b <= max_operand."""
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def arithmetic_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def arithmetic_dataset(size: int = 2000, seed: int = 0, max_operand: int = ARITHMETIC_MAX_OPERAND) -> Dataset:
    """Addition prompts such as ``"7+12="`` with the sum in column ``answer`` (a string)."""
    rng = random.Random(seed)
    problems = arithmetic_problems(max_operand)
    rows = [rng.choice(problems) for _ in range(size)]
    return Dataset.from_dict(
        {
            "prompt": [arithmetic_prompt(a, b) for a, b in rows],
            "answer": [str(a + b) for a, b in rows],
        }
    )


def _completion_text(completion: str | list[dict]) -> str:
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def arithmetic_reward(completions: list, answer: list[str], **_: object) -> list[float]:
    """1.0 when the completion is exactly the sum (surrounding whitespace ignored), else 0.0."""
    return [float(_completion_text(c).strip() == a) for c, a in zip(completions, answer, strict=True)]


_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,\.]+)")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _normalise_number(text: str) -> str:
    return text.replace(",", "").rstrip(".").removesuffix(".0")


def gsm8k_answer(solution: str) -> str:
    """The final number of a GSM8K reference solution (the text after ``####``)."""
    match = _GSM8K_FINAL.search(solution)
    if match is None:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return _normalise_number(match.group(1))


def accuracy_reward(completions: list, answer: list, **_: object) -> list[float]:
    """1.0 when the last number in the completion equals the reference answer, else 0.0.

    ``answer`` may be a bare number (text or a number, as the dataset's column holds it) or a full GSM8K
    solution ending in ``#### <number>``.
    """
    rewards = []
    for completion, given in zip(completions, answer, strict=True):
        reference = str(given)
        expected = gsm8k_answer(reference) if "####" in reference else _normalise_number(reference)
        numbers = _LAST_NUMBER.findall(_completion_text(completion))
        rewards.append(float(bool(numbers) and _normalise_number(numbers[-1]) == expected))
    return rewards
