"""Empty prompts: refused by row number before the model loads, or left out with a count.

vLLM refuses to generate from an empty prompt ("The decoder prompt cannot be empty") in the middle of a run;
a blank question (spaces only, or chat messages with no text) teaches nothing either.
"""

from __future__ import annotations

import logging
from typing import Any

from datasets import Dataset

from colocate_grpo.config import ConfigError, DatasetConfig

logger = logging.getLogger(__name__)

ROWS_SHOWN = 10  # row numbers a message lists


def is_blank(prompt: Any) -> bool:
    """Whether a prompt column's value holds no text: None, blank text, or chat messages without any."""
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, list):  # chat messages, or a message's parts
        return all(_is_blank_part(part) for part in prompt)
    return False


def _is_blank_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return is_blank(part)
    if "content" in part:  # a chat message
        return is_blank(part["content"])
    return is_blank(part["text"]) if "text" in part else False  # a text part; an image is not blank


def _rows(rows: list[int]) -> str:
    shown = ", ".join(str(row) for row in rows[:ROWS_SHOWN])
    return shown + (f" and {len(rows) - ROWS_SHOWN} more" if len(rows) > ROWS_SHOWN else "")


def drop_or_refuse_empty_prompts(dataset: Dataset, spec: DatasetConfig) -> Dataset:
    """``dataset`` without its empty or blank prompts when ``spec.skip_empty_prompts`` (warned, with their count
    and rows); else ``dataset`` itself when it has none.

    Rows are numbered from 0, as ``dataset[i]`` (in a JSONL file, row i is line i + 1).

    Raises:
        ConfigError: naming the rows of the empty prompts, unless ``spec.skip_empty_prompts``.
    """
    empty = [i for i, prompt in enumerate(dataset[spec.prompt_column]) if is_blank(prompt)]
    if not empty:
        return dataset
    where = f"'dataset.path: {spec.path}' (column '{spec.prompt_column}')"
    if not spec.skip_empty_prompts:
        raise ConfigError(
            f"{len(empty)} of {len(dataset)} prompts of {where} are empty or blank, at rows {_rows(empty)} (numbered "
            "from 0): vLLM cannot generate from an empty prompt. Remove them from the dataset, or set "
            "'dataset.skip_empty_prompts: true' to leave them out."
        )
    if len(empty) == len(dataset):
        raise ConfigError(f"Every one of the {len(dataset)} prompts of {where} is empty or blank: nothing to train on.")
    logger.warning(
        "Left out %d empty or blank prompts of %s, at rows %s (numbered from 0; dataset.skip_empty_prompts).",
        len(empty),
        where,
        _rows(empty),
    )
    skipped = set(empty)
    return dataset.select([i for i in range(len(dataset)) if i not in skipped])
