"""A KeyboardInterrupt in each phase leaves a known engine state and exact base weights; the next run works."""

import pytest
import torch
from transformers import TrainerCallback

from colocate_grpo.config import load_config
from colocate_grpo.engine import live_engine
from colocate_grpo.train import build_trainer, default_config_path, train


def tiny(tmp_path, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "max_steps": 3, "micro_batch_size": 16, **overrides})
    return load_config(raw)


class InterruptTraining(TrainerCallback):
    """Ctrl-C between the backward pass and the optimizer step of step 2."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise KeyboardInterrupt


def interrupt_generation(trainer, monkeypatch):
    original = trainer.vllm_generation.llm.generate
    calls = []

    def generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer.vllm_generation.llm, "generate", generate)


def interrupt_sync(trainer, monkeypatch):
    original = trainer.vllm_generation.llm.load_weights
    calls = []

    def load_weights(tensors):
        calls.append(1)
        if len(calls) == 2:

            def failing():
                for i, item in enumerate(tensors):
                    if i == 3:
                        raise KeyboardInterrupt
                    yield item

            return original(failing())
        return original(tensors)

    monkeypatch.setattr(trainer.vllm_generation.llm, "load_weights", load_weights)


@pytest.mark.parametrize("phase", ["generate", "sync", "train"])
def test_interrupt_in_each_phase_then_train_again(tmp_path, monkeypatch, phase):
    trainer = build_trainer(tiny(tmp_path / "first"), callbacks=[InterruptTraining()] if phase == "train" else None)
    if phase == "generate":
        interrupt_generation(trainer, monkeypatch)
    elif phase == "sync":
        interrupt_sync(trainer, monkeypatch)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    engine = trainer.engine
    assert not engine.state.ready, engine.state  # asleep, or refusing until the next sync
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    monkeypatch.undo()

    result = train(tiny(tmp_path / "second"))
    assert live_engine() is engine
    assert [step for step, _ in result.metrics.series("reward")] == [1, 2, 3]
