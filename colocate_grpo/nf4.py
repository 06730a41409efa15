"""A 4-bit base kept in bf16: QLoRA's NF4 values, without its 4-bit kernels.

QLoRA computes each linear layer with its weight quantized to NF4 (blocks of 64 weights, each with its fp32
absmax) and dequantized to the compute dtype for the matmul (bitsandbytes' ``matmul_4bit``): the model it trains
is the checkpoint with every linear weight but the head's rounded to its NF4 value. Where the device has room for
the base in bf16, the run plan keeps those values instead of the codes (``RunPlan.nf4_values``): the same model,
trained and served with bf16 kernels, one shared copy. vLLM's NF4 kernels generated 2.5x slower than bf16 at the
7B shape on an H100, and the trainer's ``matmul_4bit`` dequantizes every weight at every forward and backward.
The rounding is bitsandbytes' own quantize and dequantize, as a QLoRA model loaded by transformers uses.
"""

from __future__ import annotations

import torch

# NF4 as QLoRA uses it (transformers' BitsAndBytesConfig default with load_in_4bit, and vLLM's in-flight
# quantization): blocks of 64 weights, one fp32 absmax each, no double quantization.
BLOCK_SIZE = 64


@torch.no_grad()
def round_linears_to_nf4(model: torch.nn.Module) -> int:
    """Round the weight of every linear layer but the output head to its NF4 value, in place, in its own dtype;
    returns how many weights were rounded. Each weight is rounded on the GPU where there is one (the model may be in
    host memory), a layer at a time.
    """
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    head = model.get_output_embeddings()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rounded = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module is head:
            continue
        weight = module.weight
        codes, state = quantize_4bit(
            weight.to(device), blocksize=BLOCK_SIZE, compress_statistics=False, quant_type="nf4"
        )
        weight.copy_(dequantize_4bit(codes, state))
        rounded += weight.numel()
    return rounded
