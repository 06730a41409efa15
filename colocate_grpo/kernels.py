"""CUDA kernels of the sync (Triton): the merged weight ``cast(W + s * B @ A)``, its merge in place with the
record that undoes it, and copies.

The plain PyTorch path (fp32 copy of W, addmm, cast) moves about 22 bytes per weight
entry; the merge kernel reads W in its own dtype and writes the cast result once, about
4 bytes per entry, computing each tile's rank-r product in fp32 on the fly.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

# The merge kernels' tiles: 32 x 128 was 3 to 7% faster than 64 x 128 on the H200, the same bits (bench/FINDINGS.md).
# The merge in place uses the same, so that it writes the bits of fused_merged_weight.
_BLOCK_M, _BLOCK_N = 32, 128


@triton.jit
def _lora_delta(a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, cols, rank, R: tl.constexpr):
    """``B @ A`` over one (BLOCK_M, BLOCK_N) tile of W, in fp32 with IEEE products: the merge kernels' shared math.
    A and B in fp32 as loaded (the grouped kernel's may be of another float dtype: exactly their ``.float()``)."""
    offs_r = tl.arange(0, R)
    b = tl.load(
        b_ptr + offs_m[:, None] * rank + offs_r[None, :], mask=mask_m[:, None] & (offs_r[None, :] < rank), other=0.0
    )
    a = tl.load(
        a_ptr + offs_r[:, None] * cols + offs_n[None, :], mask=(offs_r[:, None] < rank) & mask_n[None, :], other=0.0
    )
    return tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")


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
_STATE_WORDS = tl.constexpr(STATE_WORDS)
APPENDED_WORD, MERGED_WORD, DONE_WORD = 0, 1, 2
_APPENDED = tl.constexpr(APPENDED_WORD)  # outliers the merge counted; past the record's capacity, some left unmerged
_MERGED = tl.constexpr(MERGED_WORD)  # 1 from the merge kernel's run until a restore undid it
_DONE = tl.constexpr(DONE_WORD)  # programs of the running restore that have finished

# Warps of a merge in place's program (a 32 x 128 tile): with 4, as the fused merge runs, its outliers' handling held
# 202 to 255 registers a thread (spilling with the old slots' scans) and two programs an SM; with 16, 64 registers
# and 32 warps an SM (ptxas for sm_90). Each value's rank-r product is the same chain of FMAs whatever the warps, so
# the bits are fused_merged_weight's (tests/test_merge_in_place.py).
_MERGE_IN_PLACE_WARPS = 16
# A restore's program: 4096 values (8 KB of a 16-bit tensor) by 8 warps, 64 registers a thread (124 with 4 warps).
_UNDO_BLOCK, _UNDO_WARPS = 4096, 8
# The grouped kernels hold their layer's addresses in registers, where the per-layer ones read their arguments:
# 80 and 76 a thread, capped at 64 (the merge spills 16 bytes) so that an SM runs as many of their programs.
_GROUPED_REGISTERS = 64


@triton.jit
def _merge_tile_in_place(
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
    pid_m,
    pid_n,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tile (pid_m, pid_n) of a merge in place and its record: the per-layer and the grouped kernel's body."""
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
    tl.store(steps_ptr + tile, tl.where(fits, small, 0).to(tl.int8), mask=mask)
    written = fits
    # Few tiles hold outliers, and few of their values: each takes a slot from the count with an atomic of its own
    # (the slots' order is of no matter). Prefix sums over every tile's values gave every slot its place, at the
    # cost of registers that halved the programs an SM runs.
    if tl.max(tl.max(outlier.to(tl.int32), axis=1), axis=0) > 0:
        slot = tl.atomic_add(state_ptr + _APPENDED + tl.zeros_like(tile), 1, mask=outlier, sem="relaxed")
        kept = outlier & (slot < capacity)
        tl.store(outliers_ptr + slot, tile.to(tl.int64), mask=kept)
        tl.store(outlier_bits_ptr + slot, old_bits, mask=kept)
        written = fits | kept
    # An outlier past the capacity keeps its old bits (its step is 0). The whole tile is stored, unchanged values
    # with their own bits: wide stores, where a store of the changed values alone takes one a value.
    tl.store(w_ptr + tile, tl.where(written, merged, w), mask=mask)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(state_ptr + _MERGED, 1)


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
    _merge_tile_in_place(
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
        tl.program_id(0),
        tl.program_id(1),
        R,
        BLOCK_M,
        BLOCK_N,
    )


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
    ``outlier_bits`` (in no particular order), counted in ``state``. An outlier past their capacity is left
    unmerged (its old bits, step 0) but counted, so that a count over the capacity tells of it; the record undoes
    the merge exactly either way. The merged bits are :func:`fused_merged_weight`'s: the same tiles and math.
    :class:`GroupedMerges` does this for many layers in one launch.

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
        num_warps=_MERGE_IN_PLACE_WARPS,
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
def _undo_block(
    bits_ptr,
    steps_ptr,
    outliers_ptr,
    outlier_bits_ptr,
    state_ptr,
    n,
    capacity,
    step_blocks,
    block,
    programs,
    SPEND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Block ``block`` of the ``programs`` that undo one record: the per-layer and the grouped kernel's body."""
    if tl.load(state_ptr + _MERGED) == 1:  # else nothing was merged, or a restore undid it already
        if block < step_blocks:
            _add_steps(bits_ptr, steps_ptr, n, block, BLOCK)
        else:
            count = tl.minimum(tl.load(state_ptr + _APPENDED), capacity)
            _put_outliers_back(bits_ptr, outliers_ptr, outlier_bits_ptr, count, block - step_blocks, BLOCK)
        if SPEND:
            # The last program to finish marks the record undone: every program read the mark before its add.
            finished = tl.atomic_add(state_ptr + _DONE, 1)
            if finished == programs - 1:
                tl.store(state_ptr + _MERGED, 0)
                tl.store(state_ptr + _DONE, 0)


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
    _undo_block(
        bits_ptr,
        steps_ptr,
        outliers_ptr,
        outlier_bits_ptr,
        state_ptr,
        n,
        capacity,
        step_blocks,
        tl.program_id(0),
        tl.num_programs(0),
        SPEND,
        BLOCK,
    )


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
    step_blocks = triton.cdiv(n, _UNDO_BLOCK)  # 17k programs, and as many atomic adds, for 7B's largest linear
    grid = (step_blocks + triton.cdiv(outliers.numel(), _UNDO_BLOCK),)
    _undo_merge_kernel[grid](
        bits,
        steps,
        outliers,
        outlier_bits,
        state,
        n,
        outliers.numel(),
        step_blocks,
        SPEND=spend,
        BLOCK=_UNDO_BLOCK,
        num_warps=_UNDO_WARPS,
    )


# The grouped kernels' table: a row of int64 fields a layer.
_W, _A, _B, _ROWS, _COLS, _RANK, _STEPS, _SLOTS, _CAPACITY = (tl.constexpr(i) for i in range(9))
_FIELDS = tl.constexpr(9)
_MOST_LAYERS = torch.iinfo(torch.int16).max  # the table of each program's layer is int16


@triton.jit
def _grouped_merge_in_place_kernel(
    table_ptr,
    scalings_ptr,
    tile_layers_ptr,
    tile_starts_ptr,
    steps_ptr,
    outliers_ptr,
    outlier_bits_ptr,
    states_ptr,
    w_like,
    a_like,
    b_like,
    ALIGN: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.load(tile_layers_ptr + pid).to(tl.int32)
    row = table_ptr + layer * _FIELDS
    # The alignments Triton assumes of a launch's arguments (16 bytes, columns a multiple of 16), where every layer
    # has them: wide loads and stores.
    w_ptr = tl.multiple_of(tl.load(row + _W).to(tl.pointer_type(w_like.dtype.element_ty)), ALIGN)
    a_ptr = tl.multiple_of(tl.load(row + _A).to(tl.pointer_type(a_like.dtype.element_ty)), ALIGN)
    b_ptr = tl.multiple_of(tl.load(row + _B).to(tl.pointer_type(b_like.dtype.element_ty)), ALIGN)
    rows = tl.load(row + _ROWS).to(tl.int32)
    cols = tl.multiple_of(tl.load(row + _COLS).to(tl.int32), ALIGN)
    rank = tl.multiple_of(tl.load(row + _RANK).to(tl.int32), RANK_ALIGN)
    slots = tl.load(row + _SLOTS)
    tile = pid - tl.load(tile_starts_ptr + layer)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    _merge_tile_in_place(
        w_ptr,
        a_ptr,
        b_ptr,
        steps_ptr + tl.multiple_of(tl.load(row + _STEPS), ALIGN),
        outliers_ptr + slots,
        outlier_bits_ptr + slots,
        states_ptr + layer * _STATE_WORDS,
        rows,
        cols,
        rank,
        tl.load(scalings_ptr + layer),
        tl.load(row + _CAPACITY).to(tl.int32),
        tile % tiles_m,  # down the rows first, as the per-layer kernel's grid runs
        tile // tiles_m,
        R,
        BLOCK_M,
        BLOCK_N,
    )


@triton.jit
def _grouped_undo_merge_kernel(
    table_ptr,
    block_layers_ptr,
    block_starts_ptr,
    steps_ptr,
    outliers_ptr,
    outlier_bits_ptr,
    states_ptr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.load(block_layers_ptr + pid).to(tl.int32)
    start = tl.load(block_starts_ptr + layer)
    row = table_ptr + layer * _FIELDS
    bits_ptr = tl.multiple_of(tl.load(row + _W).to(tl.pointer_type(outlier_bits_ptr.dtype.element_ty)), ALIGN)
    n = tl.load(row + _ROWS) * tl.load(row + _COLS)
    slots = tl.load(row + _SLOTS)
    _undo_block(
        bits_ptr,
        steps_ptr + tl.multiple_of(tl.load(row + _STEPS), ALIGN),
        outliers_ptr + slots,
        outlier_bits_ptr + slots,
        states_ptr + layer * _STATE_WORDS,
        n,
        tl.load(row + _CAPACITY),
        tl.cdiv(n, BLOCK),
        pid - start,
        tl.load(block_starts_ptr + layer + 1) - start,
        True,
        BLOCK,
    )


def _alignment(values: list[int], most: int = 16) -> int:
    """The largest power of two up to ``most`` that divides every value."""
    align = most
    while align > 1 and any(value % align for value in values):
        align //= 2
    return align


class GroupedMerges:
    """:func:`merge_in_place` into many layers by one kernel launch, and their restore (:func:`undo_merge` with
    ``spend``) by another: each program reads its layer from a table of every program's layer (a binary search
    over the layers' first programs, 8 dependent loads at 196 layers, made the push about 5% slower), and the
    layer's addresses, shape, scaling and place in the record memory from a table on the device.

    Built once for a set of layers and reused by every merge while they are the same tensors: it holds them (W, A,
    B), so their addresses stay theirs; the kernels read the values at each launch. The records' memory is the
    caller's (allocated for each merge, the layers' records one after another in it, as ``steps_starts`` and
    ``slot_starts`` say), so that it can be freed between merges. A layer's merged bits and record are the
    per-layer kernel's: the same body, and the factors' values in fp32 as :func:`merge_in_place` reads them.

    Args:
        targets: the W of each layer: contiguous, of one 16- or 32-bit float dtype, on one device, not empty.
        lora_As, lora_Bs: contiguous; all A of one float dtype, all B of one, padding to one rank for ``tl.dot``.
        scalings: each layer's.
        steps_starts: where each layer's steps start in the steps' memory (int8, a value each).
        slot_starts, capacities: where each layer's outlier slots start, and how many it has.
    """

    def __init__(
        self,
        targets: list[torch.Tensor],
        lora_As: list[torch.Tensor],
        lora_Bs: list[torch.Tensor],
        scalings: list[float],
        steps_starts: list[int],
        slot_starts: list[int],
        capacities: list[int],
    ) -> None:
        if not self.takes(targets, lora_As, lora_Bs):
            raise ValueError("GroupedMerges needs contiguous tensors, of one dtype each kind, padding to one rank")
        self.targets, self.lora_As, self.lora_Bs = targets, lora_As, lora_Bs
        self.device = targets[0].device
        shapes = [target.shape for target in targets]
        ranks = [lora_A.shape[0] for lora_A in lora_As]
        self.padded_rank = max(16, triton.next_power_of_2(ranks[0]))
        rows = [shape[0] for shape in shapes]
        cols = [shape[1] for shape in shapes]
        addresses = [t.data_ptr() for tensors in (targets, lora_As, lora_Bs) for t in tensors]
        self.align = _alignment(addresses + cols + steps_starts)  # what a launch of the per-layer kernel assumes
        self.rank_align = _alignment(ranks)
        table = [
            [w.data_ptr(), a.data_ptr(), b.data_ptr(), m, n, r, steps, slots, capacity]
            for w, a, b, m, n, r, steps, slots, capacity in zip(
                targets, lora_As, lora_Bs, rows, cols, ranks, steps_starts, slot_starts, capacities, strict=True
            )
        ]
        tiles = [triton.cdiv(m, _BLOCK_M) * triton.cdiv(n, _BLOCK_N) for m, n in zip(rows, cols, strict=True)]
        blocks = [
            triton.cdiv(m * n, _UNDO_BLOCK) + triton.cdiv(capacity, _UNDO_BLOCK)
            for m, n, capacity in zip(rows, cols, capacities, strict=True)
        ]
        self.tiles, self.blocks = sum(tiles), sum(blocks)
        self.table = _on_device(torch.tensor(table, dtype=torch.int64), self.device)
        self.scalings = _on_device(torch.tensor(scalings, dtype=torch.float32), self.device)
        self.tile_layers = _on_device(_layer_of_each(tiles), self.device)
        self.tile_starts = _on_device(_starts(tiles), self.device)
        self.block_layers = _on_device(_layer_of_each(blocks), self.device)
        self.block_starts = _on_device(_starts(blocks), self.device)

    @staticmethod
    def takes(targets: list[torch.Tensor], lora_As: list[torch.Tensor], lora_Bs: list[torch.Tensor]) -> bool:
        """Whether one grouped launch can merge these layers (see the class)."""
        if not targets:
            return False
        first = targets[0]
        ranks = {max(16, triton.next_power_of_2(lora_A.shape[0])) for lora_A in lora_As}
        return (
            len(ranks) == 1
            and len(targets) <= _MOST_LAYERS
            and all(t.dtype == first.dtype and t.device == first.device and t.numel() for t in targets)
            and all(t.is_contiguous() for tensors in (targets, lora_As, lora_Bs) for t in tensors)
            and len({t.dtype for t in lora_As}) == 1
            and len({t.dtype for t in lora_Bs}) == 1
            and all(t.dtype.is_floating_point and t.device == first.device for t in lora_As + lora_Bs)
        )

    def merge(self, steps: torch.Tensor, outliers: torch.Tensor, outlier_bits: torch.Tensor, states: torch.Tensor):
        """Launch the merges of every layer (:func:`merge_in_place`'s, each into its record's place); ``states``:
        int32 (layers, STATE_WORDS), zeros."""
        _grouped_merge_in_place_kernel[(self.tiles,)](
            self.table,
            self.scalings,
            self.tile_layers,
            self.tile_starts,
            steps,
            outliers,
            outlier_bits,
            states,
            self.targets[0],
            self.lora_As[0],
            self.lora_Bs[0],
            ALIGN=self.align,
            RANK_ALIGN=self.rank_align,
            R=self.padded_rank,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=_BLOCK_N,
            num_warps=_MERGE_IN_PLACE_WARPS,
            maxnreg=_GROUPED_REGISTERS,
        )

    def undo(self, steps: torch.Tensor, outliers: torch.Tensor, outlier_bits: torch.Tensor, states: torch.Tensor):
        """Launch the restore of every layer (:func:`undo_merge` with ``spend``): a layer whose state says it was not
        merged, or was restored already, is left as it is."""
        _grouped_undo_merge_kernel[(self.blocks,)](
            self.table,
            self.block_layers,
            self.block_starts,
            steps,
            outliers,
            outlier_bits,
            states,
            ALIGN=self.align,
            BLOCK=_UNDO_BLOCK,
            num_warps=_UNDO_WARPS,
            maxnreg=_GROUPED_REGISTERS,
        )


def _layer_of_each(counts: list[int]) -> torch.Tensor:
    """Each program's layer, where layer ``i`` has ``counts[i]`` programs in order: int16 (:meth:`GroupedMerges.takes`
    up to ``_MOST_LAYERS``), 2 bytes a program, 0.6 MB for a 1.5B model's merge."""
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int16), torch.tensor(counts))


def _starts(counts: list[int]) -> torch.Tensor:
    """Each count's first index in their concatenation, and the total last (int64)."""
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor copied to ``device`` without waiting for it (from page-locked memory on CUDA)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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
