"""The merge in place by kernels (lora.merge_in_place, as sync.MergedInPlace runs it on CUDA): the fused merge's bits,
a bitwise restore, the outliers' room running out, interrupts before and after the launches, the record's size.

On a GPU the tests run the compiled kernels. Elsewhere one test runs the others in a process of their own under
Triton's interpreter (TRITON_INTERPRET=1), which runs the same kernels on CPU tensors; its fp32-to-bf16 casts
truncate, so there a bf16 merge's bits are the interpreted fused merge's, not PyTorch's.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate_grpo.memory_plan import _MERGE_RECORD_BYTES_PER_WEIGHT
from colocate_grpo.sync import MergedInPlace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="a GPU, or Triton's interpreter (the last test runs them so)")
SCALING = 2.0


def bits(tensor):
    return tensor.view(torch.int16)


def lora_layer(rows, cols, b_scale, dtype=torch.bfloat16, seed=0):
    """A base weight (rows, cols) and rank-8 factors; ``b_scale`` 1e-4 to 1e-3 is an RL-sized update."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=generator) * 0.02).to(dtype)
    lora_A = torch.randn(8, cols, generator=generator) * 1e-2
    lora_B = torch.randn(rows, 8, generator=generator) * b_scale
    return weight.to(DEVICE), lora_A.to(DEVICE), lora_B.to(DEVICE)


def fused(weight, lora_A, lora_B):
    from colocate_grpo.kernels import fused_merged_weight

    return fused_merged_weight(weight, lora_A, lora_B, SCALING, weight.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_merge_in_place_writes_the_fused_merges_bits_and_restores_them_bitwise(dtype):
    weight, lora_A, lora_B = lora_layer(100, 300, 1e-4, dtype)  # edges that do not fill the 32 x 128 tiles
    # Values the merge moves by many units in the last place (outliers), and special ones.
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, float("inf"), float("nan")])
    weight.view(-1)[:8] = specials.to(dtype).to(DEVICE)
    before, expected = weight.clone(), fused(weight, lora_A, lora_B)
    merged = MergedInPlace()
    merged.merge(weight, lora_A, lora_B, SCALING)  # without reserve(): memory of its own
    merged.settle()
    record = merged.records[weight.data_ptr()]
    assert record.state is not None and record.copy is None  # the kernels' record, its outliers within their room
    assert torch.equal(bits(weight), bits(expected))
    assert 0 < record.outlier_count < weight.numel() // 100 and record.steps.abs().max() > 0
    assert record.nbytes <= weight.numel() * _MERGE_RECORD_BYTES_PER_WEIGHT + 16  # the memory plan's, and the state
    assert torch.equal(bits(record.original()), bits(before)) and torch.equal(bits(weight), bits(expected))
    merged.restore()
    assert torch.equal(bits(weight), bits(before)) and not merged


@needs_kernels
def test_a_merge_whose_outliers_run_out_of_room_is_redone_with_a_copy_and_restores_bitwise():
    weight, lora_A, lora_B = lora_layer(100, 300, 3e-2)  # far past an RL update: most values move more than a byte
    before, expected = weight.clone(), fused(weight, lora_A, lora_B)
    merged = MergedInPlace()
    merged.reserve([weight])
    merged.merge(weight, lora_A, lora_B, SCALING)
    record = merged.records[weight.data_ptr()]
    # Before the check, the values past the room are unmerged, and the record undoes the rest exactly.
    outliers = int(record.state[0])
    assert outliers > record.outliers.numel() and not torch.equal(bits(weight), bits(expected))
    assert torch.equal(bits(record.original()), bits(before))
    merged.settle()
    record = merged.records[weight.data_ptr()]
    assert record.copy is not None and record.outlier_count == outliers  # counted, past the room too
    assert torch.equal(bits(weight), bits(expected))
    merged.restore()
    assert torch.equal(bits(weight), bits(before))


@needs_kernels
@pytest.mark.parametrize("in_host_memory", [False, True])
@pytest.mark.parametrize("interrupt", ["before a launch", "after a launch", "in the restore"])
def test_an_interrupt_leaves_a_restore_that_puts_every_base_back_bitwise(monkeypatch, in_host_memory, interrupt):
    """A Ctrl-C just before the third merge's kernel launch (its record kept, changing nothing), just after it (its
    steps not yet copied to the host), or just after the restore's first launch (the record not yet marked)."""
    import colocate_grpo.kernels as kernels

    layers = [lora_layer(64 + 32 * i, 200, 1e-3, seed=i) for i in range(4)]
    before = [weight.clone() for weight, _, _ in layers]
    merged = MergedInPlace(in_host_memory)
    merged.reserve([weight for weight, _, _ in layers])
    launch, undo, launches = kernels.merge_in_place, kernels.undo_merge, []

    def interrupted_launch(*args):
        launches.append(args)
        if len(launches) == 3 and interrupt == "before a launch":
            raise KeyboardInterrupt
        launch(*args)
        if len(launches) == 3 and interrupt == "after a launch":
            raise KeyboardInterrupt

    def interrupted_undo(*args):
        undo(*args)
        raise KeyboardInterrupt

    if interrupt == "in the restore":
        monkeypatch.setattr(kernels, "undo_merge", interrupted_undo)
    else:
        monkeypatch.setattr(kernels, "merge_in_place", interrupted_launch)
    with pytest.raises(KeyboardInterrupt):
        for weight, lora_A, lora_B in layers:
            merged.merge(weight, lora_A, lora_B, SCALING)
        merged.settle()
        merged.restore()
    monkeypatch.undo()
    merged.restore()
    merged.restore()  # again: nothing left to do
    assert all(torch.equal(bits(weight), bits(old)) for (weight, _, _), old in zip(layers, before, strict=True))


@pytest.mark.skipif(
    KERNELS or importlib.util.find_spec("triton") is None, reason="the tests above ran the kernels, or no Triton"
)
def test_the_kernels_under_tritons_interpreter():
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    result = subprocess.run(
        command, cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" in result.stdout, result.stdout[-2000:]
