"""LoRA numerics: the merged weight, merge-aware linears, exact merges, retained-update metrics.

Ordinary LoRA optimizes ``W + s * B @ A`` in high precision while vLLM serves
``cast(W + s * B @ A)``: at RL learning rates most of the update rounds away in
the cast. Merge-aware LoRA computes ``y = x @ cast(W + s * B @ A)^T + b`` in the
forward pass, with gradients reaching A and B straight through the cast, so the
weights vLLM serves are bit for bit the ones being optimized. Both the forward
and the sync call :func:`merged_weight`, which is what makes them equal.

Everything here is a pure function of tensors or a small nn.Module subclass; the
wiring into trainers lives in :mod:`colocate_grpo.trainer` and :mod:`colocate_grpo.sync`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer

from colocate_grpo.memory_plan import _MERGE_RECORD_OUTLIER_BYTES_PER_WEIGHT

logger = logging.getLogger(__name__)

MERGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Use the fused Triton merges on CUDA, the merged weight's and the merge in place's (False: the plain PyTorch paths).
FUSED_MERGE = True


def merged_weight(
    base: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cast(W + scaling * B @ A)``, accumulated in fp32 and rounded once.

    Args:
        base: W, shape (out_features, in_features).
        lora_A: A, shape (r, in_features).
        lora_B: B, shape (out_features, r).
        scaling: lora_alpha / r (or alpha / sqrt(r) with rsLoRA).
        dtype: result dtype; defaults to ``base.dtype``.
        out: where to write the result (e.g. rows of an engine's fused parameter), same shape; a
            different dtype than ``dtype`` casts the rounded result once more.

    Returns:
        The merged weight, shape (out_features, in_features), in ``dtype`` (``out`` when given).

    On CUDA a fused Triton kernel computes it in one pass (:mod:`colocate_grpo.kernels`); the
    forward and the sync both come here, so they agree bitwise on each device.
    """
    dtype = dtype or base.dtype
    if base.is_cuda and FUSED_MERGE:
        from colocate_grpo.kernels import fused_merged_weight

        direct = out is not None and out.dtype == dtype and out.is_contiguous() and out.device == base.device
        merged = fused_merged_weight(base, lora_A, lora_B, scaling, dtype, out=out if direct else None)
        if out is None or direct:
            return merged
    else:
        merged = torch.addmm(base.float(), lora_B.float(), lora_A.float(), alpha=scaling).to(dtype)
    return merged if out is None else out.copy_(merged)


def active_lora_name(layer: LoraLayer) -> str | None:
    """The name of the adapter a PEFT LoRA layer computes with, or None when adapters are off or merged.

    Raises:
        ValueError: when several adapters are active (their merge is not one A, B pair).
    """
    if layer.disable_adapters or layer.merged:
        return None
    # Read through the modules' own tables: each sync reads every layer's factors, and nn.Module's attribute
    # lookup costs microseconds a read (1.4 ms a sync for 196 layers on the H200's host).
    lora_A = layer._modules["lora_A"]._modules
    active = [name for name in layer.active_adapters if name in lora_A]
    if len(active) > 1:
        raise ValueError(f"Several LoRA adapters are active ({active}); activate one with set_adapter().")
    return active[0] if active else None


