"""The memory plan's arithmetic on known shapes, and the refusal when a run cannot fit."""

import subprocess
import sys

import torch

from colocate_grpo.config import Config, load_config
from colocate_grpo.memory_plan import (
    ACTIVATION_MARGIN_BYTES,
    CUDA_GRAPH_BYTES,
    GIB,
    MemoryPlan,
    ModelShape,
    kv_cache_bytes,
    refusal,
)
from colocate_grpo.plan import DeviceMemory, RunPlan, plan_run
from colocate_grpo.serving import Serving
from colocate_grpo.train import default_config_path, grpo_args

# A Qwen2.5-1.5B-like shape: 28 layers, hidden 1536, 2 KV heads of 128, one linear of each kind per layer.
SHAPE = ModelShape(
    parameters=1_500_000_000,
    linear_shapes=[("model.layers.0.self_attn.q_proj", 1536, 1536), ("model.layers.0.mlp.up_proj", 8960, 1536)],
    layers=28,
    hidden_size=1536,
    intermediate_size=8960,
    vocab_size=151936,
    kv_values_per_token=2 * 28 * 2 * 128,
)
BYTES_PER_TOKEN = 2 * 28 * 2 * 128 * 2  # keys and values of every layer, bf16


def gpu_run_plan(
    config: Config, free: int, total: int, host_free: int | None = None, longest_prompt: int | None = None
) -> RunPlan:
    """The run plan of ``config`` on SHAPE, on a GPU with ``free`` of ``total`` bytes."""
    return plan_run(
        config,
        grpo_args(config, "cpu", torch.bfloat16),
        model_path="shape-only",
        device="cuda",
        dtype=torch.bfloat16,
        shape=SHAPE,
        longest_prompt=longest_prompt,
        memory=DeviceMemory(free, total, host_free),
    )


def gpu_plan(
    config: Config, free: int, total: int, host_free: int | None = None, longest_prompt: int | None = None
) -> MemoryPlan:
    """The memory plan of a run of ``config`` on SHAPE, on a GPU with ``free`` of ``total`` bytes."""
    return gpu_run_plan(config, free, total, host_free, longest_prompt).memory


def refused(plan: MemoryPlan, config: Config) -> str:
    return refusal(plan, config, serves_adapter=bool(config.trl.get("vllm_lora_sync")))


def test_the_plan_adds_up_the_known_parts():
    config = load_config({"micro_batch_size": 64, "trl": {"max_completion_length": 256}})
    plan = gpu_plan(config, free=80 * GIB, total=80 * GIB)
    adapter = 16 * ((1536 + 1536) + (8960 + 1536)) * 4  # r x (out + in) per adapted linear, fp32
    assert plan.trainer_weights == adapter  # the base weights are the engine's: one copy
    assert plan.trainer_states == 3 * adapter  # gradients and AdamW's two moments
    assert plan.engine_weights == 1_500_000_000 * 2
    # Merged serving merges into the shared base in place: a byte per adapted weight restores it, with room to spare.
    assert plan.merge_record == int((1536 * 1536 + 8960 * 1536) * 1.2)
    assert plan.kv_cache == kv_cache_bytes(BYTES_PER_TOKEN, 64, 512 + 256)
    assert plan.kv_cache == 28672 * 64 * (13 * 64)  # 768 tokens round up to 832 with a block to spare
    assert plan.engine_runtime == ACTIVATION_MARGIN_BYTES + CUDA_GRAPH_BYTES  # CUDA graphs on by default
    parts = [plan.trainer_weights, plan.trainer_states, plan.engine_weights, plan.merge_record, plan.kv_cache]
    assert plan.generation_peak == sum(parts) + plan.engine_runtime
    assert plan.fits and "GiB while generating" in plan.summary()


def test_the_kv_cache_and_activations_are_sized_by_the_longest_prompt():
    # Checkpointing fixed: where the plan decides it, the longer sequences may turn it on.
    raw = {"micro_batch_size": 64, "gradient_checkpointing": True, "trl": {"max_completion_length": 256}}
    config = load_config(raw)
    short = gpu_plan(config, free=80 * GIB, total=80 * GIB, longest_prompt=32)
    assert short.kv_cache == kv_cache_bytes(BYTES_PER_TOKEN, 64, 32 + 256)
    full = gpu_plan(config, free=80 * GIB, total=80 * GIB)
    assert short.activations < full.activations
    # Never past the engine's budget: a prompt longer than max_prompt_length is refused before the plan.
    longer = gpu_plan(config, free=80 * GIB, total=80 * GIB, longest_prompt=10_000)
    assert longer.kv_cache == full.kv_cache == kv_cache_bytes(BYTES_PER_TOKEN, 64, 512 + 256)


