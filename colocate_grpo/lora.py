"""LoRA numerics: the merged weight, defined once.

The trainer's forward (merge-aware LoRA) and the weights sent to vLLM both call
:func:`merged_weight`, so what vLLM serves is bit for bit what is optimized.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer


def merged_weight(
    base: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``cast(W + scaling * B @ A)``, accumulated in fp32 and rounded once.

    Args:
        base: W, shape (out_features, in_features).
        lora_A: A, shape (r, in_features).
        lora_B: B, shape (out_features, r).
        scaling: lora_alpha / r (or alpha / sqrt(r) with rsLoRA).
        dtype: result dtype; defaults to ``base.dtype``.

    Returns:
        The merged weight, shape (out_features, in_features), in ``dtype``.
    """
    merged = torch.addmm(base.float(), lora_B.float(), lora_A.float(), alpha=scaling)
    return merged.to(dtype or base.dtype)


def lora_factors(layer: LoraLayer) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The active adapter's (A, B, scaling) of a PEFT LoRA layer, or None when adapters are off.

    Raises:
        ValueError: when several adapters are active (their merge is not one A, B pair).
    """
    if layer.disable_adapters or layer.merged:
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if not active:
        return None
    if len(active) > 1:
        raise ValueError(f"Several LoRA adapters are active ({active}); activate one with set_adapter().")
    name = active[0]
    return layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
