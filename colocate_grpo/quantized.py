"""A 4-bit base on both sides, one copy: the trainer computes with the NF4 codes the engine serves.

The engine quantizes the bf16 checkpoint with bitsandbytes as it loads (vLLM's in-flight
bitsandbytes quantization: NF4, blocks of 64; it keeps the blocks' scales in fp32). The trainer
reads nothing of the checkpoint but its config: :func:`empty_4bit_model` builds the model with
bitsandbytes 4-bit linear layers that hold no weights, and :func:`share_4bit_base` makes each of
them a view of its part of the engine's codes, with the engine's scales. Embeddings, head, norms
and biases become views of the engine's parameters as an unquantized shared base does
(:mod:`colocate_grpo.shared_base`). The engine keeps its weights pinned, so nothing ever writes them.

vLLM keeps the codes of a fused projection (q/k/v, gate/up) one part after another in one tensor,
each part quantized on its own (``bnb_shard_offsets``), and computes each part with bitsandbytes'
``matmul_4bit`` on its slice, as the trainer's layer does on the same slice.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from colocate_grpo.config import ConfigError
from colocate_grpo.engine import Engine, parameter_views
from colocate_grpo.sync import frozen_base, hf_name


def empty_4bit_model(path: str, dtype: torch.dtype, device: str) -> Any:
    """The model at ``path`` with no weights: every linear layer but the head a bitsandbytes NF4 layer.

    Parameters are on the meta device, except the 4-bit layers' weights, which are empty tensors on
    ``device`` (PEFT creates each adapter where its base layer's weight is). Buffers are real.
    :func:`share_4bit_base` gives every parameter the engine's memory.
    """
    from accelerate import init_empty_weights
    from bitsandbytes.nn import Linear4bit, Params4bit
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child is head:
                continue
            layer = Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=dtype,
                compress_statistics=False,
                quant_type="nf4",
                device="meta",
            )
            layer.weight = Params4bit(
                torch.empty(0, dtype=torch.uint8, device=device),
                quant_type="nf4",
                compress_statistics=False,
                module=layer,
                bnb_quantized=True,  # never quantize this placeholder: the engine's codes replace it
            )
            setattr(module, child_name, layer)
    model.tie_weights()  # from_pretrained ties a tied head; from_config on the meta device does not
    # The checkpoint's generation settings (its end-of-turn ids), as from_pretrained reads them, where it has any.
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.name_or_path = path
    model.is_loaded_in_4bit = True  # what transformers sets: PEFT wraps the layers with its 4-bit LoRA, TRL sees QLoRA
    return model


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The trainer's bitsandbytes 4-bit linear layers, by Hugging Face module name."""
    from bitsandbytes.nn import Params4bit

    return {
        hf_name(f"{name}.weight").removesuffix(".weight"): module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), Params4bit)
    }


def engine_codes(engine: Engine) -> dict[str, tuple[torch.Tensor, Any]]:
    """Every 4-bit part of the engine's model, by Hugging Face module name: its codes (bytes x 1, a view of
    the engine's tensor) and its bitsandbytes ``QuantState`` (shape, block size, fp32 block scales)."""
    packed = getattr(engine.model, "packed_modules_mapping", None) or {}
    parts = {}
    for name, module in engine.model.named_modules():
        weight = getattr(module, "weight", None)
        states = getattr(weight, "bnb_quant_state", None)
        if states is None:
            continue
        prefix, _, leaf = name.removesuffix(".base_layer").rpartition(".")
        codes = weight.data.view(-1, 1)
        if not isinstance(states, dict):  # a projection of its own: one part
            states, offsets = {0: states}, [0, codes.shape[0]]
        else:
            offsets = weight.bnb_shard_offsets.tolist()
        for index, part in enumerate(packed.get(leaf, [leaf])):
            if index in states:
                parts[f"{prefix}.{part}"] = (codes[offsets[index] : offsets[index + 1]], states[index])
    return parts


@torch.no_grad()
def share_4bit_base(model: torch.nn.Module, engine: Engine) -> int:
    """Give every base parameter of ``model`` (:func:`empty_4bit_model`, with its adapter) the engine's memory.

    Returns the bytes of the engine's weights the trainer now computes with: the base it does not hold.

    Raises:
        ConfigError: where the engine's model does not line up with the trainer's (a layer vLLM did not
            quantize, or laid out differently), before anything was trained.
    """
    from bitsandbytes.nn import Params4bit

    served = engine_codes(engine)
    layers = quantized_layers(model)
    unserved = sorted(set(layers) - set(served))
    if unserved:
        raise ConfigError(
            f"'load_in_4bit: true': vLLM did not quantize {len(unserved)} of this model's linear layers as the "
            f"trainer does (first: {unserved[0]}), so the two cannot share one 4-bit base. Remove 'load_in_4bit' "
            "(with 'trl.vllm_lora_sync: true' the bf16 base is shared instead)."
        )
    shared = 0
    for name, layer in layers.items():
        codes, state = served[name]
        layer.weight = Params4bit(
            codes,
            quant_state=state,
            blocksize=state.blocksize,
            compress_statistics=False,
            quant_type=state.quant_type,
            quant_storage=codes.dtype,
            module=layer,
            bnb_quantized=True,
        )
        shared += codes.nbytes + state.absmax.nbytes
    rest = {name: param for name, param in frozen_base(model).items() if not isinstance(param, Params4bit)}
    views = parameter_views(engine.model, {name: tuple(param.shape) for name, param in rest.items()})
    if views is None:
        raise ConfigError(
            "'load_in_4bit: true': the engine's embeddings, norms or biases do not line up with this model's, so "
            "the two cannot share one 4-bit base. Remove 'load_in_4bit' (with 'trl.vllm_lora_sync: true' the bf16 "
            "base is shared instead)."
        )
    replacement = {id(param): torch.nn.Parameter(views[name].rows, requires_grad=False) for name, param in rest.items()}
    for module in model.modules():  # every module holding one: a tied head is the embedding's parameter
        for leaf, param in list(module._parameters.items()):
            if param is not None and id(param) in replacement:
                module._parameters[leaf] = replacement[id(param)]
    return shared + sum(view.rows.nbytes for view in views.values())


@torch.no_grad()
def served_code_mismatches(model: torch.nn.Module, engine: Engine) -> list[str]:
    """Names of the trainer's 4-bit layers whose codes or block scales differ, bitwise, from the engine's.

    Empty when the engine serves exactly the trainer's 4-bit base. A trainer layer the engine holds
    no quantized weight for counts as a mismatch.
    """
    served = engine_codes(engine)
    mismatches = []
    for name, layer in quantized_layers(model).items():
        codes, state = served.get(name, (None, None))
        trained = layer.weight.quant_state
        same = (
            codes is not None
            and torch.equal(codes.view(-1), layer.weight.data.view(-1))
            and tuple(state.shape) == tuple(trained.shape)
            and (state.blocksize, state.quant_type) == (trained.blocksize, trained.quant_type)
            and torch.equal(state.absmax, trained.absmax)
        )
        if not same:
            mismatches.append(name)
    return mismatches
