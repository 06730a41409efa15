"""Micro-batches grouped by length: the trainer's forwards compute no padding.

TRL pads a generation batch to its longest prompt (on the left) and its longest completion (on the right),
shuffles it, and slices it into ``steps_per_generation`` micro-batches; every forward (the scoring pass
that computes the old logprobs, in chunks of a micro-batch, and each micro-batch's forward and backward)
then runs over the whole padded width. With ``group_by_length`` (:class:`~colocate_grpo.trainer.ColocateGRPOTrainer`):

- each forward is trimmed to its own rows' longest prompt and completion (:func:`trimmed`), and its
  per-token outputs are padded back with the zeros TRL's fused head gives padding: exact for every loss,
  as padding only ever enters masked out;
- the scoring pass takes its chunks in order of length, and puts the rows back in their order: exact for
  every loss, each row's logprobs being its own;
- the micro-batches of each optimizer step are regrouped by completion length (:func:`group_by_length`):
  exact where the loss of an optimizer step is a sum over its sequences with weights that do not depend on
  which sequences share a micro-batch (:func:`regrouping_changes_loss` says where it is not).

Which losses regrouping keeps, from TRL 1.16's ``GRPOTrainer._compute_loss``, with G micro-batches of B
sequences in an optimizer step (every micro-batch has B rows: ``split_tensor_dict`` cuts equal slices):

- ``grpo``, ``sapo``: each micro-batch's mean of its sequences' token means, divided by G: the step's
  loss is the mean over its G*B sequences, whatever the grouping.
- ``dr_grpo``: a micro-batch's token sum over B * max_completion_length, divided by G: a constant
  denominator. ``luspo``: each sequence's token sum, mean over B, divided by G. The same.
- ``dapo`` (TRL's default), ``cispo``, ``vespo``: a micro-batch's token sum over the generation batch's
  token count (``num_items_in_batch``): a constant denominator.
- ``bnpo``: each micro-batch's token mean: its tokens weigh 1 / (that micro-batch's token count), which
  grouping changes. The entropy bonus (``entropy_coef``, adaptive entropy), the high-entropy token mask
  (``top_entropy_quantile`` below 1: its threshold is a quantile of each micro-batch's entropies) and a
  mixture-of-experts router's load-balancing loss (a mean over each micro-batch) change with it too.

The per-sequence terms (the importance ratios, their clipping and masks, the KL to the reference) are each
sequence's own. So are the logged metrics that are token means over a micro-batch, which are averaged over
an optimizer step's micro-batches: they move with the grouping, the loss does not.
"""

from __future__ import annotations

from typing import Any

import torch

# The loss types whose optimizer-step loss does not depend on which sequences share a micro-batch.
REGROUPABLE_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# The keys of TRL's text-only generation batch (_generate_and_score_completions): one row per sequence, or a
# scalar. A batch with others (images, multimodal ids) is left as TRL makes it.
TEXT_BATCH_KEYS = frozenset(
    {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "advantages",
        "num_items_in_batch",
        "old_per_token_logps",
        "importance_sampling_ratio",
        "sampling_per_token_logps",
        "ref_per_token_logps",
        "tool_mask",
    }
)


def regrouping_changes_loss(
    loss_type: str, top_entropy_quantile: float = 1.0, entropy_bonus: bool = False, router_aux_loss: bool = False
) -> str | None:
    """Why regrouping an optimizer step's sequences into other micro-batches changes its loss, or None where it
    does not (see the module's docstring). Each reason names the key that decides it."""
    if loss_type not in REGROUPABLE_LOSS_TYPES:
        return f"'trl.loss_type: {loss_type}' normalizes each micro-batch by its own token count"
    if top_entropy_quantile < 1.0:
        return "'trl.top_entropy_quantile' below 1 takes its entropy threshold over each micro-batch"
    if entropy_bonus:
        return "the entropy bonus ('trl.entropy_coef', 'trl.use_adaptive_entropy') is a mean over each micro-batch"
    if router_aux_loss:
        return "the router's load-balancing loss ('trl.router_aux_loss_coef') is a mean over each micro-batch"
    return None


def is_text_batch(batch: dict[str, Any]) -> bool:
    """Whether ``batch`` holds only what a text-only generation batch holds (rows of sequences, a token count)."""
    return set(batch) <= TEXT_BATCH_KEYS


def lengths(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's prompt and completion length in tokens (its mask's ones)."""
    return batch["prompt_mask"].sum(1), batch["completion_mask"].sum(1)


def length_order(prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor) -> torch.Tensor:
    """Row indices by completion length, then prompt length, shortest first; ties keep their order."""
    key = completion_lengths.long() * (int(prompt_lengths.max()) + 1) + prompt_lengths.long()
    return torch.argsort(key, stable=True)


def group_by_length(micro_batches: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """The same sequences in micro-batches of the same sizes, each ``window`` consecutive micro-batches (one
    optimizer step's, or part of one) regrouped by completion length, then prompt length.

    Args:
        micro_batches: TRL's slices of a generation batch (``split_tensor_dict``), all of one size; text only
            (:func:`is_text_batch`).
        window: how many consecutive micro-batches may exchange sequences: a divisor of the number of
            micro-batches an optimizer step takes, so that no sequence moves to another optimizer step.
    """
    grouped = []
    for start in range(0, len(micro_batches), window):
        part = micro_batches[start : start + window]
        joined = {key: _joined([batch[key] for batch in part]) for key in part[0]}
        order = length_order(*lengths(joined))
        size = len(order) // len(part)
        for i in range(len(part)):
            rows = order[i * size : (i + 1) * size]
            grouped.append({key: _rows(value, rows) for key, value in joined.items()})
    return grouped


def _joined(values: list[Any]) -> Any:
    first = values[0]
    if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
        return first  # None, or a scalar every micro-batch shares (the generation batch's token count)
    return torch.cat(values)


def _rows(value: Any, rows: torch.Tensor) -> Any:
    if value is None or value.ndim == 0:
        return value
    return value[rows.to(value.device)]


def trimmed(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, multiple: int | None = None
) -> tuple[slice, int]:
    """The columns of a left-padded prompt + right-padded completion batch that hold a token of some row, and
    how many of them are completion columns.

    Args:
        multiple: keep the prompt's and the completion's widths multiples of it (TRL's ``pad_to_multiple_of``,
            which the batch's widths are).

    Returns:
        (columns, kept): ``input_ids[:, columns]`` has no column that is padding in every row (but for the
        rounding to ``multiple``), at least one prompt column and at least one completion column; its last
        ``kept`` columns are completion columns.
    """
    prompt_width = input_ids.size(1) - logits_to_keep
    used = attention_mask.bool().any(0).nonzero().flatten().tolist()
    prompt_kept = prompt_width - next((column for column in used if column < prompt_width), prompt_width - 1)
    kept = max([column + 1 - prompt_width for column in used if column >= prompt_width], default=1)
    if multiple:
        prompt_kept = min(prompt_width, -(-prompt_kept // multiple) * multiple)
        kept = min(logits_to_keep, -(-kept // multiple) * multiple)
    return slice(prompt_width - prompt_kept, prompt_width + kept), kept
