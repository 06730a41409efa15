"""TRL's GRPOTrainer with the colocated engine plugged in.

TRL owns the GRPO loop (losses, rewards, importance sampling, logging). Two things
change: its ``VLLMGeneration`` is replaced by :class:`ColocatedGeneration`, which
drives our :class:`~colocate_grpo.engine.Engine` and owns the sleep/wake policy,
and weights reach the engine through :mod:`colocate_grpo.sync` (merged out of
place, base weights untouched) instead of PEFT merge/unmerge and per-tensor loads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import trl.trainer.grpo_trainer as grpo_module
from trl import GRPOConfig, GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import Engine, Weights
from colocate_grpo.sync import push_weights


class ColocatedGeneration(VLLMGeneration):
    """TRL's colocated generation on our engine.

    TRL's own sleep handling is switched off (``enable_sleep_mode=False`` towards
    TRL); this class wakes the engine before each generation and puts it back to
    sleep afterwards, also when generation raises.
    """

    def __init__(self, *args: Any, engine_factory: Callable[[VLLMGeneration], Engine], **kwargs: Any) -> None:
        self._engine_factory = engine_factory
        kwargs["enable_sleep_mode"] = False
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        self.llm: Engine = self._engine_factory(self)
        self.llm.sleep()

    @property
    def engine(self) -> Engine:
        return self.llm

    def sync_weights(self) -> None:
        push_weights(self.model, self.llm)

    def generate(self, *args: Any, **kwargs: Any) -> tuple:
        if self.llm.state.weights in (Weights.DISCARDED, Weights.GARBAGE):
            self.sync_weights()  # a level-2 sleep since the last sync threw the weights away
        self.llm.wake_up()
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.llm.sleep()


@contextlib.contextmanager
def _generation_class(factory: Callable[..., VLLMGeneration]) -> Iterator[None]:
    """GRPOTrainer builds ``VLLMGeneration`` by module-global name; point it at ours while it does."""
    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


class ColocateGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose vLLM engine lives in this process and sleeps while training.

    Takes GRPOTrainer's arguments, plus:

    Args:
        vllm_options: the ``vllm:`` block (engine dtype, memory fraction, sleep level, ...).
        engine: an engine to reuse (from an earlier trainer on the same base model); one is
            created when None.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: GRPOConfig,
        *,
        vllm_options: VLLMConfig | None = None,
        engine: Engine | None = None,
        **kwargs: Any,
    ) -> None:
        options = vllm_options or VLLMConfig()

        def engine_factory(generation: VLLMGeneration) -> Engine:
            if engine is not None and not engine.closed:
                return engine
            dtype = generation.model.get_input_embeddings().weight.dtype
            return Engine(
                model_path=generation.model.name_or_path,
                options=options,
                dtype=str(dtype).removeprefix("torch."),
                max_num_seqs=generation.max_num_seqs,
                seed=args.seed,
                trust_remote_code=generation.trust_remote_code,
            )

        with _generation_class(functools.partial(ColocatedGeneration, engine_factory=engine_factory)):
            super().__init__(model, reward_funcs, args, **kwargs)

    @property
    def engine(self) -> Engine:
        return self.vllm_generation.engine

    def close(self) -> None:
        """Shut the engine down and return its memory. Safe to call twice."""
        self.engine.close()

    def __enter__(self) -> ColocateGRPOTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