def test_the_kv_cache_holds_one_sequence_of_max_model_len_however_short_the_prompts():
    # vLLM does not start with less: the generation batch, 8 sequences of 32 + 256 tokens, are fewer than one of
    # 32768.
    config = load_config({"vllm": {"max_model_len": 32768}, "micro_batch_size": 8, "gradient_accumulation_steps": 1})
    plan = gpu_plan(config, free=80 * GIB, total=80 * GIB, longest_prompt=32)
    assert plan.kv_cache == kv_cache_bytes(BYTES_PER_TOKEN, 1, 32768) > kv_cache_bytes(BYTES_PER_TOKEN, 8, 32 + 256)


def test_an_adapter_served_on_the_shared_base_needs_no_merge_record():
    config = load_config({"trl": {"vllm_lora_sync": True}})
    plan = gpu_plan(config, free=80 * GIB, total=80 * GIB)
    assert plan.merge_record == 0 and plan.trainer_weights == 16 * ((1536 + 1536) + (8960 + 1536)) * 4


def test_full_fine_tuning_counts_gradients_and_optimizer_states_of_every_weight():
    plan = gpu_plan(load_config({"adapter": None}), free=80 * GIB, total=80 * GIB)
    assert plan.trainer_states == 3 * plan.trainer_weights
    assert plan.trainer_weights == plan.engine_weights and plan.merge_record == 0  # two copies: the trainer's change


def test_a_run_that_cannot_fit_is_refused_with_its_numbers_and_fixes():
    config = load_config({})
    # The weights (2.8 GiB) and the engine's runtime (3 GiB) leave no room for one sequence's KV cache.
    plan = gpu_plan(config, free=int(5.5 * GIB), total=int(5.5 * GIB))
    assert not plan.fits
    message = refused(plan, config)
    assert "GiB more than the 5.5 GiB free" in message
    assert "micro_batch_size" in message and "max_completion_length" in message and "base_model" in message


