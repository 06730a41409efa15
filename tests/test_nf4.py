"""A 4-bit base kept as its NF4 values in bf16 (colocate_grpo.nf4): QLoRA's model on bf16 kernels, one shared copy.

On a CPU a 4-bit base always takes this path (vLLM has no NF4 kernels there): the run trains the checkpoint with
its linear weights rounded to NF4 by bitsandbytes, as QLoRA computes them, and the engine serves those same values.
"""

import pytest
import torch
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from transformers import AutoModelForCausalLM

from colocate_grpo.config import load_config
from colocate_grpo.nf4 import round_linears_to_nf4
from colocate_grpo.serving import Serving
from colocate_grpo.shared_base import shares_base_weights
from colocate_grpo.sync import frozen_base, hf_name
from colocate_grpo.tiny import tiny_model_path
from colocate_grpo.train import build_trainer, default_config_path, train

# Every test runs on an engine built under each of vLLM's CPU linear routes (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_gemm_route")


def nf4_value(weight: torch.Tensor) -> torch.Tensor:
    """What QLoRA computes with for ``weight``: bitsandbytes' NF4 in blocks of 64, dequantized to its dtype."""
    codes, state = quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type="nf4")
    return dequantize_4bit(codes, state)


def checkpoint(dtype=torch.bfloat16):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=dtype)


def test_each_linear_weight_but_the_heads_becomes_its_nf4_value_and_nothing_else_changes():
    original, model = checkpoint(), checkpoint()
    model.lm_head = torch.nn.Linear(*reversed(model.lm_head.weight.shape), bias=False, dtype=torch.bfloat16)
    model.lm_head.weight.data.copy_(original.lm_head.weight)  # an untied head, which NF4 leaves alone too
    rounded = round_linears_to_nf4(model)
    linears = {name for name, m in original.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"}
    assert rounded == sum(original.get_submodule(name).weight.numel() for name in linears)
    before = dict(original.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        if name.removesuffix(".weight") in linears:
            assert torch.equal(param, nf4_value(before[name])), name
            assert not torch.equal(param, before[name]), name
        else:
            assert torch.equal(param, before[name]), name


@pytest.mark.usefixtures("cpu_gemm_route")
def nf4_config(tmp_path, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update({"output_dir": str(tmp_path / "run"), "max_steps": 2, "micro_batch_size": 16, "load_in_4bit": True})
    raw.update(overrides)
    raw["trl"]["vllm_merge_check_interval"] = 1
    return load_config(raw)


def test_a_4bit_base_on_a_cpu_trains_and_serves_its_nf4_values_from_one_shared_copy(tmp_path):
    trainer = build_trainer(nf4_config(tmp_path, save_steps=2))
    plan = trainer.plan
    assert plan.nf4_values and plan.serving is Serving.ADAPTER and plan.engine.quantization is None
    assert "4-bit base: its NF4 values" in plan.summary() and plan.to_dict()["nf4_values"] is True
    assert plan.engine.identity["load_in_4bit"] == "NF4 values in bf16"  # never reused for the checkpoint's values
    assert shares_base_weights(trainer.model, trainer.engine)
    reference = {name: p for name, p in checkpoint().named_parameters()}
    for name, param in frozen_base(trainer.model).items():
        is_linear = name.endswith("proj.weight")
        assert torch.equal(param, nf4_value(reference[name]) if is_linear else reference[name]), name
    trainer.train()
    assert trainer.metrics.series("lora_sync/served_equals_trained") == [(1, 1.0), (2, 1.0)]
    for name, param in frozen_base(trainer.model).items():  # the adapter trained; the NF4 base stayed as it was
        if name.endswith("proj.weight"):
            assert torch.equal(param, nf4_value(reference[hf_name(name)])), name
    # Its checkpoint resumes: the same serving ("4-bit base + adapter") whether codes or NF4 values held the base.
    resumed = train(nf4_config(tmp_path, max_steps=3, resume_from_checkpoint="latest"))
    assert resumed.metrics.series("lora_sync/served_equals_trained") == [(3, 1.0)]
