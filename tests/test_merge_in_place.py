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


def restored(layers, before):
    return all(torch.equal(bits(weight), bits(old)) for (weight, _, _), old in zip(layers, before, strict=True))


def group_of(layers):
    from colocate_grpo.lora import MergeGroup

    group = MergeGroup.of(
        [weight for weight, _, _ in layers], [(lora_A, lora_B, SCALING) for _, lora_A, lora_B in layers]
    )
    assert group is not None
    return group


def count_launches(monkeypatch):
    """The grouped and the per-layer merge launches from now on, by kind."""
    import colocate_grpo.kernels as kernels

    launches = {"grouped": 0, "per layer": 0}
    grouped, per_layer = kernels.GroupedMerges.merge, kernels.merge_in_place

    def grouped_launch(self, *args):
        launches["grouped"] += 1
        grouped(self, *args)

    def per_layer_launch(*args):
        launches["per layer"] += 1
        per_layer(*args)

    monkeypatch.setattr(kernels.GroupedMerges, "merge", grouped_launch)
    monkeypatch.setattr(kernels, "merge_in_place", per_layer_launch)
    return launches


def group_layers(b_scales, dtype=torch.bfloat16):
    """Layers of several shapes, none filling the 32 x 128 tiles, columns of several alignments."""
    shapes = [(100, 300), (64, 128), (33, 200), (96, 264)]
    layers = []
    for i, b_scale in enumerate(b_scales):
        generator = torch.Generator().manual_seed(i)
        rows, cols = shapes[i % len(shapes)]
        weight = (torch.randn(rows, cols, generator=generator) * 0.02).to(dtype)
        rank = 8 if i % 2 else 16  # one padded rank for tl.dot: 16
        lora_A = torch.randn(rank, cols, generator=generator) * 1e-2
        lora_B = torch.randn(rows, rank, generator=generator) * b_scale
        layers.append((weight.to(DEVICE), lora_A.to(DEVICE), lora_B.to(DEVICE)))
    return layers


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_group_merges_every_layer_by_one_launch_with_the_per_layer_kernels_bits_and_records(monkeypatch, dtype):
    layers = group_layers([1e-4, 1e-3, 1e-4, 1e-3], dtype)
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, float("inf"), float("nan")])
    layers[0][0].view(-1)[:8] = specials.to(dtype).to(DEVICE)
    before = [weight.clone() for weight, _, _ in layers]
    expected = [fused(weight, lora_A, lora_B) for weight, lora_A, lora_B in layers]
    # The per-layer kernels on copies: the records to compare with.
    copies = [(weight.clone(), lora_A, lora_B) for weight, lora_A, lora_B in layers]
    per_layer = MergedInPlace()
    for weight, lora_A, lora_B in copies:
        per_layer.merge(weight, lora_A, lora_B, SCALING)
    per_layer.settle()

    group, launches = group_of(layers), count_launches(monkeypatch)
    merged = MergedInPlace()
    for _ in range(2):  # the group's tables serve every merge
        merged.merge_group(group)
        merged.settle()
        assert launches == {"grouped": 1, "per layer": 0}
        for (weight, _, _), fused_bits, (copy, _, _) in zip(layers, expected, copies, strict=True):
            assert torch.equal(bits(weight), bits(fused_bits)) and torch.equal(bits(copy), bits(weight))
            mine, theirs = merged.records[weight.data_ptr()], per_layer.records[copy.data_ptr()]
            assert (mine.copy is None) == (theirs.copy is None) and mine.outlier_count == theirs.outlier_count
            if mine.copy is None:  # else redone with a copy, both (fp16's finer steps: more outliers)
                assert torch.equal(mine.steps, theirs.steps)  # the outliers' slots in any order
                count = mine.outlier_count
                assert sorted(mine.outliers[:count].tolist()) == sorted(theirs.outliers[:count].tolist())
            assert torch.equal(bits(merged.original(weight)), bits(per_layer.original(copy)))
        assert sum(record.copy is None for record in merged.records.values()) >= 2
        assert 0 < merged.outlier_fraction == per_layer.outlier_fraction
        with pytest.raises(RuntimeError, match="merged already"):
            merged.merge(layers[1][0], *layers[1][1:], SCALING)
        merged.restore()
        merged.restore()  # again: nothing left to do
        assert not merged and all(
            torch.equal(bits(w), bits(old)) for (w, _, _), old in zip(layers, before, strict=True)
        )
        launches.update({"grouped": 0})


@needs_kernels
def test_a_group_reads_factors_of_another_float_dtype_as_their_fp32_values():
    """The per-layer kernel merges ``A.float()`` and ``B.float()``; the grouped one casts them as it loads them."""
    layers = [(w, a.bfloat16(), b.bfloat16()) for w, a, b in group_layers([1e-3, 1e-4, 1e-3])]
    before = [weight.clone() for weight, _, _ in layers]
    expected = [fused(weight, lora_A.float(), lora_B.float()) for weight, lora_A, lora_B in layers]
    merged = MergedInPlace()
    merged.merge_group(group_of(layers))
    merged.settle()
    assert all(torch.equal(bits(w), bits(e)) for (w, _, _), e in zip(layers, expected, strict=True))
    merged.restore()
    assert restored(layers, before)


