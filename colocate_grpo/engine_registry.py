"""The process's one engine: which engine is live, whether a run may reuse it, and when one may start.

vLLM allows one sleep-mode engine per process, and its allocator stays in use after that
engine closes (vLLM 0.26). So on a GPU a process has one engine for its life: a later run is
served only by the live engine, and only when the run's :class:`~colocate_grpo.plan.EngineSpec`
has the live engine's identity. On CPU (no sleep mode) a new engine replaces the old.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING

import torch

from colocate_grpo.engine_state import EngineStateError
from colocate_grpo.vllm_shims import on_cpu

if TYPE_CHECKING:
    from colocate_grpo.engine import Engine
    from colocate_grpo.plan import EngineSpec

logger = logging.getLogger(__name__)

_live_engine: weakref.ref[Engine] | None = None
# vLLM's sleep-mode allocator is a process-wide singleton that a closed engine leaves in use (vLLM 0.26).
_sleep_engine_was_closed = False


def live_engine() -> Engine | None:
    """The open engine of this process, if any."""
    engine = _live_engine() if _live_engine is not None else None
    return None if engine is None or engine.closed else engine


def refuse_unservable_run(spec: EngineSpec) -> None:
    """On a GPU, refuse a run whose engine ``spec`` the process's engine cannot serve, before the run loads its
    model. Does nothing on CPU, where a new engine replaces the old.

    Raises:
        EngineStateError: naming each setting that differs and the fix (restart the process).
    """
    previous = live_engine()
    if on_cpu() or (previous is None and not _sleep_engine_was_closed):
        return
    if previous is not None and previous.spec.identity == spec.identity:
        return
    raise EngineStateError(second_engine_message(previous, spec))


def second_engine_message(previous: Engine | None, wanted: EngineSpec) -> str:
    """Why no second engine starts in a process that has had one with vLLM's sleep mode, and the fixes."""
    if previous is None:
        return (
            "vLLM allows one sleep-mode engine per process, and this process already closed one. Restart the Python "
            "process (in a notebook: the kernel) to start another."
        )
    return (
        "vLLM allows one sleep-mode engine per process, and this process's engine was built for other settings: "
        f"{previous.spec.differences(wanted)}. Restart the Python process (in a notebook: the kernel) to run with "
        "these settings, or set them back to the engine's: a run with its settings reuses it."
    )


def admit(spec: EngineSpec) -> None:
    """Make way for a new engine for ``spec``: on a GPU refuse it where the process has had one (before the live one
    is closed, so the process keeps it for runs with its settings); on CPU close the live one."""
    previous = live_engine()
    if not on_cpu() and (previous is not None or _sleep_engine_was_closed):
        raise EngineStateError(second_engine_message(previous, spec))
    if previous is not None:
        logger.info("Closing the previous colocated engine before starting a new one.")
        previous.close()


def register(engine: Engine) -> None:
    """Record ``engine`` as the process's live engine."""
    global _live_engine
    _live_engine = weakref.ref(engine)


def closed(engine: Engine) -> None:
    """Record that ``engine`` closed (with sleep mode: no other engine may start in this process)."""
    global _live_engine, _sleep_engine_was_closed
    _sleep_engine_was_closed = _sleep_engine_was_closed or engine.sleep_mode
    if _live_engine is not None and _live_engine() is engine:
        _live_engine = None


def shared_engine(spec: EngineSpec) -> Engine:
    """The live engine when it has ``spec``'s identity; else a new one (closing the old on CPU).

    Every sync pushes all weights, so an engine can serve one trainer after another: notebooks that
    re-run a training cell reuse it instead of starting (and leaking) another. An engine built for a smaller
    generation batch (``generation_batch``, ``sequence_tokens``) is replaced on CPU; on a GPU, where it is the
    process's one sleep-mode engine, it is reused with a warning, generating the batch in several passes.
    """
    from colocate_grpo.engine import Engine

    engine = live_engine()
    if engine is not None and engine.spec.identity == spec.identity:
        shortfall = engine.spec.batch_shortfall(spec)
        if shortfall is None:
            return engine
        if not on_cpu():  # the one sleep-mode engine this process may have: slower, not refused
            logger.warning(
                "The colocated engine was built for an earlier run's smaller generation batch: this run needs %s, "
                "so vLLM generates it in several passes. Restart the Python process (in a notebook: the kernel) "
                "to size the engine for this run.",
                shortfall,
            )
            return engine
    return Engine(spec)


def launched_ranks() -> int:
    """How many ranks the launcher (torchrun, ``accelerate launch``) started; 1 outside a launch.

    Raises:
        EngineStateError: when launched as one of several ranks without torch.distributed set up:
            vLLM would start a process group of its own, of one rank, and the others would fail.
    """
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise EngineStateError(
            f"This process is one of {ranks} launched ranks, but torch.distributed is not initialized: build the "
            "engine through a trainer (its accelerator sets the process group up), or call "
            "accelerate.PartialState() first."
        )
    return ranks
