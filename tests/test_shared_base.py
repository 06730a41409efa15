"""One copy of the base weights: a LoRA run's frozen weights are the engine's, with the adapter served or merged.

Merged serving merges into the shared base in place for each generation; the trainer must find the
checkpoint's base bitwise after every step, and after an interrupt anywhere."""

import dataclasses

import pytest
import torch
from test_interrupts import InterruptTraining, interrupt_generation, interrupt_sync
from transformers import AutoModelForCausalLM, TrainerCallback

import colocate_grpo.adapters as adapters
import colocate_grpo.train as train_module
from colocate_grpo.config import load_config
from colocate_grpo.engine import Weights
from colocate_grpo.memory_plan import GIB, MemoryPlan
from colocate_grpo.shared_base import frozen_base, shares_base_weights
from colocate_grpo.sync import hf_name, served_weight_mismatches
from colocate_grpo.train import build_trainer, default_config_path, train

# Every test runs on an engine built under each of vLLM's CPU linear routes (conftest.py); on GPUs, with vLLM's
# sleep mode, whose KV cache sleeps alone.
pytestmark = pytest.mark.usefixtures("cpu_gemm_route")


# How the engine serves the policy: the adapter (vLLM's LoRA kernels) or merge-aware LoRA merged in place (the default).
SERVINGS = ["adapter", "merged"]
# The check each serving logs at every sync: the engine's LoRA buffers, or its merged weights, against the trainer's.
SERVED_CHECK = {"adapter": "lora_sync/served_equals_trained", "merged": "lora_merge/served_equals_trained"}


def shared_config(tmp_path, serving="adapter", **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "max_steps": 3, "micro_batch_size": 16, **overrides})
    raw["trl"].update({"vllm_lora_sync": serving == "adapter", "vllm_merge_check_interval": 1})
    return load_config(raw)


def checkpoint_base(trainer):
    """The base weights as the checkpoint holds them, in the training dtype, by Hugging Face name."""
    path = trainer.model.get_base_model().name_or_path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return {hf_name(name): p for name, p in model.named_parameters()}


def assert_base_is_the_checkpoints(trainer, reference):
    base = frozen_base(trainer.model)
    assert base.keys() <= reference.keys()
    for name, param in base.items():
        assert torch.equal(param.cpu(), reference[name]), name


@pytest.mark.parametrize("serving", SERVINGS)
def test_the_trainer_computes_with_the_engines_base_weights(tmp_path, serving, own_process):
    if not own_process:
        return
    trainer = build_trainer(shared_config(tmp_path, serving))
    generation = trainer.vllm_generation
    assert shares_base_weights(trainer.model, trainer.engine)
    assert generation.shared_base_bytes == sum(p.nbytes for p in frozen_base(trainer.model).values())
    assert ("one copy shared" if serving == "adapter" else "one copy of the base") in trainer.served_as
    reference = checkpoint_base(trainer)
    trainer.train()
    # The engine's KV cache slept alone between generations: the weights stayed, and after each generation they
    # were the checkpoint's base again (a merge lasts from a sync to the generation's end).
    assert trainer.engine.state.weights is Weights.RESIDENT and not trainer.engine.state.kv_cache_awake
    assert shares_base_weights(trainer.model, trainer.engine) and not generation.merged_in_place
    assert_base_is_the_checkpoints(trainer, reference)
    assert trainer.metrics.series(SERVED_CHECK[serving]) == [(1, 1.0), (2, 1.0), (3, 1.0)]
    if serving == "merged":
        # A fresh adapter (B = 0) changes nothing; then, at the tiny job's learning rate (300x an RL one), a few
        # percent of the merged weights move too far for a byte to record.
        outliers = [value for _, value in trainer.metrics.series("lora_merge/in_place_outliers")]
        assert outliers[0] == 0 and all(value < 0.1 for value in outliers)


def test_a_merge_in_place_is_served_and_a_generation_without_a_sync_merges_again(tmp_path, own_process):
    if not own_process:
        return
    trainer = build_trainer(shared_config(tmp_path, "merged", max_steps=1))
    trainer.train()
    generation, engine = trainer.vllm_generation, trainer.engine
    layer = next(m for m in trainer.model.modules() if hasattr(m, "merge_dtype"))
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.05)  # an update large enough to change the served weights
    generation.sync_weights()
    merged = dict(generation.merged_in_place.records)
    assert merged and trainer.engine.state.ready
    # The engine serves the merge of the base the trainer gets back, bitwise.
    assert served_weight_mismatches(trainer.model, engine, generation.merged_in_place) == []
    base = layer.base_layer.weight
    original = merged[base.data_ptr()].original()
    assert not torch.equal(original, base)
    generation.merged_in_place.restore()
    assert torch.equal(base, original)  # the trainer's base is back, bitwise
    prompt = trainer.processing_class("1+1=")["input_ids"]
    generation.generate([prompt, prompt], images=None, num_generations=1)
    assert not generation.merged_in_place and engine.state.weights is Weights.RESIDENT


