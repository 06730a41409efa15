"""How the trainer runs its forward and backward passes: the micro-batch, the accumulation and gradient
checkpointing, chosen by the run plan (:mod:`colocate_grpo.plan`) as the fastest way the memory plan admits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colocate_grpo.memory_plan import MemoryPlan, size_text

# Hidden-state values (tokens x hidden size) a micro-batch needs to keep the GPU's matmuls busy. On an H100 a
# micro-batch without gradient checkpointing trains faster than checkpointed micro-batches of 64 sequences from
# 16 sequences of 288 tokens at the 1.5B shape (7.1M values; 8 sequences, 3.5M, are 1.9x slower a sequence) and
# from 8 at 7B (8.3M): the benchmark's training-step experiment.
BUSY_MICRO_BATCH_VALUES = 6_000_000


@dataclass(frozen=True)
class TrainingPlan:
    """How the trainer runs its forward and backward passes: TRL's batch arguments, decided by the plan.

    Attributes:
        micro_batch_size: completions per forward and backward (``per_device_train_batch_size``).
        gradient_accumulation_steps, steps_per_generation: TRL's; their product with the micro-batch is
            the generation batch and the optimizer step, which the plan never changes.
        gradient_checkpointing: recompute activations in the backward pass.
        one_forward: TRL's importance-sampling ratio from each micro-batch's training forward, without its
            scoring pass (:mod:`colocate_grpo.on_policy`): where generation is on the policy that trains.
        old_logprobs_needed: whether TRL needs old log-probabilities at all
            (:func:`colocate_grpo.on_policy.trl_scores_old_logprobs`): not with its importance-sampling correction
            off and each generation batch trained within one optimizer step.
        changed: what the plan changed of what the run asked for, and why (None: nothing).
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    gradient_checkpointing: bool
    one_forward: bool = False
    old_logprobs_needed: bool = True
    changed: str | None = field(default=None, compare=False)

    def describe(self) -> str:
        """One line: the micro-batches, checkpointing and the old log-probabilities, and what the plan changed."""
        line = (
            f"Training: micro-batches of {self.micro_batch_size}, {self.gradient_accumulation_steps} per "
            f"optimizer step, gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}, "
            f"{self._old_logprobs()}."
        )
        return line if self.changed is None else f"{line} {self.changed}"

    def _old_logprobs(self) -> str:
        if not self.old_logprobs_needed:
            return "no old log-probabilities needed (no importance-sampling correction, each batch trained once)"
        return f"old log-probabilities from {'each training forward' if self.one_forward else 'a scoring pass'}"

    def grpo_arguments(self) -> dict[str, Any]:
        """The ``GRPOConfig`` arguments that carry this plan."""
        return {
            "per_device_train_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_generation": self.steps_per_generation,
            "gradient_checkpointing": self.gradient_checkpointing,
        }


def fitting_training(
    requested: TrainingPlan,
    memory_plan: Callable[[TrainingPlan], MemoryPlan],
    checkpointing: bool | None,
    smaller_micro_batches: bool,
    values_per_sequence: int,
) -> TrainingPlan:
    """The fastest way of training the ``requested`` batch whose memory plan (``memory_plan(training)``) fits.

    Without gradient checkpointing a LoRA step takes about two thirds of the time, so where ``checkpointing``
    is None (auto) it is off at the requested micro-batch, or at a halved one (the accumulation doubled) as long
    as a micro-batch's hidden states keep ``BUSY_MICRO_BATCH_VALUES`` values (``values_per_sequence`` a sequence);
    else on, at the largest micro-batch that fits.
    Where nothing fits, the requested batch (checkpointing on, where auto), for the refusal's numbers.
    """
    sizes = [requested.micro_batch_size]
    while smaller_micro_batches and sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    candidates = [(checkpointing, size) for size in sizes] if checkpointing is not None else []
    if checkpointing is None:
        candidates = [
            (False, size) for size in sizes if size == sizes[0] or size * values_per_sequence >= BUSY_MICRO_BATCH_VALUES
        ]
        candidates += [(True, size) for size in sizes]
    for checkpoint, size in candidates:
        factor = requested.micro_batch_size // size
        training = dataclasses.replace(
            requested,
            micro_batch_size=size,
            gradient_accumulation_steps=requested.gradient_accumulation_steps * factor,
            steps_per_generation=requested.steps_per_generation * factor,
            gradient_checkpointing=checkpoint,
        )
        plan = memory_plan(training)
        if not plan.fits and plan.generation_peak > plan.free:
            break  # generation does not fit: no way of training helps
        if plan.fits:
            if size == requested.micro_batch_size:
                return training
            whole = memory_plan(dataclasses.replace(requested, gradient_checkpointing=checkpoint))
            return dataclasses.replace(
                training,
                changed=f"(micro_batch_size {requested.micro_batch_size} would need {size_text(whole.training_peak)} "
                f"while training, of {size_text(plan.free)} free: the same sequences train in {factor} times as many "
                "micro-batches.)",
            )
    return requested
