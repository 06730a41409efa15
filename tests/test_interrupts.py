"""A KeyboardInterrupt in each phase leaves a known engine state and exact base weights; the next run works."""

import pytest
import torch
from transformers import TrainerCallback

import colocate_grpo.sync as sync
from colocate_grpo.config import load_config
from colocate_grpo.engine import live_engine
from colocate_grpo.train import build_trainer, default_config_path, train

# Every test runs on an engine built under each of vLLM's CPU linear routes (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_gemm_route")


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
    """Ctrl-C part way through the second sync, on whichever path it takes: before the fourth tensor goes in place
    or through vLLM's loader; merged into a shared base, just after the fourth merge starts, or on a GPU just after
    the launch that merges every layer (nothing waited for)."""
    generation, tensors_sent = trainer.vllm_generation, []
    value, merge_into_base = sync._Source.value, sync._Source.merge_into_base
    merge_group = sync.MergedInPlace.merge_group
    sync_weights = generation.sync_weights

    def counting_sync():
        tensors_sent.append(0)
        return sync_weights()

    def fourth_of_second_sync():
        if len(tensors_sent) == 2:
            tensors_sent[-1] += 1
            return tensors_sent[-1] == 4
        return False

    def failing_value(source, stats, out=None):
        if fourth_of_second_sync():
            raise KeyboardInterrupt
        return value(source, stats, out)

    def failing_merge(source, merged, stats):
        fourth = fourth_of_second_sync()
        merge_into_base(source, merged, stats)
        if fourth:
            raise KeyboardInterrupt

    def failing_merge_group(merged, group):
        merge_group(merged, group)
        if len(tensors_sent) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(generation, "sync_weights", counting_sync)
    monkeypatch.setattr(sync._Source, "value", failing_value)
    monkeypatch.setattr(sync._Source, "merge_into_base", failing_merge)
    monkeypatch.setattr(sync.MergedInPlace, "merge_group", failing_merge_group)


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


class OutOfMemoryInTraining(TrainerCallback):
    """What torch raises when the backward pass of step 2 does not fit on the device."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("phase", ["generate", "train"])
def test_running_out_of_memory_in_a_trainer_names_the_phase_and_the_fixes(tmp_path, monkeypatch, phase):
    """Through build_trainer and trainer.train(), as a notebook or the benchmark runs it, not only the CLI."""
    from colocate_grpo.memory_plan import DeviceMemoryError

    trainer = build_trainer(tiny(tmp_path))
    if phase == "train":
        trainer.add_callback(OutOfMemoryInTraining())
    else:
        original, calls = trainer.vllm_generation.llm.generate, []

        def generate(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return original(*args, **kwargs)

        monkeypatch.setattr(trainer.vllm_generation.llm, "generate", generate)
    with pytest.raises(DeviceMemoryError) as raised:
        trainer.train()
    message = str(raised.value)
    assert f"The device ran out of memory during '{phase}'." in message and "Fixes:" in message
    assert ("micro_batch_size with more gradient_accumulation_steps" in message) is (phase == "train")
    trainer.engine.sleep()
    assert not trainer.engine.state.ready
