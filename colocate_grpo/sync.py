"""Getting the trainer's weights into the colocated engine.

Each LoRA linear's merged weight is computed out of place, one layer at a time,
so the trainer's base weights are never touched and the extra memory is one
layer's weight, not a second model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer

from colocate_grpo.engine import Engine
from colocate_grpo.lora import lora_factors, merged_weight


def hf_name(peft_name: str) -> str:
    """A PEFT parameter name as the base model (and vLLM's loader) knows it."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@torch.no_grad()
def merged_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight the engine needs, under Hugging Face names, with LoRA merged in.

    Yields (name, tensor) in the model's parameter order, so fused groups (q, k, v; gate, up)
    arrive together. Merged tensors are fresh; the others are the trainer's own (read only).
    """
    lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        layer = lora_layers.get(layer_name)
        factors = lora_factors(layer) if layer is not None and leaf == "weight" else None
        if factors is None:
            yield hf_name(name), param.detach()
        else:
            lora_A, lora_B, scaling = factors
            yield hf_name(name), merged_weight(param, lora_A, lora_B, scaling)


def push_weights(model: torch.nn.Module, engine: Engine) -> None:
    """Send the trainer's current (merged) weights to the engine and drop its prefix cache."""
    engine.load_weights(merged_named_weights(model))