def lora_factors(layer: LoraLayer) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The active adapter's (A, B, scaling) of a PEFT LoRA layer, or None when adapters are off or merged.

    Raises:
        ValueError: when several adapters are active (their merge is not one A, B pair).
    """
    name = active_lora_name(layer)
    if name is None:
        return None
    lora_A, lora_B = layer._modules["lora_A"]._modules, layer._modules["lora_B"]._modules
    return lora_A[name]._parameters["weight"], lora_B[name]._parameters["weight"], layer.scaling[name]


_ACTIVE_ADAPTER = operator.attrgetter("_active_adapter")
_DISABLE_ADAPTERS = operator.attrgetter("_disable_adapters")
_MERGED_ADAPTERS = operator.attrgetter("merged_adapters")
_SCALING = operator.attrgetter("scaling")
_PARAMETERS = operator.attrgetter("_parameters")


class FactorsKey:
    """What :func:`lora_factors` returns for each of ``layers`` now, to tell later whether it changed.

    Equal keys mean the same factors, at the same addresses, with the same scalings: each layer's
    active adapter, its adapters' on/off and merge state, its adapters (added or deleted), the active
    one's scaling and its A and B tensors' addresses. The key is read with maps that run in C: a Python
    loop over a 7B model's 196 LoRA layers took 1.0 ms of the H200 host's time, longer than the write
    into vLLM that it checks. A tensor replaced at the address of one it replaced is not told apart:
    callers hold the tensors they read, so such an address is never free.

    Raises:
        ValueError: when a layer has several active adapters.
    """

    def __init__(self, layers: list[LoraLayer]) -> None:
        self.layers = layers
        self.a_tables = [layer._modules["lora_A"]._modules for layer in layers]
        names = [active_lora_name(layer) for layer in layers]
        active = [i for i, name in enumerate(names) if name is not None]
        self.active_layers = [layers[i] for i in active]
        self.names = [names[i] for i in active]
        self.active_a_tables = [self.a_tables[i] for i in active]
        self.active_b_tables = [layers[i]._modules["lora_B"]._modules for i in active]
        self.value = self._read()

    def _read(self) -> tuple | None:
        """The key now; None when an adapter active at construction is gone."""
        try:
            weight = itertools.repeat("weight")
            lora_A = map(
                operator.getitem, map(_PARAMETERS, map(operator.getitem, self.active_a_tables, self.names)), weight
            )
            lora_B = map(
                operator.getitem, map(_PARAMETERS, map(operator.getitem, self.active_b_tables, self.names)), weight
            )
            return (
                list(map(_ACTIVE_ADAPTER, self.layers)),
                list(map(_DISABLE_ADAPTERS, self.layers)),
                list(map(len, map(_MERGED_ADAPTERS, self.layers))),
                list(map(len, self.a_tables)),
                list(map(operator.getitem, map(_SCALING, self.active_layers), self.names)),
                list(map(torch.Tensor.data_ptr, lora_A)),
                list(map(torch.Tensor.data_ptr, lora_B)),
            )
        except KeyError:
            return None

    def changed(self) -> bool:
        """Whether any layer's factors, their addresses or scaling differ from the construction's."""
        return self.value is None or self._read() != self.value


def lora_gradients(
    grad: torch.Tensor,
    x: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    need_A: bool = True,
    need_B: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dL/dA = s (G B)^T X and dL/dB = s G^T (X A^T) of a layer computing x @ (W + s B A)^T, in low rank: never the
    (out, in) dL/dW. ``grad`` G (tokens, out) and ``x`` X (tokens, in) in the dtype the GEMMs run in (the compute
    dtype, or fp32 on a CPU: :func:`gemm_dtype`), with fp32 accumulation (PEFT's precision under
    autocast); the results in A's and B's dtypes (None where not needed)."""
    grad_A = ((grad @ lora_B.to(grad.dtype)).T @ x).float().mul_(scaling).to(lora_A.dtype) if need_A else None
    grad_B = (grad.T @ (x @ lora_A.to(x.dtype).T)).float().mul_(scaling).to(lora_B.dtype) if need_B else None
    return grad_A, grad_B


def gemm_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype merge-aware LoRA's GEMMs run in on ``device`` for a compute ``dtype``: that dtype on a GPU; fp32 on a
    CPU, on the same values exactly upcast, with one rounding to ``dtype`` at the end (fp32 accumulation, as a bf16
    GEMM has on a GPU). A CPU without bf16 units (AVX2) ran the tiny model's bf16 GEMMs 10 to 60 times slower than
    fp32 ones."""
    return torch.float32 if device.type == "cpu" else dtype


class _MergeAwareLinear(torch.autograd.Function):
    """y = x @ cast(W + s B A)^T + b, with dL/dA and dL/dB taken as if the cast were the identity.

    Saves x only (W, A, B are parameters): the merged weight is rebuilt in backward rather than
    kept, and the A and B gradients are computed in low rank, never forming the (out, in) dL/dW.
    Every GEMM runs on values of the compute dtype with fp32 accumulation (PEFT's precision under autocast), in
    :func:`gemm_dtype`: in that dtype on a GPU, in fp32 on a CPU.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling, dtype):  # noqa: ANN001, ANN205
        merged = merged_weight(weight, lora_A, lora_B, scaling, dtype)
        ctx.save_for_backward(x, weight, lora_A, lora_B)
        ctx.scaling, ctx.dtype = scaling, dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        gemm = gemm_dtype(x.device, dtype)
        bias = None if bias is None else bias.to(dtype).to(gemm)
        return F.linear(x.to(dtype).to(gemm), merged.to(gemm), bias).to(dtype)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        x, weight, lora_A, lora_B = ctx.saved_tensors
        s, dtype = ctx.scaling, ctx.dtype
        grad_x = grad_bias = None
        # On a GPU the GEMMs run in the compute dtype, as casting the (tokens, features) activations and gradients to
        # fp32 would cost more than the matmuls.
        gemm = gemm_dtype(grad_out.device, dtype)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype).to(gemm)
        flat_x = x.reshape(-1, x.shape[-1]).to(dtype).to(gemm)
        if ctx.needs_input_grad[0]:
            merged = merged_weight(weight, lora_A, lora_B, s, dtype).to(gemm)
            grad_x = (flat_grad @ merged).reshape(x.shape).to(x.dtype)
        grad_A, grad_B = lora_gradients(
            flat_grad, flat_x, lora_A, lora_B, s, ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        )
        if ctx.needs_input_grad[2]:
            grad_bias = flat_grad.float().sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_bias, grad_A, grad_B, None, None


