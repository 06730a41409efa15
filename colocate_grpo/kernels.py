"""CUDA kernels of the sync (Triton): the merged weight ``cast(W + s * B @ A)``, its merge in place with the
record that undoes it, and copies.

The plain PyTorch path (fp32 copy of W, addmm, cast) moves about 22 bytes per weight
entry; the merge kernel reads W in its own dtype and writes the cast result once, about
4 bytes per entry, computing each tile's rank-r product in fp32 on the fly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The merge kernels' tiles: 32 x 128 was 3 to 7% faster than 64 x 128 on the H200, the same bits (bench/FINDINGS.md).
# The merge in place uses the same, so that it writes the bits of fused_merged_weight.
_BLOCK_M, _BLOCK_N = 32, 128


@triton.jit
def _lora_delta(a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, cols, rank, R: tl.constexpr):
    """``B @ A`` over one (BLOCK_M, BLOCK_N) tile of W, in fp32 with IEEE products: the merge kernels' shared math."""
    offs_r = tl.arange(0, R)
    b = tl.load(
        b_ptr + offs_m[:, None] * rank + offs_r[None, :], mask=mask_m[:, None] & (offs_r[None, :] < rank), other=0.0
    )
    a = tl.load(
        a_ptr + offs_r[:, None] * cols + offs_n[None, :], mask=(offs_r[:, None] < rank) & mask_n[None, :], other=0.0
    )
    return tl.dot(b, a, input_precision="ieee")


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
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    delta = _lora_delta(a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, cols, rank, R)
    tile = offs_m[:, None] * cols + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    w = tl.load(w_ptr + tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tile, (w + scaling * delta).to(out_ptr.dtype.element_ty), mask=mask)


