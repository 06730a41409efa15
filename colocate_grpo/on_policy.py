"""One forward per micro-batch: TRL's importance-sampling correction from the training forward.

With vLLM, TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` runs a forward without gradients over the
whole generation batch (the scoring pass) whenever ``vllm_importance_sampling_correction`` is on, its default.
Its log-probabilities (``old_per_token_logps``) serve three things: the importance-sampling ratio
``exp(old - sampling)`` (clipped or masked by ``vllm_importance_sampling_mode``), multiplied into the loss;
the ``sampling/*`` metrics; and the loss's ``old_per_token_logps``.

Where generation is aligned with the optimizer step (:func:`scores_in_training_forward`: ``num_iterations == 1``
and each generation batch's micro-batches all within one optimizer step), the policy does not change between the
scoring pass and any micro-batch's training forward: the optimizer steps after the step's last micro-batch. The
training forward computes the same policy's log-probabilities, with gradients. So here the scoring pass is
skipped (:meth:`OnPolicyScoring.generating` turns the correction off around TRL's generation, which keeps
``sampling_per_token_logps`` in its output) and each micro-batch's training forward gives, from its own
log-probabilities detached (:meth:`OnPolicyScoring.score`, which the trainer calls with the loss's forward):

- ``importance_sampling_ratio``: TRL's ratio, its modes, clipping, masking (``tool_mask`` too) and NaN handling
  as TRL's code has them (:func:`importance_sampling_ratio`);
- ``old_per_token_logps``: left out of the batch, so TRL takes ``per_token_logps.detach()``, its own on-policy
  choice;
- the ``sampling/*`` metrics, under TRL's names and with TRL's reductions: one value per generation batch (its
  token mean, max, min), appended when its last micro-batch has trained, as TRL appends one at generation.

Elsewhere (``num_iterations`` above 1, a generation batch spread over optimizer steps, evaluation) TRL's scoring
pass runs as it does in TRL.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# TRL's per-sequence modes: one ratio per sequence; the others, one per token.
SEQUENCE_MODES = ("sequence_mask", "sequence_truncate")
TRUNCATE_MODES = ("sequence_truncate", "token_truncate")
MASK_MODES = ("sequence_mask", "token_mask")


def trl_scores_old_logprobs(args: Any) -> bool:
    """Whether TRL 1.16 would run its scoring pass for a run with these ``GRPOConfig`` arguments: its vLLM
    importance-sampling correction on, or a generation batch trained over more than one optimizer step or
    iteration (``_generate_and_score_completions``'s condition). Otherwise the loss takes its own log-probabilities,
    detached, as the old ones."""
    generate_every = args.steps_per_generation * args.num_iterations
    return bool(
        args.gradient_accumulation_steps % generate_every != 0
        or (args.use_vllm and args.vllm_importance_sampling_correction)
    )


def scores_in_training_forward(args: Any) -> bool:
    """Whether a run with these ``GRPOConfig`` arguments computes TRL's importance-sampling ratio in each
    micro-batch's training forward instead of in a scoring pass: TRL's correction on (with vLLM), and every
    micro-batch of a generation batch trained once, within one optimizer step (``num_iterations`` 1, and
    ``steps_per_generation`` a divisor of ``gradient_accumulation_steps``), so on the policy that generated it
    scored as TRL scores it."""
    return bool(
        args.use_vllm
        and args.vllm_importance_sampling_correction
        and args.num_iterations == 1
        and args.gradient_accumulation_steps % args.steps_per_generation == 0
    )


def importance_sampling_ratio(
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio (``_generate_and_score_completions``, "Compute the importance
    sampling ratio when using vLLM"), line for line, from the trainer's ``logps`` (detached) instead of the
    scoring pass's: (B, T) in the token modes, (B, 1) in the sequence modes."""
    # Tokens whose sampling logprob is NaN (vLLM could not score them) get a zero difference: a ratio of 1.
    diff = torch.nan_to_num((logps - sampling_logps) * mask, nan=0.0)
    if mode in SEQUENCE_MODES:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in TRUNCATE_MODES:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in MASK_MODES:
        low = clip_min if clip_min is not None else -math.inf
        high = clip_max if clip_max is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)
    raise ValueError(
        f"Unknown vLLM importance sampling level: {mode}. Possible values are 'token_truncate', 'token_mask', "
        "'sequence_truncate', and 'sequence_mask'."
    )