def merge_aware_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``x @ cast(W + scaling * B @ A)^T + b`` in ``dtype``; see :class:`_MergeAwareLinear`.

    Shapes: x (..., in), weight (out, in), lora_A (r, in), lora_B (out, r); returns (..., out).
    """
    return _MergeAwareLinear.apply(x, weight, bias, lora_A, lora_B, scaling, dtype)


class MergeAwareLoraLinear(LoraLinear):
    """PEFT's LoRA ``Linear`` whose forward uses the merged, cast weight (see module docs).

    Installed by swapping the class of existing PEFT layers (:func:`install_merge_aware`), so
    PEFT's saving, loading and adapter switching are unchanged. With adapters disabled (TRL's
    reference pass) it is the plain base layer. With dropout it uses the residual form
    ``x @ cast(W + sBA)^T + s * (dropout(x) - x) @ A^T @ B^T``, exact when dropout is off.
    ``merge()`` and ``unmerge()`` restore the base weight bit-exactly.
    """

    merge_dtype: torch.dtype = torch.bfloat16

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        factors = lora_factors(self)
        if factors is None:
            return self.base_layer(x, *args, **kwargs)
        lora_A, lora_B, scaling = factors
        base = self.base_layer
        result = merge_aware_linear(x, base.weight, base.bias, lora_A, lora_B, scaling, self.merge_dtype)
        dropout = self.lora_dropout[self.active_adapters[0]]
        if self.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            lora_x = x.to(lora_A.dtype)
            residual = F.linear(F.linear(dropout(lora_x) - lora_x, lora_A), lora_B) * scaling
            result = result + residual.to(result.dtype)
        return result

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Write the merged weight into the base layer in place, keeping the original bits for unmerge."""
        factors = lora_factors(self)
        if factors is None:
            return
        weight = self.base_layer.weight
        self._unmerged_weight = weight.detach().to("cpu", copy=True)
        weight.data.copy_(merged_weight(weight, *factors, self.merge_dtype))
        self.merged_adapters.extend(a for a in self.active_adapters if a in self.lora_A)

    def unmerge(self) -> None:
        """Put the exact original base weight back."""
        if not self.merged:
            return
        self.base_layer.weight.data.copy_(self._unmerged_weight)
        del self._unmerged_weight
        self.merged_adapters.clear()


