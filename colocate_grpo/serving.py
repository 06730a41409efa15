"""How the engine serves the trained policy, and whether it generates while the trainer trains.

The run plan (:mod:`colocate_grpo.plan`) picks one :class:`Serving` for a run, and an :class:`AsyncMode` where
generation overlaps training; the loader, the trainer, the sync and the checkpoints read them from the plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Serving(enum.Enum):
    """How the engine serves the trained policy."""

    MERGE_AWARE = "merge-aware"  # LoRA trained on its cast merge: the served weights are bitwise the trained ones
    MERGED = "merged"  # PEFT's LoRA merged into the weights, rounded to their dtype
    ADAPTER = "adapter"  # vLLM's LoRA kernels apply the adapter on the base weights
    QUANTIZED_BASE = "4-bit base + adapter"  # the same on vLLM's NF4 base
    FULL_WEIGHTS = "weights"  # full fine-tuning: the trained weights themselves

    @property
    def lora(self) -> bool:
        return self is not Serving.FULL_WEIGHTS

    @property
    def serves_adapter(self) -> bool:
        """Whether vLLM applies the adapter itself, on a base that never changes."""
        return self in (Serving.ADAPTER, Serving.QUANTIZED_BASE)

    @property
    def merges(self) -> bool:
        """Whether each sync merges the LoRA update into the served weights."""
        return self in (Serving.MERGE_AWARE, Serving.MERGED)

    def describe(self, shared_base: bool, fp32_head: bool = False) -> str:
        """How the engine serves the policy, in words (the run's ``Served as:`` line)."""
        if self is Serving.QUANTIZED_BASE:
            text = "4-bit base + adapter (vLLM's NF4 base, one copy shared with the trainer, and its LoRA kernels)"
        elif self is Serving.ADAPTER:
            text = (
                f"adapter (vLLM's LoRA kernels on the base weights{', one copy shared with the trainer' * shared_base})"
            )
        elif self is Serving.FULL_WEIGHTS:
            text = "weights (full fine-tuning)"
        else:
            one_copy = "; one copy of the base, shared with the trainer and merged in place" * shared_base
            what = (
                "merged weights, bitwise what is trained"
                if self is Serving.MERGE_AWARE
                else ("LoRA merged into the weights, rounded to their dtype")
            )
            text = f"{self.value} ({what}{one_copy})"
        return text + "; logits in fp32 on both sides" * fp32_head


@dataclass(frozen=True)
class AsyncMode:
    """Asynchronous generation (``async_generation``): the engine generates the next batch while the trainer trains
    on this one, in a background thread (on a GPU, on a CUDA stream of its own).

    Attributes:
        max_staleness: optimizer steps a batch's adapter may lag behind the trainer's when training on it starts;
            an older batch is dropped and generated again.
    """

    max_staleness: int

    def describe(self) -> str:
        """The run's ``Generation:`` line: what the mode does and why it serves the adapter."""
        return (
            "asynchronous: the next batch generates while this one trains, with the adapter of the step before (one "
            f"batch in flight, max_staleness {self.max_staleness}); the engine stays awake. The adapter is served, not "
            "merged, as a merge would change the base the trainer computes with; it is synced between generations. "
            "On one GPU it is not faster than the sequential mode (measured on an H100): generation and training slow "
            "each other down on the device (docs/async.md)."
        )
