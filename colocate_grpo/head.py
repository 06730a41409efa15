"""The trainer's fp32 head: TRL's fused head computing the logits in fp32, its GEMMs on TF32 tensor cores.

``trl.cast_lm_head_to_fp32`` computes the logits in fp32 from the head's bf16 (or fp16) weights, as the
engine's fp32 head does. TRL's fused head then runs fp32 GEMMs (152k x 3584 at 7B, three per micro-batch
with the backward), which without TF32 take the device's slow fp32 path: 1.38x the 7B step on an H200.

TF32 loses nothing in the forward here: its inputs keep 10 mantissa bits, bf16 values have 7 (fp16 10),
so the hidden states and weights reach the tensor cores unrounded, their products are exact in fp32, and
the sums accumulate in fp32, as an IEEE fp32 GEMM's do. In the backward, the logits' gradient (an fp32
tile) is rounded to TF32 before its GEMMs: a smaller error than the bf16 rounding that TRL's bf16 head
applies to the same tile, and than the rounding of the hidden states' gradient to bf16 that follows.

TF32 stays off everywhere else: the backbone's own fp32 matmuls (the rotary angles, position x inverse
frequency) would lose bits under it, and the engine computes them in IEEE fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import trl.trainer.utils as trl_utils
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import add_fused_lm_head


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """CUDA fp32 matmuls on TF32 tensor cores inside the block; the previous setting after it."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


class TF32ChunkedLogProb(ChunkedLogProbFunction):
    """TRL's chunked log-probabilities of ``hidden @ weight.T``, forward and backward under :func:`tf32_matmuls`.

    The backward runs when autograd reaches it, after the forward's call has returned: the setting travels
    with the function rather than with the call.
    """

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        with tf32_matmuls():
            return ChunkedLogProbFunction.forward(ctx, *args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        with tf32_matmuls():
            return ChunkedLogProbFunction.backward(ctx, *grads)


@contextlib.contextmanager
def _tf32_fused_head() -> Iterator[None]:
    """TRL's fused head looks its function up by module-global name at each call: ours while the call runs."""
    original = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = TF32ChunkedLogProb
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = original


def add_fp32_head(model: Any, temperature: float, outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """Give ``model`` TRL's fused head in fp32 (``model(..., labels=..., fused_lm_head=True)``), on TF32 cores.

    Args:
        model: the transformers model (for a PEFT model, its base model), patched in place. Its head's
            weights stay in the model's dtype: no fp32 copy is made, so a tied head stays tied.
        temperature: the sampling temperature the logits are divided by.
        outputs: the per-token fields the fused head computes (``"log_probs"``, ``"entropy"``, ...).
    """
    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=True, outputs=outputs)
    fused_forward = model.forward

    @functools.wraps(fused_forward)
    def forward(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return fused_forward(*args, **kwargs)
        with _tf32_fused_head():
            return fused_forward(*args, fused_lm_head=True, **kwargs)

    model.forward = forward