def install_merge_aware(model: torch.nn.Module, mode: str = "bf16") -> int:
    """Make every PEFT LoRA linear of ``model`` merge-aware in place; returns how many were converted.

    Layers whose base weight is quantized (bitsandbytes, FP8) keep the ordinary forward, with a warning.

    Raises:
        ValueError: for DoRA adapters or an unknown ``mode``.
    """
    if mode not in MERGE_DTYPES:
        raise ValueError(f"lora_merge_aware must be one of {sorted(MERGE_DTYPES)}, got {mode!r}")
    converted, skipped = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if any(module.use_dora.values()):
            raise ValueError(f"{name}: merge-aware LoRA does not support DoRA; remove use_dora or lora_merge_aware.")
        weight = getattr(module.get_base_layer(), "weight", None)
        plain = (
            type(module) is LoraLinear
            and weight is not None
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        )
        if not plain:
            skipped.append(name)
            continue
        module.__class__ = MergeAwareLoraLinear
        module.merge_dtype = MERGE_DTYPES[mode]
        converted += 1
    if skipped:
        logger.warning(
            "Merge-aware LoRA left %d layers on the ordinary forward (quantized or non-linear base): %s",
            len(skipped),
            ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""),
        )
    return converted


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    """(name, layer) of every PEFT LoRA layer of a model, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@contextlib.contextmanager
def temporarily_merged(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Merge every LoRA layer into its base weight in place; restore the base weights bit-exactly on exit.

    Restores on any exit, an exception or KeyboardInterrupt included. Each layer's original weight
    is kept on the CPU while merged. Works on ordinary and merge-aware layers alike.
    """
    originals: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, layer in lora_layers(model):
                factors = lora_factors(layer)
                if factors is None:
                    continue
                weight = layer.get_base_layer().weight
                originals[name] = weight.detach().to("cpu", copy=True)
                dtype = getattr(layer, "merge_dtype", weight.dtype)
                weight.copy_(merged_weight(weight, *factors, dtype))
        yield model
    finally:
        with torch.no_grad():
            layers = dict(lora_layers(model))
            for name, original in originals.items():
                layers[name].get_base_layer().weight.copy_(original)


# Integer views of a float tensor's bits, by element size: what an exact in-place write compares and restores.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# An index and the old bits of a value whose change does not fit in one byte: about 10 bytes (int64 + bf16).
_OUTLIER_BYTES = 10


@dataclass
class Overwritten:
    """What :func:`overwrite` or :func:`merge_in_place` replaced in a tensor, kept compactly: :meth:`restore` puts its
    old bits back.

    Each value's old bits minus its new bits, as integers, wraps into one byte where it fits (an update a
    few units in the last place wide: a merged LoRA delta, mostly); the values whose change does not fit
    keep their index and old bits. A tensor where that would take more than a plain copy keeps the copy.

    A record of the merge kernels (``state`` set) keeps its outliers in slots of a fixed capacity, of which
    the first ``state[0]`` are filled (all where the count is past the capacity: see :func:`merge_in_place`),
    and says on the device whether the merge ran and is not undone yet (``state[1]``): a record whose kernel
    never ran, or that a restore undid already, changes nothing. Nothing of it waits on the host.
    """

    target: torch.Tensor
    steps: torch.Tensor | None  # int8, target's shape: old bits - new bits, wrapped to 16 (or 32) bits; 0 at outliers
    outliers: torch.Tensor | None  # int64 flat indices of the values whose step does not fit in int8
    outlier_bits: torch.Tensor | None  # their old bits
    copy: torch.Tensor | None  # the old bits whole, where the outliers would take more
    state: torch.Tensor | None = None  # the kernels' record: int32 (kernels.STATE_WORDS,) on the target's device
    staging: torch.Tensor | None = None  # the kernels' device buffer for steps kept in host memory (int8, >= numel)
    appended: int | None = None  # the kernels' outlier count, once read on the host (MergedInPlace.settle)
    restored: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes this record holds on the target's device (steps kept in host memory, and their staging buffer,
        which the records of one merge share, not counted)."""
        kept = (self.steps, self.outliers, self.outlier_bits, self.copy, self.state)
        return sum(t.nbytes for t in kept if t is not None and t.device == self.target.device)

    @property
    def outlier_count(self) -> int:
        """Values whose change did not fit in one byte (all of them where a copy is kept, unless the kernels
        counted them)."""
        if self.copy is not None:
            return self.copy.numel() if self.appended is None else self.appended
        if self.state is not None:
            appended = self.appended if self.appended is not None else int(self.state[0])
            return min(appended, self.outliers.numel())
        return 0 if self.outliers is None else self.outliers.numel()

    def original(self) -> torch.Tensor:
        """A new tensor holding the target's old values, bitwise; the target is not touched."""
        old = self.target.detach().clone()
        self._apply(old, spend=False)
        return old

    @torch.no_grad()
    def restore(self) -> None:
        """Put the target's old bits back, exactly; again is a no-op, also after an interrupt in between."""
        if not self.restored:
            self._apply(self.target.data, spend=True)
            self.restored = True

    def _apply(self, tensor: torch.Tensor, spend: bool) -> None:
        """Undo the write on ``tensor`` (the target or a copy of it); ``spend``: it is the target (see restore)."""
        bits = tensor.view(_BITS[tensor.element_size()])
        if self.copy is not None:
            bits.copy_(self.copy)
            return
        if self.state is not None:
            from colocate_grpo.kernels import undo_merge

            # One launch that checks on the device that the merge ran and is not undone, and marks it undone: an
            # interrupt anywhere leaves a restore to redo, or one that finds nothing to do.
            undo_merge(bits, self._device_steps(), self.outliers, self.outlier_bits, self.state, spend)
            return
        # The outliers first: their steps are 0, so an interrupt before the steps' add leaves a restore to redo.
        if self.outliers.numel():
            bits.view(-1).index_copy_(0, self.outliers, self.outlier_bits)
        # Steps kept in (pinned) host memory cross to the device a tensor at a time, in stream order.
        bits.add_(self.steps.to(bits.device, non_blocking=True))  # wraps, as the subtraction that made them did

    def _device_steps(self) -> torch.Tensor:
        """The steps where the kernels read them: their own, or, kept in host memory, copied into the staging
        buffer (in stream order, so that the buffer is free again for the next record's)."""
        if self.steps.device == self.target.device:
            return self.steps
        return self.staging[: self.steps.numel()].copy_(self.steps.view(-1), non_blocking=True)


