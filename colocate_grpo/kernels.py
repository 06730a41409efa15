"""CUDA kernels of the sync (Triton): the merged weight ``cast(W + s * B @ A)``, and a plain copy.

The plain PyTorch path (fp32 copy of W, addmm, cast) moves about 22 bytes per weight
entry; the merge kernel reads W in its own dtype and writes the cast result once, about
4 bytes per entry, computing each tile's rank-r product in fp32 on the fly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    w_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    rows,
    cols,
    rank,
    scaling,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    b = tl.load(
        b_ptr + offs_m[:, None] * rank + offs_r[None, :], mask=mask_m[:, None] & (offs_r[None, :] < rank), other=0.0
    )
    a = tl.load(
        a_ptr + offs_r[:, None] * cols + offs_n[None, :], mask=(offs_r[:, None] < rank) & mask_n[None, :], other=0.0
    )
    delta = tl.dot(b, a, input_precision="ieee")
    tile = offs_m[:, None] * cols + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    w = tl.load(w_ptr + tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tile, (w + scaling * delta).to(out_ptr.dtype.element_ty), mask=mask)


def fused_merged_weight(
    base: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cast(W + scaling * B @ A)`` on CUDA in one pass; shapes as in :func:`colocate_grpo.lora.merged_weight`.

    ``out``, when given, must be contiguous, of ``dtype`` and on ``base``'s device.
    """
    rows, cols = base.shape
    rank = lora_A.shape[0]
    base = base.contiguous()
    lora_A = lora_A.float().contiguous()
    lora_B = lora_B.float().contiguous()
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=base.device)
    padded_rank = max(16, triton.next_power_of_2(rank))
    # 32 x 128 tiles: 3 to 7% faster than 64 x 128 on the H200, the same bits (bench/FINDINGS.md).
    block_m, block_n = 32, 128
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _merge_kernel[grid](
        base, lora_A, lora_B, out, rows, cols, rank, float(scaling), R=padded_rank, BLOCK_M=block_m, BLOCK_N=block_n
    )
    return out


@triton.jit
def _copy_kernel(source_ptr, target_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(target_ptr + offsets, tl.load(source_ptr + offsets, mask=mask), mask=mask)


def copy_by_kernel(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` by a kernel, for contiguous CUDA tensors of one shape and dtype.

    Captured in a CUDA graph, ``copy_`` becomes a memcpy node. On the H200 such nodes copied
    gigabyte-sized tensors (a 7B model's embeddings) at about 2.7 TB/s, and this kernel at 4.1 TB/s,
    as fast as an eager ``copy_`` (bench/FINDINGS.md).
    """
    n = source.numel()
    block = 1024
    _copy_kernel[(triton.cdiv(n, block),)](source, target, n, BLOCK=block)


@triton.jit
def _scaled_copies_kernel(
    sources, targets, numels, scales, block_tensor, block_start, source_like, target_like, BLOCK: tl.constexpr
):
    block = tl.program_id(0)
    tensor = tl.load(block_tensor + block)
    offsets = tl.load(block_start + block) + tl.arange(0, BLOCK)
    mask = offsets < tl.load(numels + tensor)
    source = tl.load(sources + tensor).to(tl.pointer_type(source_like.dtype.element_ty))
    target = tl.load(targets + tensor).to(tl.pointer_type(target_like.dtype.element_ty))
    values = tl.load(source + offsets, mask=mask).to(tl.float32) * tl.load(scales + tensor)
    tl.store(target + offsets, values.to(target_like.dtype.element_ty), mask=mask)


class ScaledCopies:
    """``targets[i].copy_(sources[i] * scales[i])`` for many small CUDA tensors in one kernel launch.

    Each of the kernel's blocks reads its tensor's addresses from a table built once. On the H200, a
    7B model's LoRA factors (392 tensors) took 0.09 ms this way, against 0.25 ms for PyTorch's
    ``_foreach_mul`` and ``_foreach_copy_`` (12 kernels, replayed as a CUDA graph) and 1.2 ms for a
    copy per tensor (bench/FINDINGS.md); one launch needs no graph.
    The product is taken in fp32 and rounded to the target's dtype to nearest even, as PyTorch's
    ``(source * scale).to(dtype)`` of an fp32 source does, so the two write the same bits.

    Holds the tensors: their memory stays valid for every later launch. All sources must share one dtype,
    all targets another; every tensor contiguous, each target the shape of its source.
    """

    BLOCK = 4096

    def __init__(self, targets: list[torch.Tensor], sources: list[torch.Tensor], scales: list[float]) -> None:
        if not all(t.is_contiguous() and s.is_contiguous() for t, s in zip(targets, sources, strict=True)):
            raise ValueError("ScaledCopies needs contiguous tensors.")
        self.targets, self.sources = targets, sources
        device = sources[0].device
        numels = [s.numel() for s in sources]
        blocks = [triton.cdiv(n, self.BLOCK) for n in numels]
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        self.scales = torch.tensor(scales, dtype=torch.float32, device=device)
        self.source_addresses = torch.tensor([s.data_ptr() for s in sources], dtype=torch.int64, device=device)
        self.target_addresses = torch.tensor([t.data_ptr() for t in targets], dtype=torch.int64, device=device)
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(sources), dtype=torch.int32), torch.tensor(blocks)
        ).to(device)
        self.block_start = torch.cat([torch.arange(b, dtype=torch.int64) * self.BLOCK for b in blocks]).to(device)

    def __call__(self) -> None:
        """Launch the copies on the current stream (asynchronous)."""
        _scaled_copies_kernel[(self.block_tensor.numel(),)](
            self.source_addresses,
            self.target_addresses,
            self.numels,
            self.scales,
            self.block_tensor,
            self.block_start,
            self.sources[0],
            self.targets[0],
            BLOCK=self.BLOCK,
        )
