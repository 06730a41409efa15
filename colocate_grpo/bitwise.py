"""Bitwise log-probabilities: the trainer's forward built from the engine's own batch-invariant kernels (CUDA).

``trl.vllm_bitwise_logprobs: true`` (docs/bitwise.md). The engine runs in vLLM's batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``): every kernel on its forward path sums in an order that does not depend on the batch.
The trainer then computes its forward on the sampled sequences with those same kernels, in the same order, so the
log-probability of each sampled token is the engine's bit for bit:

- the linear layers through vLLM's ``linear_batch_invariant`` (its Triton persistent matmul, which vLLM's own
  linear layers and head call in the mode on every CUDA GPU; the ``aten::mm`` override it installs reaches the
  trainer's matmuls only on Ampere, and Hopper's cuBLAS keeps its own order), with q/k/v and gate/up merged as
  vLLM merges them (the matmul's tile sizes may depend on the output width);
- RMSNorm through vLLM's batch-invariant Triton kernel, and the residual add before it as a bf16 add. vLLM's fused
  add-RMSNorm CUDA kernel sizes its thread block by the number of tokens, so the engine's is replaced by the same
  two steps (:func:`patch_engine`);
- SiLU-and-mul through vLLM's ``_C.silu_and_mul``; the rotary embedding through the engine's own rotary module
  (its cos/sin cache); attention through vLLM's FlashAttention (``flash_attn_varlen_func``, the engine's version,
  ``num_splits=1`` as the engine calls it), each sequence unpadded with positions from 0, as the engine sees it;
- the head through ``linear_batch_invariant``, then the sampler's own steps: the logits in fp32, divided in place
  by a temperature tensor (a division, as vLLM's V1 sampler does, not a multiplication by its inverse), then
  ``log_softmax``, which the mode overrides with its Triton kernel for the engine and the trainer alike.

The engine runs vLLM's V1 model runner, whose sampler is those torch operations; the V2 runner computes the
log-probabilities in a fused Triton kernel of its own. Without ``torch.compile`` (compilation mode NONE) its
custom ops are the kernels above; CUDA graphs capture decode steps whole (``FULL_DECODE_ONLY``).

vLLM's kernels have no backward: each op here is an autograd function whose backward recomputes the op in a
reference implementation (fp32 where it matters), as TorchTitan's deterministic RL experiment does. Only the
forward must be bitwise; the gradient is an ordinary one.

Nothing here runs without CUDA: on a CPU the mode is refused before anything loads
(:data:`colocate_grpo.validation.CPU_REFUSAL`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from colocate_grpo.lora import MergeAwareLoraLinear, lora_factors, lora_gradients, merged_weight
from colocate_grpo.memory_plan import head_size

logger = logging.getLogger(__name__)

# vLLM's switch, and the V1 model runner (its sampler's log-softmax is the overridden torch op). Read by vLLM when
# the engine starts; set before, in this process.
ENGINE_ENV = {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
# Where vLLM keeps the mode's kernels: vLLM 0.26 (the GPU's), then newer ones.
_KERNEL_MODULES = ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant")
# The tokens the head scores at once: (tokens, vocabulary) fp32 logits, 0.6 GiB at Qwen2.5's 152k, and the
# log-softmax's and the entropy's temporaries as large (at 4096 tokens, a 1.5B step's peak was 14 GiB above the
# default's on an H100). The kernels are batch-invariant: the chunk changes no bit.
HEAD_CHUNK = 1024
# A decode step multiplies a few rows by each weight. vLLM's tiles of 128 x 128 outputs leave most of the GPU idle
# there (a 1536-wide layer is 12 tiles, on an H100's 132 SMs) while the step reads every weight. Rows up to
# DECODE_ROWS get tiles of DECODE_TILES instead: each output still sums its K in the same BLOCK_SIZE_K steps of the
# same instruction, so the bits are vLLM's (checked at start, :func:`patch_decode_tiles`).
DECODE_ROWS = 128
DECODE_TILES = {
    "BLOCK_SIZE_M": 64,
    "BLOCK_SIZE_N": 32,
    "BLOCK_SIZE_K": 64,
    "GROUP_SIZE_M": 8,
    "num_stages": 4,
    "num_warps": 4,
}


def engine_arguments(enforce_eager: bool) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for an engine in the mode: FlashAttention, no torch.compile (its custom ops, which
    the trainer calls, instead of Inductor's fusions), CUDA graphs for decode steps unless ``enforce_eager``."""
    compilation: dict[str, Any] = {"mode": 0}  # CompilationMode.NONE
    if not enforce_eager:
        compilation["cudagraph_mode"] = "FULL_DECODE_ONLY"
    return {"attention_backend": "FLASH_ATTN", "compilation_config": compilation}