@dataclass
class SamplingStats:
    """A generation batch's ``sampling/*`` statistics on this rank, summed over the micro-batches trained so far:
    TRL's token mean and max of |trainer - vLLM| log-probabilities (tokens vLLM could not score left out), and
    the ratio's min, mean and max over the masked tokens (token modes) or the sequences (sequence modes)."""

    expected: int  # micro-batches in the generation batch
    seen: int = 0
    parts: list[torch.Tensor] = field(default_factory=list)

    def add(
        self, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor, mode: str
    ) -> None:
        mask = mask.bool()
        delta = torch.abs(logps - sampling_logps)
        valid = mask & ~torch.isnan(delta)
        # A sequence mode's ratio counts for every sequence, a token mode's for the masked tokens.
        counted = torch.ones_like(ratio, dtype=torch.bool) if mode in SEQUENCE_MODES else mask
        inf = torch.tensor(math.inf, device=delta.device)
        self.parts.append(
            torch.stack(
                [
                    torch.where(valid, delta, 0.0).sum(),
                    valid.sum().float(),
                    torch.where(valid, delta, -inf).max(),
                    torch.where(counted, ratio, 0.0).sum(),
                    counted.sum().float(),
                    torch.where(counted, ratio, inf).min(),
                    torch.where(counted, ratio, -inf).max(),
                ]
            )
        )
        self.seen += 1

    @property
    def complete(self) -> bool:
        return self.seen >= self.expected

    def metrics(self, accelerator: Any) -> dict[str, float]:
        """TRL's ``sampling/*`` values for the generation batch, reduced over the ranks as TRL reduces them (a
        mean of the ranks' means, the max of their maxes, the min of their mins)."""
        from trl.trainer.utils import nanmax, nanmin  # not at import: the plan imports this module before TRL

        parts = torch.stack(self.parts)
        delta_sum, delta_count, ratio_sum, ratio_count = parts[:, [0, 1, 3, 4]].sum(0)
        zero = torch.zeros((), device=parts.device)
        has_delta, has_ratio = delta_count > 0, ratio_count > 0
        # TRL gives 0 where a rank has no token to reduce over.
        mean_delta = torch.where(has_delta, delta_sum / delta_count.clamp(min=1), zero)
        max_delta = torch.where(has_delta, parts[:, 2].max(), zero)
        mean_ratio = torch.where(has_ratio, ratio_sum / ratio_count.clamp(min=1), zero)
        min_ratio = torch.where(has_ratio, parts[:, 5].min(), zero)
        max_ratio = torch.where(has_ratio, parts[:, 6].max(), zero)
        gather = accelerator.gather
        return {
            "sampling/sampling_logp_difference/mean": gather(mean_delta).mean().item(),
            "sampling/sampling_logp_difference/max": gather(max_delta).max().item(),
            "sampling/importance_sampling_ratio/min": nanmin(gather(min_ratio)).item(),
            "sampling/importance_sampling_ratio/mean": gather(mean_ratio).nanmean().item(),
            "sampling/importance_sampling_ratio/max": nanmax(gather(max_ratio)).item(),
        }


class OnPolicyScoring:
    """Skips TRL's scoring pass for a trainer whose plan says so, and gives each micro-batch the ratio and the
    metrics from its training forward (the module's docstring)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.stats: SamplingStats | None = None

    @contextlib.contextmanager
    def generating(self, trainer: Any) -> Iterator[None]:
        """Around TRL's ``_generate_and_score_completions``: in training, its correction off (no scoring pass, no
        ratio, no ``sampling/*`` metrics; ``sampling_per_token_logps`` stays in the batch) and a new generation
        batch's statistics begun."""
        if not (self.enabled and trainer.model.training and trainer.vllm_importance_sampling_correction):
            yield
            return
        self.stats = SamplingStats(expected=trainer.args.steps_per_generation)
        trainer.vllm_importance_sampling_correction = False
        try:
            yield
        finally:
            trainer.vllm_importance_sampling_correction = True

    def score(self, trainer: Any, inputs: dict[str, Any], logps: torch.Tensor) -> None:
        """With the log-probabilities of the loss's forward of a micro-batch generated without its ratio (``logps``,
        detached): ``inputs["importance_sampling_ratio"]``, before the loss reads it, and the generation batch's
        statistics; once its last micro-batch has trained, TRL's metrics get them."""
        skipped = "importance_sampling_ratio" not in inputs and "sampling_per_token_logps" in inputs
        if self.enabled and skipped and trainer.vllm_importance_sampling_correction:
            self._correct(trainer, inputs, logps)

    def _correct(self, trainer: Any, inputs: dict[str, Any], logps: torch.Tensor) -> None:
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        sampling_logps = inputs["sampling_per_token_logps"]
        mode = trainer.vllm_importance_sampling_mode
        ratio = importance_sampling_ratio(
            logps,
            sampling_logps,
            mask,
            mode,
            trainer.vllm_importance_sampling_clip_min,
            trainer.vllm_importance_sampling_clip_max,
        )
        inputs["importance_sampling_ratio"] = ratio
        if self.stats is None or not trainer.model.training:
            return
        self.stats.add(logps, sampling_logps, mask, ratio, mode)
        if self.stats.complete:
            for key, value in self.stats.metrics(trainer.accelerator).items():
                trainer._metrics["train"][key].append(value)
            self.stats = None
