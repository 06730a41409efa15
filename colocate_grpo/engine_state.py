"""The states of the colocated engine, and the error for a call that its state forbids.

vLLM hangs forever if asked to generate while asleep, and serves garbage after a level-2
sleep until weights are pushed: :class:`~colocate_grpo.engine.Engine` tracks where its
weights and KV cache are in an :class:`EngineState` and refuses what would hang or mislead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineStateError(RuntimeError):
    """An engine call that would hang, or silently use stale or discarded weights."""


class GenerationWorkerError(RuntimeError):
    """A generation in the background (``async_generation``) failed, re-raised in the trainer's thread with its
    message; or it had not ended by the deadline at the end of training."""


class Weights(enum.Enum):
    """Where the engine's weights are and whether they can be trusted."""

    RESIDENT = "resident"  # on the device and current
    OFFLOADED = "offloaded"  # level-1 sleep: copied to CPU memory, restored by wake_up
    DISCARDED = "discarded"  # level-2 sleep: gone; wake_up maps memory but the contents are garbage
    GARBAGE = "awake, not loaded"  # woken after a level-2 sleep; load_weights must run before generating


@dataclass(frozen=True)
class EngineState:
    weights: Weights
    kv_cache_awake: bool

    @property
    def ready(self) -> bool:
        """True when generate() may run."""
        return self.weights is Weights.RESIDENT and self.kv_cache_awake

    @property
    def weights_mapped(self) -> bool:
        """Whether the weights' device memory is mapped (current or not)."""
        return self.weights in (Weights.RESIDENT, Weights.GARBAGE)

    def __str__(self) -> str:
        return f"weights {self.weights.value}, KV cache {'awake' if self.kv_cache_awake else 'asleep'}"