@torch.no_grad()
def overwrite(target: torch.Tensor, value: torch.Tensor, steps_out: torch.Tensor | None = None) -> Overwritten:
    """Write ``value`` into ``target`` in place; the record returned restores ``target`` bitwise.

    For a merge into the weight it came from (``cast(W + s * B @ A)`` over W) the record takes about
    one byte per value, against the two of a bf16 copy. PyTorch on any device; it waits for the device once
    (its outliers' count). :func:`merge_in_place` merges a LoRA without waiting.

    Args:
        target: a contiguous float tensor (a base weight, or its rows of an engine's fused parameter).
        value: its new values, same shape; cast to ``target``'s dtype as ``copy_`` would.
        steps_out: an int8 tensor of ``target``'s shape, on any device (pinned host memory, where the
            device is short of a byte per value), that keeps the record's steps; reused, not read.
    """
    if not target.is_contiguous():
        raise ValueError("overwrite needs a contiguous target")
    bits_type = _BITS[target.element_size()]
    new = value.to(target.dtype).contiguous()
    old_bits, new_bits = target.view(bits_type), new.view(bits_type)
    wide_steps = old_bits - new_bits
    steps = wide_steps.to(torch.int8)
    outliers = (steps != wide_steps).view(-1).nonzero().squeeze(1)
    if steps.nbytes + outliers.numel() * _OUTLIER_BYTES > target.nbytes:
        record = kept_whole(target, target.clone())
    else:
        steps.view(-1)[outliers] = 0
        if steps_out is not None:
            steps = steps_out.copy_(steps, non_blocking=True)
        record = Overwritten(target, steps, outliers, old_bits.view(-1)[outliers], copy=None)
    target.copy_(new)
    return record


def kept_whole(target: torch.Tensor, old: torch.Tensor, outlier_count: int | None = None) -> Overwritten:
    """A record that puts ``old`` (``target``'s old values: same shape and dtype) back into ``target`` whole;
    ``outlier_count``: how many of the values changed by more than a byte, where that is known."""
    return Overwritten(target, None, None, None, copy=old.view(_BITS[old.element_size()]), appended=outlier_count)