@needs_kernels
def test_a_grouped_layer_whose_outliers_run_out_of_room_is_redone_with_a_copy_and_restores_bitwise():
    from colocate_grpo.kernels import MERGED_WORD

    layers = group_layers([1e-3, 3e-2, 1e-3])  # the second far past an RL update: most values move more than a byte
    before = [weight.clone() for weight, _, _ in layers]
    expected = [fused(weight, lora_A, lora_B) for weight, lora_A, lora_B in layers]
    merged = MergedInPlace()
    merged.merge_group(group_of(layers))
    merged.settle()
    records = [merged.records[weight.data_ptr()] for weight, _, _ in layers]
    assert [record.copy is not None for record in records] == [False, True, False]
    assert records[1].outlier_count > merged._group.group.layout.capacities[1]  # counted past the room too
    assert all(torch.equal(bits(w), bits(e)) for (w, _, _), e in zip(layers, expected, strict=True))
    # Had an interrupt come before the kernel's record was marked undone, the group's restore would undo it too:
    # the copy's, after it, has the last word.
    merged._group.memory.states[1, MERGED_WORD] = 1
    merged.restore()
    assert restored(layers, before)


@needs_kernels
@pytest.mark.parametrize("interrupt", ["before the launch", "after the launch", "in a redo", "in the restore"])
def test_an_interrupt_in_a_groups_merge_leaves_a_restore_that_puts_every_base_back_bitwise(monkeypatch, interrupt):
    """A Ctrl-C just before the group's launch (its records kept, changing nothing), just after it (nothing waited
    for), in the redo with a copy of a layer whose outliers ran out of room (its copy kept, its merge not finished),
    or just after the restore's launch (nothing forgotten)."""
    import colocate_grpo.kernels as kernels

    layers = group_layers([1e-3, 3e-2, 1e-3, 1e-4])
    before = [weight.clone() for weight, _, _ in layers]
    group, merged = group_of(layers), MergedInPlace()
    merge, undo = kernels.GroupedMerges.merge, kernels.GroupedMerges.undo

    def interrupted_merge(self, *args):
        if interrupt == "before the launch":
            raise KeyboardInterrupt
        merge(self, *args)
        raise KeyboardInterrupt

    def interrupted_undo(self, *args):
        undo(self, *args)
        raise KeyboardInterrupt

    def interrupted_redo(*args, **kwargs):
        raise KeyboardInterrupt

    if interrupt == "in the restore":
        monkeypatch.setattr(kernels.GroupedMerges, "undo", interrupted_undo)
    elif interrupt == "in a redo":
        monkeypatch.setattr(kernels, "fused_merged_weight", interrupted_redo)
    else:
        monkeypatch.setattr(kernels.GroupedMerges, "merge", interrupted_merge)
    with pytest.raises(KeyboardInterrupt):
        merged.merge_group(group)
        merged.settle()
        merged.restore()
    monkeypatch.undo()
    merged.restore()
    merged.restore()  # again: nothing left to do
    assert restored(layers, before)


@needs_kernels
def test_a_group_with_its_records_in_host_memory_merges_a_layer_at_a_time(monkeypatch):
    """Its steps cross to the host through one staging buffer, a layer at a time."""
    layers = group_layers([1e-3, 3e-2, 1e-4])
    before = [weight.clone() for weight, _, _ in layers]
    expected = [fused(weight, lora_A, lora_B) for weight, lora_A, lora_B in layers]
    group, merged, launches = group_of(layers), MergedInPlace(in_host_memory=True), count_launches(monkeypatch)
    merged.merge_group(group)
    merged.settle()
    assert launches == {"grouped": 0, "per layer": 3}
    assert all(torch.equal(bits(w), bits(e)) for (w, _, _), e in zip(layers, expected, strict=True))
    assert merged.records[layers[0][0].data_ptr()].steps.device.type == "cpu"
    merged.restore()
    assert restored(layers, before)


@needs_kernels
def test_a_merge_into_a_shared_base_is_one_launch_whose_plan_is_kept_while_the_adapters_are_the_same(monkeypatch):
    """sync.merge_into_shared_base on a PEFT model whose base weights an engine shares (the same tensors)."""
    import contextlib

    from peft import LoraConfig, get_peft_model

    from colocate_grpo.lora import RetainedUpdate
    from colocate_grpo.sync import _writes_of, merge_into_shared_base

    class Engine:
        writes_in_place = True

        def __init__(self, model):
            self.model = model

        @contextlib.contextmanager
        def writing_weights(self):
            yield

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    for i, (rows, cols) in enumerate([(96, 160), (160, 96), (40, 96)]):
        base.add_module(f"proj{i}", torch.nn.Linear(cols, rows, bias=False))
    base = base.to(DEVICE, torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["proj0", "proj1", "proj2"]))
    lora = [module for module in model.modules() if hasattr(module, "lora_B") and "default" in module.lora_B]

    def factors_now():
        with torch.no_grad():
            for layer in lora:
                layer.lora_B["default"].weight.normal_(std=1e-3)
        weights = [layer.base_layer.weight for layer in lora]
        expected = [
            fused(w, layer.lora_A["default"].weight, layer.lora_B["default"].weight)
            for w, layer in zip(weights, lora, strict=True)
        ]
        return weights, [w.clone() for w in weights], expected

    engine, merged, launches = Engine(base), MergedInPlace(), count_launches(monkeypatch)
    plans = []
    for stats in (None, RetainedUpdate()):
        weights, before, expected = factors_now()  # new values in the same tensors: the same plan
        merge_into_shared_base(model, engine, merged, stats)
        plans.append(_writes_of[base][model][True]._shared_merge)
        assert all(torch.equal(bits(w), bits(e)) for w, e in zip(weights, expected, strict=True))
        merged.restore()
        assert all(torch.equal(bits(w), bits(old)) for w, old in zip(weights, before, strict=True))
    assert launches == {"grouped": 2, "per layer": 0} and plans[0] is plans[1] and plans[0].group is not None
    assert stats.total == sum(w.numel() for w in weights)
    model.base_model.disable_adapter_layers()  # the adapters changed: a new plan, nothing merged
    merge_into_shared_base(model, engine, merged)
    assert not merged and _writes_of[base][model][True]._shared_merge is not plans[0]


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