def _factors(lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A and B as the merge kernels read them (fp32, contiguous), and the rank padded for ``tl.dot``."""
    return lora_A.float().contiguous(), lora_B.float().contiguous(), max(16, triton.next_power_of_2(lora_A.shape[0]))


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
    lora_A, lora_B, padded_rank = _factors(lora_A, lora_B)
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype, device=base.device)
    grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(cols, _BLOCK_N))
    _merge_kernel[grid](
        base, lora_A, lora_B, out, rows, cols, rank, float(scaling), R=padded_rank, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N
    )
    return out


# A merge record's state on the device: int32 words (lora.Overwritten.state), zeros before its merge.
STATE_WORDS = 4  # a record's words, rounded up to 16 bytes
_APPENDED = tl.constexpr(0)  # outliers the merge counted; past the record's capacity, some were left unmerged
_MERGED = tl.constexpr(1)  # 1 from the merge kernel's run until a restore undid it
_DONE = tl.constexpr(2)  # programs of the running restore that have finished


@triton.jit
def _merge_in_place_kernel(
    w_ptr,
    a_ptr,
    b_ptr,
    steps_ptr,
    outliers_ptr,
    outlier_bits_ptr,
    state_ptr,
    rows,
    cols,
    rank,
    scaling,
    capacity,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    delta = _lora_delta(a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, cols, rank, R)
    tile = offs_m[:, None] * cols + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    w = tl.load(w_ptr + tile, mask=mask, other=0.0)
    merged = (w.to(tl.float32) + scaling * delta).to(w_ptr.dtype.element_ty)  # _merge_kernel's expression
    bits_type = outlier_bits_ptr.dtype.element_ty
    old_bits = w.to(bits_type, bitcast=True)
    new_bits = merged.to(bits_type, bitcast=True)
    step = old_bits - new_bits  # wraps: the restore's add wraps back
    small = step.to(tl.int8)
    fits = small.to(bits_type) == step
    outlier = mask & ~fits
    # Each outlier's slot: the tile's first, taken from the count with one atomic, plus the outliers before it
    # in the tile, row-major.
    flags = outlier.to(tl.int32)
    row_counts = tl.sum(flags, axis=1)
    before = (tl.cumsum(row_counts, axis=0) - row_counts)[:, None] + tl.cumsum(flags, axis=1) - flags
    tile_count = tl.sum(row_counts, axis=0)
    first = tl.atomic_add(state_ptr + _APPENDED, tile_count, mask=tile_count > 0)
    slot = first + before
    kept = outlier & (slot < capacity)
    tl.store(outliers_ptr + slot, tile.to(tl.int64), mask=kept)
    tl.store(outlier_bits_ptr + slot, old_bits, mask=kept)
    tl.store(steps_ptr + tile, tl.where(fits, small, 0).to(tl.int8), mask=mask)
    # An outlier past the capacity keeps its old bits (its step is 0); unchanged values need no write.
    tl.store(w_ptr + tile, merged, mask=mask & (fits | kept) & (new_bits != old_bits))
    if (pid_m == 0) & (pid_n == 0):
        tl.store(state_ptr + _MERGED, 1)


def merge_in_place(
    base: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    steps: torch.Tensor,
    outliers: torch.Tensor,
    outlier_bits: torch.Tensor,
    state: torch.Tensor,
) -> None:
    """Write ``cast(W + scaling * B @ A)`` over W in place and the record that undoes it, in one pass; launches only.

    Each value's old bits minus its new ones (integers, wrapping) go to ``steps`` where they fit in int8.
    Elsewhere the step is 0, and the value's flat index and old bits are appended to ``outliers`` and
    ``outlier_bits``, counted in ``state``. An outlier past their capacity is left unmerged (its old bits, step
    0) but counted, so that a count over the capacity tells of it; the record undoes the merge exactly either
    way. The merged bits are :func:`fused_merged_weight`'s: the same tiles and math.

    Args:
        base: W, shape (rows, cols), a contiguous 16- or 32-bit float tensor on the device.
        lora_A, lora_B, scaling: A (r, cols), B (rows, r) and the scaling, as for :func:`fused_merged_weight`.
        steps: int8, ``rows * cols`` values, contiguous, on the device.
        outliers: int64, shape (capacity,). outlier_bits: the integers of W's element size, (capacity,).
        state: int32, shape (STATE_WORDS,), zeros: the record's state (the count; merged, from this launch on).
    """
    rows, cols = base.shape
    lora_A, lora_B, padded_rank = _factors(lora_A, lora_B)
    grid = (triton.cdiv(rows, _BLOCK_M), triton.cdiv(cols, _BLOCK_N))
    _merge_in_place_kernel[grid](
        base,
        lora_A,
        lora_B,
        steps,
        outliers,
        outlier_bits,
        state,
        rows,
        cols,
        lora_A.shape[0],
        float(scaling),
        outliers.numel(),
        R=padded_rank,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
    )


@triton.jit
def _add_steps(bits_ptr, steps_ptr, n, block, BLOCK: tl.constexpr):
    """One block of values gets its steps added (wrapping, as the merge's subtraction made them)."""
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    step = tl.load(steps_ptr + offsets, mask=offsets < n, other=0)
    # Only where a step is not 0: an outlier's step is 0, and another program writes its old bits, maybe at once.
    changed = step != 0
    bits = tl.load(bits_ptr + offsets, mask=changed)
    tl.store(bits_ptr + offsets, bits + step.to(bits.dtype), mask=changed)


@triton.jit
def _put_outliers_back(bits_ptr, outliers_ptr, outlier_bits_ptr, count, block, BLOCK: tl.constexpr):
    """One block of the outlier slots: the first ``count`` hold a value's flat index and old bits."""
    slots = block * BLOCK + tl.arange(0, BLOCK)
    filled = slots < count
    index = tl.load(outliers_ptr + slots, mask=filled, other=0)
    tl.store(bits_ptr + index, tl.load(outlier_bits_ptr + slots, mask=filled), mask=filled)


@triton.jit
def _undo_merge_kernel(
    bits_ptr,
    steps_ptr,
    outliers_ptr,
    outlier_bits_ptr,
    state_ptr,
    n,
    capacity,
    step_blocks,
    SPEND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if tl.load(state_ptr + _MERGED) == 1:  # else nothing was merged, or a restore undid it already
        if pid < step_blocks:
            _add_steps(bits_ptr, steps_ptr, n, pid, BLOCK)
        else:
            count = tl.minimum(tl.load(state_ptr + _APPENDED), capacity)
            _put_outliers_back(bits_ptr, outliers_ptr, outlier_bits_ptr, count, pid - step_blocks, BLOCK)
        if SPEND:
            # The last program to finish marks the record undone: every program read the mark before its add.
            finished = tl.atomic_add(state_ptr + _DONE, 1)
            if finished == tl.num_programs(0) - 1:
                tl.store(state_ptr + _MERGED, 0)
                tl.store(state_ptr + _DONE, 0)


def undo_merge(
    bits: torch.Tensor,
    steps: torch.Tensor,
    outliers: torch.Tensor,
    outlier_bits: torch.Tensor,
    state: torch.Tensor,
    spend: bool,
) -> None:
    """Undo :func:`merge_in_place` on ``bits`` in one pass (a launch, nothing waits on the host).

    Where the record's state says no merge ran, or a restore undid it, nothing changes. Each value gets its
    step added (wrapping) and each outlier its old bits; a step is 0 at an outlier, so the two never write
    one value.

    Args:
        bits: the merged tensor (or a copy of it) as integers of its element size, contiguous, on the device.
        steps, outliers, outlier_bits, state: the record, as :func:`merge_in_place` wrote it.
        spend: mark the record undone when done (the restore of the merged tensor itself, so that a second is a
            no-op); False for a copy, which leaves the record as it was.
    """
    n = bits.numel()
    block = 4096  # 8 KB of a 16-bit tensor a program: 17k programs, and as many atomic adds, for 7B's largest linear
    step_blocks = triton.cdiv(n, block)
    grid = (step_blocks + triton.cdiv(outliers.numel(), block),)
    _undo_merge_kernel[grid](
        bits, steps, outliers, outlier_bits, state, n, outliers.numel(), step_blocks, SPEND=spend, BLOCK=block
    )


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