def kernel_module() -> Any:
    """vLLM's batch-invariant kernels' module, where this vLLM keeps it."""
    for name in _KERNEL_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise RuntimeError(
        "trl.vllm_bitwise_logprobs: this vLLM has no batch-invariant kernels (looked in "
        f"{', '.join(_KERNEL_MODULES)}); it needs vLLM >= 0.26."
    )


def prepare_process() -> None:
    """Turn vLLM's batch-invariant mode on in this process, before its first CUDA matmul: the engine's switch, its
    cuBLAS settings (read once, when torch first uses cuBLAS) and its operator overrides (log-softmax, softmax,
    mean, bmm; mm and linear on Ampere), which then serve the trainer too. Safe to call twice.

    Raises:
        RuntimeError: without CUDA (the mode is refused earlier on a CPU).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("trl.vllm_bitwise_logprobs needs a CUDA GPU (docs/bitwise.md).")
    os.environ.update(ENGINE_ENV)
    kernels = kernel_module()
    kernels.init_batch_invariance()
    patch_engine(kernels)
    patch_decode_tiles(kernels)
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        logger.warning(
            "trl.vllm_bitwise_logprobs is not measured on this GPU (compute capability %d.%d): "
            "sampling/logp_equal_fraction shows whether it holds.",
            major,
            minor,
        )


def patch_engine(kernels: Any) -> None:
    """Make the engine's fused add-RMSNorm the trainer's: the bf16 add, then the batch-invariant Triton RMSNorm.

    vLLM's ``rms_norm_batch_invariant`` hands a residual to its fused CUDA kernel, whose thread block (and so the
    order its sum of squares is reduced in) depends on the number of tokens: the engine's decode steps and the
    trainer's whole sequences would differ. vLLM's RMSNorm looks the function up in its module at each call.
    """
    import vllm.model_executor.layers.layernorm as layernorm

    if getattr(layernorm.rms_norm_batch_invariant, "colocate_grpo", False):
        return
    triton_rms_norm = kernels.rms_norm_batch_invariant

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, residual: torch.Tensor | None = None
    ) -> Any:
        if residual is None:
            return triton_rms_norm(x, weight, eps)
        residual = x + residual
        return triton_rms_norm(residual, weight, eps), residual

    rms_norm.colocate_grpo = True  # type: ignore[attr-defined]
    rms_norm.triton_rms_norm = triton_rms_norm  # type: ignore[attr-defined]
    layernorm.rms_norm_batch_invariant = rms_norm


def patch_decode_tiles(kernels: Any) -> bool:
    """Route matmuls of up to :data:`DECODE_ROWS` bf16 rows to :data:`DECODE_TILES`, engine and trainer alike,
    where they give vLLM's own tiles' bits on this GPU (checked here on a (256, 1536) x (1536, 1024) product and its
    first 64 rows); else leave vLLM's. vLLM's ``matmul_batch_invariant`` looks ``matmul_persistent`` up in its
    module at each call. Returns whether the decode tiles are in use.
    """
    original = kernels.matmul_persistent
    if getattr(original, "colocate_grpo", False):
        return True
    # Read once per device, not at every decode step's matmuls.
    multiprocessors = functools.cache(lambda device: torch.cuda.get_device_properties(device).multi_processor_count)

    def small_tiles(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, width = a.shape[0], b.shape[1]
        out = torch.empty((rows, width), device=a.device, dtype=a.dtype)
        sms = multiprocessors(a.device)
        tiles = -(-rows // DECODE_TILES["BLOCK_SIZE_M"]) * -(-width // DECODE_TILES["BLOCK_SIZE_N"])
        kernels.matmul_kernel_persistent[(min(sms, tiles),)](
            a, b, out, bias, rows, width, a.shape[1],
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            NUM_SMS=sms, A_LARGE=a.numel() > 2**31, B_LARGE=b.numel() > 2**31, C_LARGE=out.numel() > 2**31,
            HAS_BIAS=bias is not None, **DECODE_TILES,
        )  # fmt: skip
        return out

    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 1536, device="cuda", generator=generator).bfloat16()
    b = (torch.randn(1024, 1536, device="cuda", generator=generator) / 40).bfloat16().t()
    vllms = original(a, b)
    if not (torch.equal(small_tiles(a, b), vllms) and torch.equal(small_tiles(a[:64], b), vllms[:64])):
        logger.warning("trl.vllm_bitwise_logprobs: decode steps keep vLLM's matmul tiles (smaller ones differ here).")
        return False

    def matmul_persistent(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if a.shape[0] <= DECODE_ROWS and a.dtype == torch.bfloat16:
            return small_tiles(a, b, bias)
        return original(a, b, bias)

    matmul_persistent.colocate_grpo = True  # type: ignore[attr-defined]
    kernels.matmul_persistent = matmul_persistent
    return True


# ---------------------------------------------------------------------------------------------------------------------
# The ops, each an autograd function: vLLM's kernel forward, a reference backward.


class _Linear(torch.autograd.Function):
    """``x @ W^T + b`` by vLLM's batch-invariant matmul; the backward by torch's matmuls."""

    @staticmethod
    def forward(ctx, x, weight, bias, kernel):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernel(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, rounded once: what vLLM's Triton RMSNorm computes, up to the order of its sum."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm by vLLM's batch-invariant Triton kernel; the backward through :func:`reference_rms_norm`."""

    @staticmethod
    def forward(ctx, x, weight, eps, kernel):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernel(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(ctx.needs_input_grad[0])
            w_ = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            out = reference_rms_norm(x_, w_, ctx.eps)
            inputs = [t for t in (x_, w_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad) if inputs else ())
        return (next(grads) if x_.requires_grad else None), (next(grads) if w_.requires_grad else None), None, None


def reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate, up]``, as vLLM's ``silu_and_mul`` computes it: silu in fp32, rounded."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate.float()).to(x.dtype) * up