def test_cli_check_refuses_a_plan_that_cannot_fit_with_exit_2(tmp_path):
    # A GPU of 1 GiB, as the planner sees it: the tiny model's engine alone needs its runtime's 3 GiB.
    script = f"""
import sys, torch
from colocate_grpo.train import main  # imported first: bitsandbytes, where installed, loads its CUDA ops on a GPU
torch.cuda.is_available = lambda: True
torch.cuda.is_bf16_supported = lambda *a, **k: True
torch.cuda.mem_get_info = lambda *a: (2**30, 2**30)
torch.cuda.set_device = lambda *a: None  # TRL's GRPOConfig picks its device before the plan is made
sys.exit(main(["--check", {str(default_config_path())!r}]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "config error: This run needs" in result.stderr and "Fixes:" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_4bit_base_keeps_its_nf4_values_in_bf16_where_they_fit_and_its_codes_where_only_they_fit():
    config = load_config({"load_in_4bit": True})
    adapter = 16 * ((1536 + 1536) + (8960 + 1536)) * 4
    roomy = gpu_run_plan(config, free=80 * GIB, total=80 * GIB)
    assert roomy.nf4_values and roomy.serving is Serving.ADAPTER and roomy.engine.quantization is None
    assert roomy.memory.engine_weights == 1_500_000_000 * 2  # the NF4 values in bf16
    assert not roomy.training.gradient_checkpointing
    assert "4-bit base: its NF4 values" in roomy.summary()
    # A card the values fit on only with gradient checkpointing (the codes, 23 MB smaller, would train without it):
    # still the values, whose bf16 kernels gain more than checkpointing costs.
    free = roomy.memory.peak - 10 * 2**20
    tight = gpu_run_plan(config, free=free, total=free)
    assert tight.nf4_values and tight.memory.fits and tight.training.gradient_checkpointing
    # Just under the smallest card the values fit on (to the MiB; SHAPE's two linears save 23 MB in NF4): the NF4
    # codes, counted at their size, once.
    values_run, codes_run = free, GIB
    while values_run - codes_run > 2**20:
        middle = (values_run + codes_run) // 2
        if gpu_run_plan(config, free=middle, total=middle).nf4_values:
            values_run = middle
        else:
            codes_run = middle
    small = gpu_run_plan(config, free=codes_run, total=codes_run)
    assert not small.nf4_values and small.serving is Serving.QUANTIZED_BASE and small.memory.fits
    linear = 1536 * 1536 + 8960 * 1536
    assert small.memory.engine_weights == 1_500_000_000 * 2 - linear * 2 + int(linear * (0.5 + 4 / 64))
    assert small.memory.trainer_weights == adapter  # the trainer computes with the engine's 4-bit base
    assert "4-bit base: its NF4 values" not in small.summary()


def test_the_refusal_offers_the_shared_base_and_a_4bit_base():
    config = load_config({})
    message = refused(gpu_plan(config, free=int(5.5 * GIB), total=int(5.5 * GIB)), config)
    assert "'trl.vllm_lora_sync: true'" in message and "'load_in_4bit: true'" in message


def test_the_fp32_head_adds_its_working_memory_to_the_activations():
    raw = {"micro_batch_size": 8, "trl": {"max_completion_length": 256}}
    bf16 = gpu_plan(load_config(raw), free=80 * GIB, total=80 * GIB)
    raw["trl"]["cast_lm_head_to_fp32"] = True
    fp32 = gpu_plan(load_config(raw), free=80 * GIB, total=80 * GIB)
    completion = 8 * 256  # TRL's fused head scores the completion tokens, 32768 vocabulary entries at a time
    bf16_tile = completion * 32768 * 2
    fp32_tile = completion * 32768 * 4
    head_tile_copy = 32768 * 1536 * 4  # one vocabulary tile of the head's weights in fp32
    hidden_and_gradient = 2 * completion * 1536 * 4
    assert fp32.activations - bf16.activations == fp32_tile + head_tile_copy + hidden_and_gradient - bf16_tile
    assert fp32.generation_peak == bf16.generation_peak  # the engine's fp32 logits are in its runtime margin


def test_the_bitwise_modes_head_adds_its_chunk_of_whole_vocabulary_logits_to_the_activations():
    raw = {"micro_batch_size": 64, "trl": {"max_completion_length": 256}}
    default = gpu_plan(load_config(raw), free=80 * GIB, total=80 * GIB)
    raw["trl"]["vllm_bitwise_logprobs"] = True
    bitwise = gpu_plan(load_config(raw), free=80 * GIB, total=80 * GIB)
    trl_tile = 4096 * 32768 * 2  # TRL's fused head: 4096 of the 64 x 256 completion tokens, 32768 entries at a time
    chunk = 1024 * 151936 * 16  # 1024 tokens over the whole vocabulary: bf16 and fp32 logits, log-softmax and exp
    assert bitwise.activations - default.activations == chunk - trl_tile
    assert bitwise.generation_peak == default.generation_peak


def test_a_merge_record_the_device_cannot_hold_goes_to_host_memory_where_it_fits():
    config = load_config({})
    merged_weights = 1536 * 1536 + 8960 * 1536
    on_device = gpu_plan(config, free=80 * GIB, total=80 * GIB)
    short = on_device.generation_peak - on_device.merge_record // 2  # the record does not fit; its outliers would
    on_host = gpu_plan(config, free=short, total=short, host_free=64 * GIB)
    assert on_host.fits and on_host.merge_record_host == merged_weights
    assert on_host.merge_record == int(merged_weights * 0.2)  # the values a byte cannot record stay on the device
    assert "more in host memory" in on_host.summary()
    # A device short even so: refused with the host plan's need, the smaller one.
    tiny = short // 2
    refused_plan = gpu_plan(config, free=tiny, total=tiny, host_free=64 * GIB)
    assert not refused_plan.fits and refused_plan.merge_record_host == merged_weights
    assert refused_plan.generation_peak == on_host.generation_peak < on_device.generation_peak
    # A host without room beside the model as it loads, or no host figure at all: the device's plan, refused.
    host_free = 1_500_000_000 * 2 + merged_weights - 1
    # There the record stays on the device and the KV cache holds what fits beside it (vLLM queues the rest);
    # with no room for that either, the run is refused.
    shrunk = gpu_plan(config, free=short, total=short, host_free=host_free)
    assert shrunk.fits and shrunk.merge_record_host == 0 and shrunk.kv_cache < on_device.kv_cache
    tight = short - on_device.kv_cache
    cramped = gpu_plan(config, free=tight, total=tight, host_free=host_free)
    unknown = gpu_plan(config, free=tight, total=tight)
    for plan in (cramped, unknown):
        assert not plan.fits and plan.merge_record_host == 0 and plan.merge_record == on_device.merge_record
    # Where the host plan would not fit the device either, the refusal gives the device's numbers alone.
    assert "of available host memory" not in refused(cramped, config)
    assert "host memory" not in refused(refused_plan, config).split("Fixes:")[1]  # short of the device even so
    # A device that holds the record keeps it there; adapter serving has none.
    assert gpu_plan(config, free=80 * GIB, total=80 * GIB, host_free=64 * GIB) == on_device
    adapter = load_config({"trl": {"vllm_lora_sync": True}})
    assert gpu_plan(adapter, free=short, total=short, host_free=64 * GIB).merge_record == 0