def interrupt_adapter_sync(trainer, monkeypatch):
    """Ctrl-C in the second adapter write, after two layers' A were written."""
    calls, write = [], adapters.AdapterWrites.__call__

    def interrupted(writes, clear):
        calls.append(1)
        if len(calls) == 2:
            first = writes.views[:2]
            torch._foreach_copy_([v.a for v in first], [v.layer.lora_A["default"].weight for v in first])
            raise KeyboardInterrupt
        return write(writes, clear)

    monkeypatch.setattr(adapters.AdapterWrites, "__call__", interrupted)


@pytest.mark.parametrize("serving", SERVINGS)
@pytest.mark.parametrize("phase", ["generate", "sync", "train"])
def test_the_shared_base_is_unchanged_after_an_interrupt_in_each_phase_and_a_resume(
    tmp_path, monkeypatch, phase, serving, own_process
):
    if not own_process:
        return
    config = shared_config(tmp_path, serving, max_steps=3, save_steps=1)
    trainer = build_trainer(config, callbacks=[InterruptTraining()] if phase == "train" else None)
    if phase == "generate":
        interrupt_generation(trainer, monkeypatch)
    elif phase == "sync":
        (interrupt_adapter_sync if serving == "adapter" else interrupt_sync)(trainer, monkeypatch)
    reference = checkpoint_base(trainer)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert not trainer.engine.state.ready, trainer.engine.state
    assert_base_is_the_checkpoints(trainer, reference)
    monkeypatch.undo()

    at_end = []

    class BaseAtEnd(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            at_end.append({name: p.detach().cpu().clone() for name, p in frozen_base(model).items()})

    resumed = train(
        shared_config(tmp_path, serving, max_steps=3, save_steps=1, resume_from_checkpoint="latest"),
        callbacks=[BaseAtEnd()],
    )
    assert [step for step, _ in resumed.metrics.series("reward")][-1] == 3
    assert all(value == 1.0 for _, value in resumed.metrics.series(SERVED_CHECK[serving]))
    assert at_end and all(torch.equal(p, reference[name]) for name, p in at_end[0].items())


@pytest.fixture
def record_in_host_memory(monkeypatch):
    """A memory plan that keeps merged serving's record in host memory, as on a GPU short of a byte a merged weight."""
    nothing = dict.fromkeys((field.name for field in dataclasses.fields(MemoryPlan)), 0)
    memory = MemoryPlan(**{**nothing, "merge_record_host": 1, "free": GIB, "total": GIB})
    plan_run = train_module.plan_run
    monkeypatch.setattr(
        train_module, "plan_run", lambda *args, **kwargs: dataclasses.replace(plan_run(*args, **kwargs), memory=memory)
    )


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_merge_record_in_host_memory_serves_and_restores_the_shared_base(
    tmp_path, monkeypatch, record_in_host_memory, interrupted, own_process
):
    if not own_process:
        return
    trainer = build_trainer(shared_config(tmp_path, "merged"))
    generation = trainer.vllm_generation
    assert generation.merged_in_place.in_host_memory
    reference = checkpoint_base(trainer)
    if interrupted:
        interrupt_sync(trainer, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert_base_is_the_checkpoints(trainer, reference)
        return
    trainer.train()
    assert_base_is_the_checkpoints(trainer, reference)
    assert trainer.metrics.series(SERVED_CHECK["merged"]) == [(1, 1.0), (2, 1.0), (3, 1.0)]
    layer = next(m for m in trainer.model.modules() if hasattr(m, "merge_dtype"))
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=1e-3)  # an update a few units in the last place wide
    generation.sync_weights()
    base = layer.base_layer.weight
    record = generation.merged_in_place.records[base.data_ptr()]
    # The steps are in the host buffer the first sync allocated, reused, on a GPU pinned.
    host = generation.merged_in_place._host_steps[base.data_ptr()]
    assert record.steps is host and host.device.type == "cpu" and host.is_pinned() == torch.cuda.is_available()
    assert host.abs().max() > 0
    assert served_weight_mismatches(trainer.model, trainer.engine, generation.merged_in_place) == []
    generation.merged_in_place.restore()
    assert_base_is_the_checkpoints(trainer, reference)