def merges_by_kernel(target: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`merge_in_place` merges into ``target`` with ``dtype`` (None: the target's): a contiguous bf16
    or fp16 tensor on CUDA, or anywhere under Triton's interpreter (``TRITON_INTERPRET=1``: the CPU tests), merged
    in its own dtype. A 32-bit weight's merged change rarely fits in a byte: :func:`overwrite` keeps a copy."""
    usable = target.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    fits_a_byte = target.dtype in (torch.bfloat16, torch.float16) and dtype in (None, target.dtype)
    return FUSED_MERGE and usable and fits_a_byte and target.is_contiguous()


def outlier_capacity(target: torch.Tensor) -> int:
    """Outlier slots of :func:`merge_in_place`'s record for ``target``: the memory plan's room for them, per weight
    (``memory_plan._MERGE_RECORD_OUTLIER_BYTES_PER_WEIGHT``), in slots of an int64 index and the old bits."""
    slot_bytes = 8 + target.element_size()
    return int(target.numel() * _MERGE_RECORD_OUTLIER_BYTES_PER_WEIGHT) // slot_bytes


class MergeLayout:
    """Where the records of a merge into each of many targets (of one element size, on one device) lie in the memory
    of all their records (:class:`MergeRecords`): worked out once for a set of targets, kept for every merge.

    Args:
        targets: the tensors to be merged into.
    """

    def __init__(self, targets: list[torch.Tensor]) -> None:
        self.targets = targets
        self.numels = [target.numel() for target in targets]
        self.capacities = [outlier_capacity(target) for target in targets]
        self.steps_starts = list(itertools.accumulate(self.numels, initial=0))[:-1]
        self.slot_starts = list(itertools.accumulate(self.capacities, initial=0))[:-1]
        self.index = {target.data_ptr(): i for i, target in enumerate(targets)}  # by target address


class MergeRecords:
    """The records of :func:`merge_in_place` into many targets (of one element size, on one device): their memory in
    one allocation of each kind, each target's record carved from it as it is merged (:meth:`blank`), or all merged
    by one launch (:class:`MergeGroup`), their records carved only where asked for (:meth:`record`).

    Carving as the merges go costs the host a few microseconds a target while the device works, rather than all
    of them before the first merge starts.

    Args:
        targets: the tensors to be merged into, or their layout.
        staging: the steps will be kept in host memory: the records share one staging buffer on the device, the
            size of the largest target, instead of their own steps there.
    """

    def __init__(self, targets: list[torch.Tensor] | MergeLayout, staging: bool = False) -> None:
        from colocate_grpo.kernels import STATE_WORDS

        self.layout = layout = targets if isinstance(targets, MergeLayout) else MergeLayout(targets)
        device = layout.targets[0].device
        slots = sum(layout.capacities)
        self.staging = torch.empty(max(layout.numels), dtype=torch.int8, device=device) if staging else None
        self.steps = torch.empty(0 if staging else sum(layout.numels), dtype=torch.int8, device=device)
        self.outliers = torch.empty(slots, dtype=torch.int64, device=device)
        self.outlier_bits = torch.empty(slots, dtype=_BITS[layout.targets[0].element_size()], device=device)
        self.states = torch.zeros(len(layout.targets), STATE_WORDS, dtype=torch.int32, device=device)
        self._carved: set[int] = set()  # the targets given a blank record, by index

    def blank(self, target: torch.Tensor) -> Overwritten | None:
        """A record for ``target`` that changes nothing until its merge runs; None where ``target`` has no place, or
        had one already."""
        i = self.layout.index.get(target.data_ptr())
        if i is None or i in self._carved:
            return None
        self._carved.add(i)
        return self.record(i)

    def record(self, i: int) -> Overwritten:
        """The record of the ``i``-th target in its place (as its merge left it, or blank)."""
        layout, target = self.layout, self.layout.targets[i]
        steps_start, numel = layout.steps_starts[i], layout.numels[i]
        steps = self.steps[steps_start : steps_start + numel] if self.staging is None else self.staging[:numel]
        slots = slice(layout.slot_starts[i], layout.slot_starts[i] + layout.capacities[i])
        return Overwritten(
            target,
            steps.view(target.shape),
            self.outliers[slots],
            self.outlier_bits[slots],
            None,
            state=self.states[i],
            staging=self.staging,
        )


class MergeGroup:
    """The merges in place of many LoRA layers by one kernel launch, and their restore by one
    (:class:`colocate_grpo.kernels.GroupedMerges`): each layer's merged bits and record are :func:`merge_in_place`'s.

    Launched one at a time, the kernels of a 1.5B model's 196 layers cost the host about 0.1 ms each, ten times the
    device's time. A group is built once for a set of layers (its tables on the device, the layout of its records)
    and merges them as long as they are the same tensors: it holds W, A and B, and reads their values at each launch.

    Args:
        layout: of the layers' base weights (the targets).
        factors: each layer's (A, B, scaling).
    """

    def __init__(self, layout: MergeLayout, factors: list[tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        from colocate_grpo.kernels import GroupedMerges

        self.layout, self.factors = layout, factors
        lora_As, lora_Bs, scalings = (list(column) for column in zip(*factors, strict=True))
        self.launches = GroupedMerges(
            layout.targets, lora_As, lora_Bs, scalings, layout.steps_starts, layout.slot_starts, layout.capacities
        )

    @classmethod
    def of(
        cls,
        targets: list[torch.Tensor],
        factors: list[tuple[torch.Tensor, torch.Tensor, float]],
        dtypes: list[torch.dtype | None] | None = None,
    ) -> MergeGroup | None:
        """The group of these layers (``dtypes``: each one's merge dtype, None: its base's), or None where one launch
        cannot merge them: a layer :func:`merges_by_kernel` does not take, or layers the grouped kernels cannot
        share (see :class:`~colocate_grpo.kernels.GroupedMerges`)."""
        from colocate_grpo.kernels import GroupedMerges

        dtypes = dtypes or [None] * len(targets)
        if not targets or not all(merges_by_kernel(t, d) for t, d in zip(targets, dtypes, strict=True)):
            return None
        if not GroupedMerges.takes(targets, [f[0] for f in factors], [f[1] for f in factors]):
            return None
        return cls(MergeLayout(targets), factors)

    def merge(self, records: MergeRecords) -> None:
        """Launch every layer's merge into its place in ``records`` (from this group's layout, not merged yet)."""
        self.launches.merge(records.steps, records.outliers, records.outlier_bits, records.states)

    def restore(self, records: MergeRecords) -> None:
        """Launch every layer's restore from ``records``: a layer whose merge never ran, or that a restore undid
        already, is left as it is (each record says so on the device), so a restore interrupted anywhere can be
        redone."""
        self.launches.undo(records.steps, records.outliers, records.outlier_bits, records.states)


def merge_in_place(
    record: Overwritten,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    host_steps: torch.Tensor | None = None,
) -> None:
    """Merge ``cast(W + scaling * B @ A)`` into the record's target W in place, and write the record, in one pass on
    the device (:func:`colocate_grpo.kernels.merge_in_place`); nothing waits on the host.

    The merged bits are :func:`merged_weight`'s on CUDA. Values whose change needs more than a byte take
    outlier slots; where the slots run out, some values stay unmerged, which the record tells
    (``outlier_count < appended``, once read) and undoes exactly all the same: :class:`sync.MergedInPlace`
    redoes such a merge with a copy.

    Args:
        record: from :meth:`MergeRecords.blank`, not merged yet (its target on CUDA, :func:`merges_by_kernel`).
        lora_A, lora_B, scaling: A (r, in_features), B (out_features, r) and the scaling.
        host_steps: int8 host memory of the target's shape (page-locked) that keeps the steps, for a record made
            with ``staging``: they are copied there from its staging buffer, in stream order.
    """
    from colocate_grpo.kernels import merge_in_place as launch

    launch(record.target, lora_A, lora_B, scaling, record.steps, record.outliers, record.outlier_bits, record.state)
    if host_steps is not None:
        # The steps are in the staging buffer until this copy; the record points there until it is launched, and the
        # next merge, the only writer of the buffer, comes after: an interrupt in between loses nothing.
        record.steps = host_steps.copy_(record.steps, non_blocking=True)


@dataclass
class RetainedUpdate:
    """How much of the LoRA delta survives the cast to the served dtype, summed over layers.

    ``retained`` is the projection of the served change (cast(W + D) - W) onto the delta D:
    <served change, D> / <D, D>. 1 means the whole update is served, 0 that none of it is.
    ``changed_fraction`` is the share of weight entries the merge changes.
    """

    dot: float = 0.0
    delta_sq: float = 0.0
    changed: int = 0
    total: int = 0

    def add(self, base: torch.Tensor, delta: torch.Tensor, served: torch.Tensor) -> None:
        """Account one layer: base W, fp32 delta D (same shape) and the served weight."""
        served_change = served.float() - base.float()
        self.dot += float((served_change * delta).sum())
        self.delta_sq += float((delta * delta).sum())
        self.changed += int((served != base).sum())
        self.total += base.numel()

    @property
    def retained(self) -> float:
        return self.dot / self.delta_sq if self.delta_sq > 0 else math.nan

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else math.nan


def retained_update(model: torch.nn.Module, dtype: torch.dtype | None = None) -> RetainedUpdate:
    """The retained-update statistics of every active LoRA layer (ordinary merge semantics).

    Args:
        dtype: the served dtype; defaults to each base weight's dtype.
    """
    stats = RetainedUpdate()
    with torch.no_grad():
        for _, layer in lora_layers(model):
            factors = lora_factors(layer)
            if factors is None:
                continue
            lora_A, lora_B, scaling = factors
            base = layer.get_base_layer().weight
            delta = scaling * (lora_B.float() @ lora_A.float())
            stats.add(base, delta, merged_weight(base, lora_A, lora_B, scaling, dtype))
    return stats
