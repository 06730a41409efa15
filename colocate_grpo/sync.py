"""Getting the trainer's weights into the colocated engine.

Each LoRA linear's merged weight is computed out of place, one layer at a time,
so the trainer's base weights are never touched and the extra memory is one
layer's weight, not a second model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer

from colocate_grpo.engine import Engine, Weights
from colocate_grpo.lora import RetainedUpdate, lora_factors, merged_weight


def hf_name(peft_name: str) -> str:
    """A PEFT parameter name as the base model (and vLLM's loader) knows it."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@torch.no_grad()
def merged_named_weights(
    model: torch.nn.Module, stats: RetainedUpdate | None = None, include_frozen: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight the engine needs, under Hugging Face names, with LoRA merged in.

    Yields (name, tensor) in the model's parameter order, so fused groups (q, k, v; gate, up)
    arrive together. Merged tensors are fresh (in the layer's merge dtype for merge-aware
    layers, so they equal its forward's weight bitwise); the others are the trainer's own.
    When ``stats`` is given, each merged layer's retained update is added to it. With
    ``include_frozen=False`` only tensors that training can change are yielded: LoRA-merged
    weights and parameters that require gradients.
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
            if include_frozen or param.requires_grad:
                yield hf_name(name), param.detach()
        else:
            lora_A, lora_B, scaling = factors
            merged = merged_weight(param, lora_A, lora_B, scaling, getattr(layer, "merge_dtype", None))
            if stats is not None:
                stats.add(param, scaling * (lora_B.float() @ lora_A.float()), merged)
            yield hf_name(name), merged


def push_weights(model: torch.nn.Module, engine: Engine, stats: RetainedUpdate | None = None) -> None:
    """Send the trainer's current (merged) weights to the engine and drop its prefix cache.

    Frozen tensors are sent only when the engine lost its weights (a level-2 sleep, a failed
    load): after a level-1 sleep, or awake, it still holds them.

    Args:
        stats: filled with the retained-update statistics of this sync when given.
    """
    engine_holds_frozen = engine.state.weights in (Weights.RESIDENT, Weights.OFFLOADED)
    engine.load_weights(merged_named_weights(model, stats, include_frozen=not engine_holds_frozen))


def _engine_tensor(
    engine_params: dict[str, torch.Tensor], packed: dict[str, list[str]], name: str, offsets: dict[str, int], rows: int
) -> torch.Tensor | None:
    """The rows of the engine's (possibly fused) parameter that hold HF tensor ``name``."""
    if name in engine_params:
        return engine_params[name][:rows]
    for fused, parts in packed.items():
        for part in parts:
            if f".{part}." in name:
                fused_name = name.replace(f".{part}.", f".{fused}.")
                start = offsets.get(fused_name, 0)
                offsets[fused_name] = start + rows
                param = engine_params.get(fused_name)
                return None if param is None else param[start : start + rows]
    return None


@torch.no_grad()
def served_weight_mismatches(model: torch.nn.Module, engine: Engine) -> list[str] | None:
    """HF names of the trainer's weights that differ, bitwise, from what the engine holds.

    An empty list means the engine serves exactly the trainer's (merged) weights. None when the
    engine's weights cannot be read back (vLLM on CPU may repack them into kernel formats).
    """
    vllm_model = engine.model
    engine_params = dict(vllm_model.named_parameters())
    packed = getattr(vllm_model, "packed_modules_mapping", {})
    offsets: dict[str, int] = {}
    mismatches = []
    for name, expected in merged_named_weights(model):
        served = _engine_tensor(engine_params, packed, name, offsets, expected.shape[0])
        if served is None or served.numel() == 0:
            if "lm_head" in name:  # tied to the embedding in the engine
                continue
            return None
        if served.shape != expected.shape or not torch.equal(served.to(expected.device), expected):
            mismatches.append(name)
    return mismatches


@torch.no_grad()
def save_merged(model: torch.nn.Module, directory: str | Path, tokenizer: Any = None) -> Path:
    """Write a plain Hugging Face model directory with the LoRA merged in.

    Its tensors are the ones a sync sends to the engine, so the checkpoint is bit for bit what
    vLLM served (with merge-aware LoRA: what the trainer optimized). Holds one copy of the model
    in CPU memory while writing.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` or by vLLM.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in merged_named_weights(model)}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
