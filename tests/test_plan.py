"""The run plan: one derivation of every setting, whether the run starts from a YAML config or a model."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from colocate_grpo import models
from colocate_grpo.config import load_config
from colocate_grpo.memory_plan import GIB, ModelShape, engine_bytes, kv_cache_bytes, model_shape
from colocate_grpo.plan import (
    MIN_NUM_SEQS,
    DeviceMemory,
    merge_aware_mode,
    plan_for_model,
    plan_run,
    serving_of,
)
from colocate_grpo.serving import Serving
from colocate_grpo.tiny import tiny_model_path
from colocate_grpo.train import check_inputs, grpo_args
from colocate_grpo.training_plan import BUSY_MICRO_BATCH_VALUES, TrainingPlan

TINY = {"max_steps": 2, "num_prompts": 16}


@pytest.mark.parametrize(
    ("raw", "serving"),
    [
        ({}, Serving.MERGE_AWARE),
        ({"lora_merge_aware": None}, Serving.MERGED),
        ({"trl": {"vllm_lora_sync": True}}, Serving.ADAPTER),
        ({"load_in_4bit": True}, Serving.QUANTIZED_BASE),
        ({"adapter": None}, Serving.FULL_WEIGHTS),
    ],
)
def test_each_way_of_serving_is_picked_where_expected(raw, serving):
    config = load_config(raw)
    assert serving_of(config, torch.bfloat16) is serving
    expected_mode = "bf16" if serving is Serving.MERGE_AWARE else None
    assert merge_aware_mode(config, torch.bfloat16) == expected_mode
    if serving is Serving.MERGE_AWARE:  # GPUs without bf16 (the T4) merge in fp16
        assert merge_aware_mode(config, torch.float16) == "fp16"


@pytest.mark.parametrize(
    ("raw", "serving"),
    [
        ({}, Serving.MERGE_AWARE),
        ({"lora_merge_aware": None}, Serving.MERGED),
        ({"trl": {"vllm_lora_sync": True}}, Serving.ADAPTER),
        ({"adapter": None}, Serving.FULL_WEIGHTS),
    ],
)
def test_the_yaml_and_the_direct_constructors_give_equal_plans(raw, serving):
    config = load_config({**TINY, **raw})
    inputs = check_inputs(config)
    assert inputs.plan.serving is serving
    model = models.load_model(config, inputs.plan, inputs.path)
    longest = models.check_prompt_lengths(inputs.dataset, inputs.tokenizer, config.max_prompt_length)
    direct = plan_for_model(
        model,
        inputs.args,
        vllm_options=config.vllm,
        serve_adapter=serving is Serving.ADAPTER,
        sequence_tokens=longest + inputs.args.max_completion_length,
    )
    # The memory each constructor finds free is read when it runs: after a full model moved to the device, less.
    assert dataclasses.replace(direct, memory=None) == dataclasses.replace(inputs.plan, memory=None)
    if inputs.plan.memory is not None:
        parts = ("trainer_weights", "trainer_states", "engine_weights", "kv_cache", "engine_runtime", "activations")
        assert all(getattr(direct.memory, part) == getattr(inputs.plan.memory, part) for part in parts)


def test_steps_per_generation_sizes_the_engine_batch_and_the_kv_cache_together():
    shape = ModelShape(
        parameters=1_000_000,
        linear_shapes=[("model.layers.0.mlp.up_proj", 256, 128)],
        layers=2,
        hidden_size=128,
        intermediate_size=256,
        vocab_size=1000,
        kv_values_per_token=2 * 2 * 2 * 64,
    )

    def plan(raw):
        config = load_config({"micro_batch_size": 32, **raw})
        args = grpo_args(config, "cpu", torch.bfloat16)
        memory = DeviceMemory(80 * GIB, 80 * GIB)
        return plan_run(config, args, model_path="-", device="cuda", dtype=torch.bfloat16, shape=shape, memory=memory)

    once = plan({})
    four = plan({"trl": {"steps_per_generation": 4}})
    # vLLM's batch limit is at least MIN_NUM_SEQS (its warm-up needs it); the KV cache holds the generation batch.
    assert (once.engine.generation_batch, once.engine.max_num_seqs) == (32, MIN_NUM_SEQS)
    assert (four.engine.generation_batch, four.engine.max_num_seqs) == (4 * 32, 4 * 32)
    tokens = 512 + 256
    for run in (once, four):
        needed = kv_cache_bytes(2 * 2 * 2 * 64 * 2, run.engine.generation_batch, tokens, tokens)
        assert run.engine.kv_cache_bytes == run.memory.kv_cache == needed
    assert four.memory.kv_cache == 4 * once.memory.kv_cache  # 128 sequences where 32 were


def test_a_checkpoint_stored_in_fp32_is_planned_at_the_engines_bf16_size(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    config = load_config({**TINY, "base_model": str(tmp_path)})
    args = grpo_args(config, "cpu", torch.bfloat16)
    shape = model_shape(str(tmp_path))
    total = 80 * GIB
    plan = plan_run(
        config,
        args,
        model_path=str(tmp_path),
        device="cuda",
        dtype=torch.bfloat16,
        shape=shape,
        memory=DeviceMemory(total, total),
    )
    files = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert plan.memory.engine_weights == shape.parameters * 2 < files  # bf16 as served, not fp32 as stored
    # The engine's memory fraction counts the same weights: one answer for both.
    engine = engine_bytes(plan.memory.engine_weights, plan.engine.kv_cache_bytes, cuda_graphs=True)
    assert plan.engine.memory_fraction == pytest.approx(engine / total)


def test_the_plan_is_printed_and_written_as_plain_values():
    plan = check_inputs(load_config(TINY)).plan
    summary = plan.summary()
    assert summary.startswith("Served as: merge-aware") and f"{plan.engine.generation_batch} sequences" in summary
    written = plan.to_dict()
    assert written["serving"] == "merge-aware" and written["engine"]["max_num_seqs"] == plan.engine.max_num_seqs
    assert written["engine"]["generation_batch"] == plan.engine.generation_batch
    assert dataclasses.is_dataclass(plan) and (plan.memory is None) is (plan.device == "cpu")  # a GPU's memory


def _qwen_shape(size: str) -> ModelShape:
    from transformers import Qwen2Config

    from colocate_grpo.memory_plan import shape_of

    hidden, intermediate, heads, kv_heads = {"1.5B": (1536, 8960, 12, 2), "7B": (3584, 18944, 28, 4)}[size]
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=28,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=152064,
        tie_word_embeddings=False,
    )
    return shape_of(config)


def _plan_on_card(raw, card_gib, size="7B"):
    config = load_config({"micro_batch_size": 64, "trl": {"max_completion_length": 256}, **raw})
    args = grpo_args(config, "cpu", torch.bfloat16)
    memory = DeviceMemory(int(card_gib * GIB), int(card_gib * GIB), host_free=64 * GIB)
    plan = plan_run(
        config,
        args,
        model_path="-",
        device="cuda",
        dtype=torch.bfloat16,
        shape=_qwen_shape(size),
        longest_prompt=32,
        memory=memory,
    )
    return config, plan


def test_a_micro_batch_that_does_not_fit_is_split_and_the_generation_batch_stays():
    config, plan = _plan_on_card({}, 24)
    training = plan.training
    assert plan.memory.fits and training.micro_batch_size < 64
    assert training.micro_batch_size * training.gradient_accumulation_steps == 64
    assert training.micro_batch_size * training.steps_per_generation == 64 == plan.engine.max_num_seqs
    assert "micro_batch_size 64 would need" in plan.summary()
    # TRL gets the plan's batch: the same generation batch and optimizer step, in smaller micro-batches.
    args = grpo_args(config, "cpu", torch.bfloat16, training)
    assert args.per_device_train_batch_size == training.micro_batch_size and args.generation_batch_size == 64
    assert args.gradient_checkpointing is training.gradient_checkpointing


def test_gradient_checkpointing_is_off_where_training_fits_without_it():
    _, roomy = _plan_on_card({}, 80, size="1.5B")
    assert roomy.training == TrainingPlan(64, 1, 1, gradient_checkpointing=False, one_forward=True)
    _, asked = _plan_on_card({"gradient_checkpointing": True}, 80, size="1.5B")
    assert asked.training == TrainingPlan(64, 1, 1, gradient_checkpointing=True, one_forward=True)
    # At 7B a busy micro-batch without checkpointing fits an 80 GiB card; a 24 GiB one needs checkpointing.
    _, split = _plan_on_card({}, 80)
    assert not split.training.gradient_checkpointing and split.memory.fits
    assert split.training.micro_batch_size * (32 + 256) * 3584 >= BUSY_MICRO_BATCH_VALUES
    _, tight = _plan_on_card({}, 24)
    assert tight.training.gradient_checkpointing and tight.memory.fits
    # Asked never to checkpoint, the plan splits the batch further instead.
    _, never = _plan_on_card({"gradient_checkpointing": False}, 24)
    assert not never.training.gradient_checkpointing and never.memory.fits
    assert never.training.micro_batch_size < tight.training.micro_batch_size


def test_a_run_whose_generation_does_not_fit_is_refused_at_the_batch_it_asked_for():
    _, plan = _plan_on_card({}, 12)
    assert not plan.memory.fits and plan.training.micro_batch_size == 64
    assert plan.memory.generation_peak > plan.memory.free


def test_on_a_cpu_the_plan_takes_the_batch_as_written_with_checkpointing_on_for_auto():
    plan = check_inputs(load_config({**TINY, "micro_batch_size": 16})).plan
    assert plan.training == TrainingPlan(16, 1, 1, gradient_checkpointing=True, one_forward=True)


def test_long_completions_get_a_kv_cache_for_part_of_the_batch_where_the_whole_does_not_fit():
    _, plan = _plan_on_card({"trl": {"max_completion_length": 16384}}, 24, size="1.5B")
    engine = plan.engine
    assert plan.memory.fits and plan.engine.max_num_seqs == 64
    assert 1 <= engine.full_length_sequences < 64 and "vLLM queues the rest" in plan.summary()
    assert engine.kv_cache_bytes == plan.memory.kv_cache
    # The engine still takes one sequence of max_model_len, as vLLM needs to start.
    assert engine.kv_cache_bytes >= kv_cache_bytes(2 * 28 * 2 * 128 * 2, 1, 0, engine.options.max_model_len)
