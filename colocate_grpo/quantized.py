"""A 4-bit base on both sides: the trainer's bitsandbytes NF4 weights against the engine's, bitwise.

The trainer loads the checkpoint with transformers' bitsandbytes quantization set as vLLM's in-flight
quantization is (``models.load_model``: NF4, blocks of 64, the blocks' scales quantized again); the
engine quantizes the same checkpoint as it loads. Both run bitsandbytes' ``quantize_4bit`` on the
same bf16 tensors, so they should hold the same codes and the same scales. vLLM keeps the codes of
a fused projection (q/k/v, gate/up) one part after another in one tensor, each part quantized on its
own (``bnb_shard_offsets``), and undoes the scales' second quantization as it loads; the comparison
undoes it on the trainer's side the same way.
"""

from __future__ import annotations

import torch

from colocate_grpo.engine import Engine
from colocate_grpo.sync import hf_name


def _scales(state: object) -> torch.Tensor:
    """A QuantState's block scales in fp32, its double quantization undone as vLLM's loader undoes it."""
    if not state.nested:
        return state.absmax
    from bitsandbytes.functional import dequantize_blockwise

    absmax = dequantize_blockwise(state.absmax, state.state2)
    absmax += state.offset
    return absmax.float()


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The trainer's bitsandbytes 4-bit linear layers, by Hugging Face module name."""
    from bitsandbytes.nn import Params4bit

    return {
        hf_name(f"{name}.weight").removesuffix(".weight"): module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), Params4bit)
    }


@torch.no_grad()
def served_code_mismatches(model: torch.nn.Module, engine: Engine) -> list[str]:
    """Names of the trainer's 4-bit layers whose codes or block scales differ, bitwise, from the engine's.

    Empty when the engine serves exactly the trainer's 4-bit base. A trainer layer the engine holds
    no quantized weight for counts as a mismatch.
    """
    trained = quantized_layers(model)
    packed = getattr(engine.model, "packed_modules_mapping", None) or {}
    mismatches = []
    for name, module in engine.model.named_modules():
        weight = getattr(module, "weight", None)
        states = getattr(weight, "bnb_quant_state", None)
        if states is None:
            continue
        prefix, _, leaf = name.removesuffix(".base_layer").rpartition(".")
        codes = weight.data.view(-1)
        if not isinstance(states, dict):  # a projection of its own: one part
            states, offsets = {0: states}, [0, codes.numel()]
        else:
            offsets = weight.bnb_shard_offsets.tolist()
        for index, part in enumerate(packed.get(leaf, [leaf])):
            layer = trained.pop(f"{prefix}.{part}", None)
            if layer is None or index not in states:
                continue
            served, trained_state = states[index], layer.weight.quant_state
            same = (
                torch.equal(codes[offsets[index] : offsets[index + 1]], layer.weight.data.view(-1))
                and tuple(served.shape) == tuple(trained_state.shape)
                and (served.blocksize, served.quant_type) == (trained_state.blocksize, trained_state.quant_type)
                and torch.equal(served.absmax, _scales(trained_state))
            )
            if not same:
                mismatches.append(f"{prefix}.{part}")
    return mismatches + sorted(trained)
