"""Rewards at run time: a failing reward is named with its sample, and unscored samples are counted.

TRL's ``GRPOTrainer._calculate_rewards`` calls each reward function on the whole generation batch. Through
:func:`calculate_rewards`:

- a reward that raises, returns the wrong number of scores or a score that is not a number stops the run with
  a :class:`RewardError` naming the function, the step, the sample (its index in the batch, found by scoring
  the samples one by one again) and its prompt, cut short; the output folder keeps its last complete checkpoint;
- a reward may return None (or NaN) for a sample it does not apply to, as TRL documents: TRL makes it NaN, sums
  over the reward functions with ``nansum`` and gives a sample no reward function scored no advantage. Each step
  logs ``rewards/<name>/unscored``, the number of samples the function left unscored; the first time it is above
  zero a warning says so, once per function; a batch that no reward function scored at all stops the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from colocate_grpo.checkpoints import newest_sealed

logger = logging.getLogger(__name__)

PROMPT_CHARS = 60  # how much of a prompt a message quotes


class RewardError(RuntimeError):
    """A reward function failed during training; the message names it, the step, the sample and its prompt."""


def _prompt_text(prompt: Any) -> str:
    """A prompt as text, cut to PROMPT_CHARS: chat prompts by their last message."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    text = str(prompt)
    return text if len(text) <= PROMPT_CHARS else text[: PROMPT_CHARS - 3] + "..."


def _resume_hint(trainer: Any) -> str:
    checkpoint = newest_sealed(Path(trainer.args.output_dir))
    if checkpoint is None:
        return f"The run stopped; {trainer.args.output_dir} has no checkpoint yet (save_steps writes them)."
    return (
        f"The run stopped; {checkpoint} is its last complete checkpoint: fix the reward and continue with "
        "'resume_from_checkpoint: latest'."
    )


def _one_sample(kwargs: dict[str, Any], index: int, size: int) -> dict[str, Any]:
    """The reward's arguments for sample ``index`` alone: every per-sample list cut to its one entry."""
    return {k: [v[index]] if isinstance(v, list) and len(v) == size else v for k, v in kwargs.items()}


def _failing_sample(func: Callable[..., Any], kwargs: dict[str, Any], size: int) -> int | None:
    """The first sample the reward raises on when scored alone; None when each alone scores."""
    for index in range(size):
        try:
            func(**_one_sample(kwargs, index, size))
        except Exception:  # the user's code: whatever it raises
            return index
    return None


def _guard(func: Callable[..., Any], trainer: Any) -> Callable[..., Any]:
    """``func``, failing with a :class:`RewardError` that names the sample instead of with its own exception."""
    name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"

    def guarded(**kwargs: Any) -> list[Any]:
        prompts = kwargs["prompts"]
        size, step = len(prompts), trainer.state.global_step + 1

        def where(index: int | None) -> str:
            if index is None:
                return f"at step {step}, on the batch of {size} samples (each sample alone scores)"
            return f"at step {step}, on sample {index} of {size} (prompt {_prompt_text(prompts[index])!r})"

        try:
            scores = func(**kwargs)
        except Exception as err:  # the user's code: whatever it raises stops the run, named
            index = _failing_sample(func, kwargs, size)
            raise RewardError(
                f"Reward '{name}' raised {type(err).__name__}: {err} {where(index)}. {_resume_hint(trainer)} A reward "
                "may return None for a sample it does not apply to."
            ) from err
        if not isinstance(scores, list | tuple) or len(scores) != size:
            count = len(scores) if hasattr(scores, "__len__") else type(scores).__name__
            raise RewardError(
                f"Reward '{name}' returned {count} scores for {size} completions {where(None)}: it must return a list "
                f"with one score (or None) per completion. {_resume_hint(trainer)}"
            )
        for index, score in enumerate(scores):
            if score is not None and not isinstance(score, int | float):
                raise RewardError(
                    f"Reward '{name}' returned {score!r} {where(index)}: a score must be a number, or None for a "
                    f"sample it does not apply to. {_resume_hint(trainer)}"
                )
        return list(scores)

    return guarded


def calculate_rewards(trainer: Any, calculate: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """TRL's ``_calculate_rewards`` (``calculate``, given ``args``) with named failures and unscored samples counted.

    Returns the rewards per sample and function (TRL's tensor, NaN where a function gave None or NaN).

    Raises:
        RewardError: when a reward fails on a sample (see the module's docstring), or no reward function scored
            any sample of the batch.
    """
    from trl.trainer.utils import is_async_callable  # TRL is imported by then; the CLI's refusals need it not

    functions = trainer.reward_funcs
    # Plain functions only: reward models are TRL's own to run, and wrapping a coroutine function would hide it.
    trainer.reward_funcs = [
        _guard(f, trainer) if callable(f) and not isinstance(f, torch.nn.Module) and not is_async_callable(f) else f
        for f in functions
    ]
    try:
        rewards = calculate(*args)
    finally:
        trainer.reward_funcs = functions
    _count_unscored(trainer, rewards)
    return rewards


def _count_unscored(trainer: Any, rewards: torch.Tensor) -> None:
    """Log ``rewards/<name>/unscored`` per function; warn once per function; refuse a batch nobody scored."""
    unscored = torch.isnan(rewards)
    step = trainer.state.global_step + 1
    mode = "train" if trainer.model.training else "eval"
    warned = trainer.__dict__.setdefault("_unscored_rewards_warned", set())
    for i, name in enumerate(trainer.reward_func_names):
        count = int(unscored[:, i].sum())
        trainer._metrics[mode][f"rewards/{name}/unscored"].append(float(count))
        if count and name not in warned:
            warned.add(name)
            logger.warning(
                "Reward '%s' left %d of %d samples unscored at step %d (it returned None or NaN): they count as not "
                "scored by it (TRL leaves them out of its sum, and a sample no reward scores gets no advantage). "
                "rewards/%s/unscored counts them at every step; this warning is not repeated.",
                name,
                count,
                rewards.shape[0],
                step,
                name,
            )
    if rewards.numel() and bool(unscored.all()):
        names = ", ".join(f"'{name}'" for name in trainer.reward_func_names)
        raise RewardError(
            f"No reward function scored any of the {rewards.shape[0]} samples at step {step} ({names} returned None "
            f"or NaN for every one): the step would learn nothing. {_resume_hint(trainer)} Make at least one reward "
            "return a number for the samples it can judge."
        )