class _SiluAndMul(torch.autograd.Function):
    """vLLM's ``_C.silu_and_mul``; the backward through :func:`reference_silu_and_mul`, in fp32."""

    @staticmethod
    def forward(ctx, x, kernel):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        kernel(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        gate, up = x.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = grad.float()
        grad_gate = g * up * sig * (1 + gate * (1 - sig))
        grad_up = g * gate * sig
        return torch.cat([grad_gate, grad_up], dim=-1).to(x.dtype), None


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of ``x`` (tokens, heads, head_dim) by ``cos``, ``sin`` (tokens, head_dim / 2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Rotary(torch.autograd.Function):
    """The engine's rotary kernel with its cos/sin table on copies of q and k; the backward rotates the
    gradients back (by the negative angles), in fp32."""

    @staticmethod
    def forward(ctx, positions, q, k, cos_sin_cache, rotary):  # noqa: ANN001, ANN205
        ctx.save_for_backward(positions, cos_sin_cache)
        ctx.q_shape, ctx.k_shape = q.shape, k.shape
        q_out, k_out = q.contiguous().clone(), k.contiguous().clone()
        rotary(positions, q_out.view(q.shape[0], -1), k_out.view(k.shape[0], -1))  # in place
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):  # noqa: ANN001, ANN205
        positions, cache = ctx.saved_tensors
        cos, sin = cache[positions].float().chunk(2, dim=-1)
        grad_q = None if grad_q is None else reference_rotary(grad_q, cos, -sin)
        grad_k = None if grad_k is None else reference_rotary(grad_k, cos, -sin)
        return None, grad_q, grad_k, None, None


class _Attention(torch.autograd.Function):
    """Causal attention over packed sequences by vLLM's FlashAttention, as the engine calls it (``num_splits=1``);
    the backward recomputes it with torch's scaled-dot-product attention, every sequence at once."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len, scale, attend):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale, ctx.max_len = scale, max_len
        return attend(q, k, v, cu_seqlens, max_len, scale)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, cu_seqlens = ctx.saved_tensors
        # Each packed token's sequence and position: the sequences right-padded to the longest, one attention call.
        # Causal, a token attends to its own sequence's tokens before it, never to the padding after its end; the
        # padding's rows get no gradient and give none.
        lengths = cu_seqlens.diff().long()
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths, output_size=len(q))
        position = torch.arange(len(q), device=q.device) - cu_seqlens.long()[sequence]
        with torch.enable_grad():
            parts = [t.detach().requires_grad_() for t in (q, k, v)]
            query, key, value = (
                t.new_zeros(len(lengths), ctx.max_len, *t.shape[1:]).index_put((sequence, position), t).transpose(1, 2)
                for t in parts
            )
            group = q.shape[1] // k.shape[1]  # query heads per key/value head
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=ctx.scale)
            grads = torch.autograd.grad(out.transpose(1, 2)[sequence, position], parts, grad)
        return *grads, None, None, None, None


def stacked_weight(
    bases: list[torch.Tensor], scalings: tuple[float | None, ...], factors: list[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """The weight a stack of layers computes with (vLLM's merged q/k/v or gate/up), their rows one after another:
    each frozen layer's base weight, each merge-aware LoRA layer's ``cast(W_i + s_i B_i A_i)`` (the weight the engine
    serves). ``scalings``: each layer's LoRA scaling, None without LoRA; ``factors``: A, B of the LoRA layers in
    order. Shape (sum of the layers' out features, in features), in ``dtype``."""
    weight = torch.empty(sum(w.shape[0] for w in bases), bases[0].shape[1], dtype=dtype, device=bases[0].device)
    pairs = iter(zip(factors[::2], factors[1::2], strict=True))
    start = 0
    with torch.no_grad():
        for base, scaling in zip(bases, scalings, strict=True):
            rows = weight[start : start + base.shape[0]]
            if scaling is None:
                rows.copy_(base)
            else:
                merged_weight(base, *next(pairs), scaling, dtype, out=rows)
            start += base.shape[0]
    return weight


class _LoraLinear(torch.autograd.Function):
    """``x @ W^T + b`` by vLLM's batch-invariant matmul, W the :func:`stacked_weight` of frozen base weights and
    merge-aware LoRA layers.

    The backward is merge-aware LoRA's (:func:`colocate_grpo.lora.lora_gradients`): each A_i and B_i get their
    gradient straight through the cast, in low rank, never forming the (out, in) dL/dW; W is built again rather than
    kept from the forward (all of a model's weights, over a forward). ``factors``: A_1, B_1, A_2, B_2, ... of the
    LoRA layers in order.
    """

    @staticmethod
    def forward(ctx, x, bias, kernel, bases, scalings, dtype, *factors):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, *factors)
        ctx.bases, ctx.scalings, ctx.dtype = bases, scalings, dtype
        return kernel(x, stacked_weight(bases, scalings, factors, dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, *factors = ctx.saved_tensors
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ stacked_weight(ctx.bases, ctx.scalings, factors, ctx.dtype)
        grad_b = flat_grad.sum(0) if ctx.needs_input_grad[1] else None
        pairs = iter(zip(factors[::2], factors[1::2], strict=True))
        grad_factors, start = [], 0
        for base, scaling in zip(ctx.bases, ctx.scalings, strict=True):
            if scaling is not None:
                rows = flat_grad[:, start : start + base.shape[0]]
                grad_factors.extend(lora_gradients(rows, flat_x, *next(pairs), scaling))
            start += base.shape[0]
        return grad_x, grad_b, None, None, None, None, *grad_factors


class _HeadLogProbs(torch.autograd.Function):
    """Log-probabilities of ``labels`` under ``hidden @ W^T / temperature``, as vLLM's V1 sampler computes them:
    the head by the batch-invariant matmul, the logits in fp32 divided in place by a temperature tensor, then
    ``log_softmax`` (the mode's Triton kernel). Also returns the entropy (no gradient). Chunked over tokens; the
    backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, kernel):  # noqa: ANN001, ANN205
        log_probs = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        entropy = torch.zeros_like(log_probs)
        for start in range(0, hidden.shape[0], HEAD_CHUNK):
            end = start + HEAD_CHUNK
            logp = _scaled_log_softmax(hidden[start:end], weight, temperature, kernel)
            log_probs[start:end] = logp.gather(-1, labels[start:end, None])[:, 0]
            entropy[start:end] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.kernel = temperature, kernel
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad, _):  # noqa: ANN001, ANN205
        hidden, weight, labels = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], HEAD_CHUNK):
            h = hidden[start : start + HEAD_CHUNK]
            logp = _scaled_log_softmax(h, weight, ctx.temperature, ctx.kernel)
            d_logits = -logp.exp()
            d_logits.scatter_add_(-1, labels[start : start + HEAD_CHUNK, None], torch.ones_like(d_logits[:, :1]))
            d_logits = (d_logits * grad[start : start + HEAD_CHUNK, None] / ctx.temperature).to(h.dtype)
            if grad_h is not None:
                grad_h[start : start + HEAD_CHUNK] = d_logits @ weight
            if grad_w is not None:
                grad_w += (d_logits.T @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def _scaled_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, kernel: Callable) -> Any:
    logits = kernel(hidden, weight, None).to(torch.float32)
    temperatures = torch.full((logits.shape[0], 1), temperature, dtype=torch.float32, device=logits.device)
    return logits.div_(temperatures).log_softmax(dim=-1, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's forward.


@dataclass(frozen=True)
class Kernels:
    """The engine's kernels the trainer's forward calls (:func:`engine_kernels`); ``cos_sin_cache`` is the trainer's
    copy of the engine's rotary table."""

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor, torch.Tensor], None]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
    cos_sin_cache: torch.Tensor
    attend: Callable[..., torch.Tensor]


def engine_kernels(llm: Any) -> Kernels:
    """The kernels of the engine ``llm`` (a ``vllm.LLM`` in the mode): vLLM's batch-invariant matmul and RMSNorm,
    its SiLU-and-mul, its rotary kernel (with a copy of the engine's table) and its FlashAttention call.

    Raises:
        RuntimeError: where the engine is not in the mode, or attends with another backend than FlashAttention.
    """
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from colocate_grpo.vllm_shims import model_runner

    kernels = kernel_module()
    import vllm.envs as envs
    import vllm.model_executor.layers.layernorm as layernorm

    if not envs.VLLM_BATCH_INVARIANT or not getattr(layernorm.rms_norm_batch_invariant, "colocate_grpo", False):
        raise RuntimeError(
            "trl.vllm_bitwise_logprobs: the engine was not started in vLLM's batch-invariant mode "
            "(colocate_grpo.bitwise.prepare_process must run before it starts)."
        )
    model = model_runner(llm).get_model()
    layer = model.model.layers[0].self_attn
    impl = layer.attn.impl
    backend = layer.attn.attn_backend.get_name()
    if backend != "FLASH_ATTN":
        raise RuntimeError(
            f"trl.vllm_bitwise_logprobs: the engine attends with {backend}; the trainer's forward reproduces "
            "FLASH_ATTN only."
        )
    fa_version = impl.vllm_flash_attn_version
    block_size = llm.llm_engine.vllm_config.cache_config.block_size

    def attend(q, k, v, cu_seqlens, max_len, scale):  # noqa: ANN001, ANN202
        # The keys and values in a paged cache laid out as the engine's (blocks of its block size, keys and values
        # side by side in the last dimension), read through a block table, as the engine's prefills and decode steps
        # read theirs: FlashAttention picks its tiles by the layout.
        lengths = cu_seqlens.diff()
        blocks = (lengths + block_size - 1) // block_size
        first_block = F.pad(blocks.cumsum(0), (1, 0))[:-1]
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
        offset = torch.arange(q.shape[0], device=q.device) - cu_seqlens[:-1].long()[sequence]
        block = first_block[sequence] + offset // block_size
        cache = k.new_zeros(int(blocks.sum()), block_size, k.shape[1], 2 * k.shape[2])
        cache[block, offset % block_size] = torch.cat([k, v], dim=-1)
        key_cache, value_cache = cache.split(k.shape[2], dim=-1)
        table = first_block[:, None] + torch.arange(int(blocks.max()), device=q.device)[None]
        table = table.clamp(max=cache.shape[0] - 1).to(torch.int32)
        return flash_attn_varlen_func(
            q,
            key_cache,
            value_cache,
            cu_seqlens_q=cu_seqlens,
            max_seqlen_q=max_len,
            seqused_k=lengths.to(torch.int32),
            max_seqlen_k=max_len,
            softmax_scale=scale,
            causal=True,
            block_table=table,
            num_splits=1,
            fa_version=fa_version,
        )

    from vllm import _custom_ops as ops

    rotary = layer.rotary_emb
    if getattr(rotary, "use_flashinfer", False):
        raise RuntimeError("trl.vllm_bitwise_logprobs: the engine's rotary embedding is FlashInfer's, not vLLM's own.")
    # The trainer's copy of the engine's cos/sin table, in the dtype of the queries it rotates (the model's), as
    # forward_cuda casts it. The engine's lives in vLLM's sleep-mode pool with its weights, and where those are not
    # pinned (full fine-tuning) a level-2 sleep unmaps it while the trainer trains: read there, the trainer's
    # forward faulted on the device ("illegal memory access").
    dtype = llm.llm_engine.vllm_config.model_config.dtype
    cos_sin_cache = rotary.cos_sin_cache.to(dtype=dtype, copy=True)

    def rotate(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        # vLLM's RotaryEmbedding.forward_cuda: its kernel, in place.
        ops.rotary_embedding(positions, q, k, rotary.head_size, cos_sin_cache, rotary.is_neox_style)

    return Kernels(
        linear=kernels.linear_batch_invariant,
        rms_norm=layernorm.rms_norm_batch_invariant.triton_rms_norm,
        silu_and_mul=torch.ops._C.silu_and_mul,
        rotary=rotate,
        cos_sin_cache=cos_sin_cache,
        attend=attend,
    )


def lora_factors_of(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """A merge-aware LoRA layer's (A, B, scaling); None for a layer without LoRA or with its adapter disabled.

    Raises:
        RuntimeError: for a LoRA layer that is not merge-aware (its forward is not the weight the engine serves).
    """
    if isinstance(module, MergeAwareLoraLinear):
        return lora_factors(module)
    if hasattr(module, "base_layer"):
        raise RuntimeError(
            "trl.vllm_bitwise_logprobs needs merge-aware LoRA layers (lora_merge_aware: auto), got "
            f"{type(module).__name__}."
        )
    return None


def merged_linear(x: torch.Tensor, modules: list[torch.nn.Module], kernels: Kernels) -> torch.Tensor:
    """``x`` through the linear layers ``modules`` as one matmul of their stacked weights (vLLM's merged qkv and
    gate/up layers), each merge-aware LoRA layer with its merged weight, the one the engine serves."""
    bases = [getattr(m, "base_layer", m) for m in modules]
    factors = [lora_factors_of(m) for m in modules]
    bias = None
    if any(b.bias is not None for b in bases):
        bias = torch.cat([b.bias if b.bias is not None else x.new_zeros(b.weight.shape[0]) for b in bases])
    if all(f is None for f in factors):  # full fine-tuning, or adapters disabled: the layers' own weights
        weights = [b.weight for b in bases]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return _Linear.apply(x, weight, bias, kernels.linear)
    dtype = next(m.merge_dtype for m, f in zip(modules, factors, strict=True) if f is not None)
    scalings = tuple(None if f is None else f[2] for f in factors)
    tensors = [t for f in factors if f is not None for t in f[:2]]
    return _LoraLinear.apply(x, bias, kernels.linear, [b.weight for b in bases], scalings, dtype, *tensors)


def _norm(x: torch.Tensor, module: torch.nn.Module, kernels: Kernels) -> torch.Tensor:
    return _RMSNorm.apply(x, module.weight, module.variance_epsilon, kernels.rms_norm)


def decoder_forward(model: Any, kernels: Kernels, tokens: torch.Tensor, positions: torch.Tensor, cu: Any) -> Any:
    """The last hidden states of the packed ``tokens`` (one row each) through a Qwen2/Qwen3 ``model`` (the
    transformers ``Qwen2Model``), as the engine computes them. ``cu`` is (cumulative lengths, longest length).

    A layer with transformers' gradient checkpointing on (``gradient_checkpointing_enable``, TRL's
    ``gradient_checkpointing``) is checkpointed with its own function: its backward recomputes it, by the same kernels.
    """
    config = model.config
    attention_shape = (config.num_attention_heads, config.num_key_value_heads, head_size(config))
    hidden = model.embed_tokens(tokens)
    residual = None
    for layer in model.layers:
        step = functools.partial(_decoder_layer, layer, kernels, attention_shape, positions, cu)
        if layer.gradient_checkpointing and layer.training:
            hidden, residual = layer._gradient_checkpointing_func(step, hidden, residual)
        else:
            hidden, residual = step(hidden, residual)
    return _norm(hidden + residual, model.norm, kernels)


def _decoder_layer(
    layer: Any,
    kernels: Kernels,
    attention_shape: tuple[int, int, int],
    positions: torch.Tensor,
    cu: Any,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer as vLLM's: the residual added to the layer's input in its first RMSNorm (the first layer's
    residual is its input, ``residual`` None), the MLP's output and the residual after it returned apart.
    ``attention_shape``: (query heads, key/value heads, head size)."""
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads, head_dim = attention_shape
    cu_seqlens, max_len = cu
    if residual is None:
        residual, x = hidden, _norm(hidden, layer.input_layernorm, kernels)
    else:
        residual = hidden + residual
        x = _norm(residual, layer.input_layernorm, kernels)
    qkv = merged_linear(x, [attn.q_proj, attn.k_proj, attn.v_proj], kernels)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(t.shape[0], -1, head_dim) for t in (q, k, v))
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of each head before the rotary embedding
        q, k = _norm(q, attn.q_norm, kernels), _norm(k, attn.k_norm, kernels)
    q, k = _Rotary.apply(positions, q, k, kernels.cos_sin_cache, kernels.rotary)
    out = _Attention.apply(q, k, v.contiguous(), cu_seqlens, max_len, head_dim**-0.5, kernels.attend)
    hidden = merged_linear(out.reshape(out.shape[0], -1), [attn.o_proj], kernels)
    residual = hidden + residual
    x = _norm(residual, layer.post_attention_layernorm, kernels)
    gate_up = merged_linear(x, [mlp.gate_proj, mlp.up_proj], kernels)
    return merged_linear(_SiluAndMul.apply(gate_up, kernels.silu_and_mul), [mlp.down_proj], kernels), residual


def causal_lm_log_probs(
    model: Any,
    kernels: Kernels,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
) -> Any:
    """TRL's fused-head output (``FusedCausalLMOutput``: ``log_probs`` and ``entropy`` of each next-token label,
    zero where the label is -100) for a transformers Qwen2/Qwen3 causal LM, computed as the engine computes it.

    Each row's real tokens (a left-padded prompt and a right-padded completion: one run of ones in the mask) are
    packed, with positions from 0, as the engine holds the sequence.
    """
    from trl.trainer.utils import FusedCausalLMOutput

    mask = attention_mask.bool()
    lengths = mask.sum(1)
    starts = mask.int().argmax(1)
    if not torch.equal(mask.int().cumsum(1)[torch.arange(len(mask)), starts + lengths - 1], lengths):
        raise ValueError("trl.vllm_bitwise_logprobs: each row's tokens must be one run (padding only at the ends).")
    tokens = input_ids[mask]
    positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths.tolist()])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    hidden = decoder_forward(model.model, kernels, tokens, positions, (cu_seqlens, int(lengths.max())))
    # Next-token labels: position t of a row predicts its token t + 1.
    shifted = labels[:, 1:]
    scored = shifted != -100
    source = torch.zeros_like(mask)
    source[:, :-1] = scored  # the positions whose hidden state predicts a scored label
    packed_index = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    packed_index[mask] = torch.arange(tokens.shape[0], device=mask.device)
    rows = packed_index[source]
    head = model.get_output_embeddings()
    log_probs, entropy = _HeadLogProbs.apply(hidden[rows], head.weight, shifted[scored], temperature, kernels.linear)
    full_lp = log_probs.new_zeros(shifted.shape).masked_scatter(scored, log_probs)
    full_entropy = entropy.new_zeros(shifted.shape).masked_scatter(scored, entropy)
    loss = -log_probs.sum() / scored.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=loss, log_probs=full_lp, entropy=full_entropy, label_mask=scored)


def install(model: Any, kernels: Kernels, temperature: float) -> None:
    """Compute ``model``'s fused-head forward (TRL's ``model(..., labels=..., fused_lm_head=True)``, with which
    TRL scores the sampled sequences) with the engine's ``kernels`` (its ``bitwise_kernels``). ``model`` is the
    transformers model (for a PEFT model, its base model); its other calls are unchanged.

    Raises:
        RuntimeError: for a model other than Qwen2/Qwen3.
    """
    if model.config.model_type not in ("qwen2", "qwen3"):
        raise RuntimeError(
            f"trl.vllm_bitwise_logprobs is built for Qwen2 and Qwen3 models, not {model.config.model_type}."
        )
    original = model.forward

    def forward(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return original(*args, **kwargs)
        input_ids = kwargs.pop("input_ids", args[0] if args else None)
        return causal_lm_log_probs(model, kernels, input_ids, kwargs["attention_mask"], kwargs["labels"], temperature)

    model.forward = forward
