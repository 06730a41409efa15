"""Getting the trainer's weights into the colocated engine.

Each LoRA linear's merged weight is computed from the trainer's base weight and
adapter, on GPUs straight into the engine's parameter. Where the trainer's base
weights are the engine's (one shared copy, :mod:`colocate_grpo.shared_base`), the
merge goes into them in place for the generation, with a compact record that puts
the base back bitwise before the trainer computes again (:class:`MergedInPlace`).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer

from colocate_grpo.engine import Engine, ParameterView, Weights, parameter_views
from colocate_grpo.lora import (
    FactorsKey,
    MergeGroup,
    MergeRecords,
    Overwritten,
    RetainedUpdate,
    kept_whole,
    lora_factors,
    merge_in_place,
    merged_weight,
    merges_by_kernel,
    overwrite,
)

logger = logging.getLogger(__name__)


def hf_name(peft_name: str) -> str:
    """A PEFT parameter name as the base model (and vLLM's loader) knows it."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def frozen_base(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's frozen parameters outside its LoRA factors, by Hugging Face name (a tied head once)."""
    return {
        hf_name(name): param
        for name, param in model.named_parameters()
        if not param.requires_grad and ".lora_" not in name
    }


def _copy(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``target.copy_(source)``; on CUDA by a kernel where it can, as replays of copy_ were slower (kernels.py)."""
    same_layout = source.dtype == target.dtype and source.is_contiguous() and target.is_contiguous()
    if target.is_cuda and source.device == target.device and same_layout:
        from colocate_grpo.kernels import copy_by_kernel

        copy_by_kernel(target, source)
        return target
    return target.copy_(source)


@dataclass(frozen=True)
class _Source:
    """One tensor the engine needs: the trainer's parameter, and the LoRA layer merged into it, if any."""

    name: str  # Hugging Face name
    param: torch.Tensor
    layer: LoraLayer | None

    def changes_in_training(self) -> bool:
        return self.layer is not None or self.param.requires_grad

    @torch.no_grad()
    def value(self, stats: RetainedUpdate | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor to serve (written into ``out`` when given), LoRA merged in when active."""
        factors = lora_factors(self.layer) if self.layer is not None else None
        if factors is None:
            return self.param.detach() if out is None else _copy(out, self.param)
        merged = merged_weight(self.param, *factors, getattr(self.layer, "merge_dtype", None), out=out)
        if stats is not None:
            _account(stats, self.param, factors, merged)
        return merged

    def merge_into_base(self, merged: MergedInPlace, stats: RetainedUpdate | None) -> None:
        """Merge the layer's active LoRA into the parameter in place (the engine's too), recorded in ``merged``.
        Under ``torch.no_grad()``, as :func:`merge_into_shared_base` calls it (a decorator costs each layer)."""
        if stats is not None:  # before the merge overwrites the base that the statistics compare with
            self.account(stats)
        merged.merge(self.param, *lora_factors(self.layer), getattr(self.layer, "merge_dtype", None))

    def account(self, stats: RetainedUpdate) -> None:
        """Add the retained update of the layer's merge (not done yet) to ``stats``."""
        factors = lora_factors(self.layer)
        _account(
            stats, self.param, factors, merged_weight(self.param, *factors, getattr(self.layer, "merge_dtype", None))
        )


def _account(
    stats: RetainedUpdate, base: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor, float], served: torch.Tensor
) -> None:
    """Add one layer's retained update: its base, its LoRA factors (A, B, scaling) and the weight served."""
    lora_A, lora_B, scaling = factors
    stats.add(base, scaling * (lora_B.float() @ lora_A.float()), served)


# Walking a PEFT model's modules costs milliseconds, as much as the copies of a sync: once per model.
_sources_of: weakref.WeakKeyDictionary[torch.nn.Module, list[_Source]] = weakref.WeakKeyDictionary()
_base_sources_of: weakref.WeakKeyDictionary[torch.nn.Module, list[_Source]] = weakref.WeakKeyDictionary()


def _sources(model: torch.nn.Module, merge: bool = True) -> list[_Source]:
    """The model's served tensors in parameter order (so fused groups q, k, v and gate, up arrive together).

    With ``merge=False`` the LoRA layers' base weights are served as they are (the engine applies
    the adapter itself), so nothing a sync sends changes in training.
    """
    if not merge:
        if model not in _base_sources_of:
            _base_sources_of[model] = [dataclasses.replace(s, layer=None) for s in _sources(model)]
        return _base_sources_of[model]
    if model not in _sources_of:
        lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
        sources = []
        for name, param in model.named_parameters():
            if ".lora_" in name:
                continue
            owner, _, leaf = name.rpartition(".")
            layer = lora_layers.get(owner.removesuffix(".base_layer")) if leaf == "weight" else None
            sources.append(_Source(hf_name(name), param, layer))
        _sources_of[model] = sources
    return _sources_of[model]


def merged_named_weights(
    model: torch.nn.Module, stats: RetainedUpdate | None = None, include_frozen: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight the engine needs, under Hugging Face names, with LoRA merged in.

    Yields (name, tensor) in the model's parameter order, so fused groups (q, k, v; gate, up)
    arrive together. Merged tensors are fresh (in the layer's merge dtype for merge-aware
    layers, so they equal its forward's weight bitwise); the others are the trainer's own.
    When ``stats`` is given, each merged layer's retained update is added to it. With
    ``include_frozen=False`` only tensors that training can change are yielded: the weights of
    LoRA layers and parameters that require gradients.
    """
    for source in _to_send(_sources(model), include_frozen):
        yield source.name, source.value(stats)


def merged_names(model: torch.nn.Module) -> set[str]:
    """Hugging Face names of the weights a merged sync writes a LoRA layer into: the layers' base weights."""
    return {source.name for source in _sources(model) if source.layer is not None}


def _to_send(sources: list[_Source], include_frozen: bool) -> Iterator[_Source]:
    return (s for s in sources if include_frozen or s.changes_in_training())


# Tensors smaller than this are copied together in one foreach kernel rather than one copy each: a copy
# costs about 3 microseconds of a replay however small (Qwen2 has some 140 norms and biases).
_BATCHED_COPY_BYTES = 2**20


@dataclass(frozen=True)
class _Capture:
    """A captured CUDA graph, what it was captured for, and the tensors it reads at their addresses then."""

    graph: torch.cuda.CUDAGraph
    include_frozen: bool
    adapters: FactorsKey  # the LoRA factors at the capture
    reads: list[torch.Tensor]
    addresses: list[int]

    def reads_same_memory(self, include_frozen: bool) -> bool:
        """Whether a replay now writes what it was captured for, reading the same memory."""
        return include_frozen == self.include_frozen and list(map(torch.Tensor.data_ptr, self.reads)) == self.addresses


class _InPlaceWrites:
    """Writing one trainer model's tensors into one engine's parameters, replayed as a CUDA graph.

    A sync is a few hundred small kernel launches whose Python overhead is several times their
    device time. The same launches with the same pointers repeat every sync (vLLM's sleep mode
    maps woken memory back at the same addresses; the optimizer updates the adapters in place),
    so after one eager write they are captured once and replayed. A change of what the launches
    read (other adapters, adapters off, new scalings, tensors moved to new memory) is a new capture.

    Reading every LoRA layer's adapter state takes about as long as a replay at 1.5B, so it is
    done while the device replays. That is safe because a replay reads only tensors the capture
    holds, at addresses checked just before it: a stale graph can write stale values, never read
    freed memory, and its values are overwritten by the eager write that follows.
    """

    def __init__(self, sources: list[_Source], views: dict[str, ParameterView]) -> None:
        self.sources = sources
        self.views = views
        self.layers = [s.layer for s in sources if s.layer is not None]
        self.cuda = next(iter(views.values())).rows.is_cuda
        self.capture: _Capture | None = None
        self._shared_merge: _SharedMerge | None = None

    def shared_merge(self) -> _SharedMerge:
        """What :func:`merge_into_shared_base` writes, kept while it holds (:class:`_SharedMerge`)."""
        if self._shared_merge is None or not self._shared_merge.holds():
            self._shared_merge = _SharedMerge.of(self)
        return self._shared_merge

    def merges_into_the_base(self) -> bool:
        """Whether the LoRA layers' base weights are the engine's parameters they would be merged into (shared).

        Sharing is all or nothing (:func:`colocate_grpo.shared_base.share_base_weights`): the first layer tells.
        """
        first = next((s for s in self.sources if s.layer is not None), None)
        return first is not None and first.param.data_ptr() == self.views[first.name].rows.data_ptr()

    def _reads(self) -> list[torch.Tensor]:
        """Every tensor a write reads: the trainer's parameters and the active LoRA factors."""
        factors = [lora_factors(layer) for layer in self.layers]
        return [s.param for s in self.sources] + [t for f in factors if f is not None for t in f[:2]]

    def _write(self, include_frozen: bool, stats: RetainedUpdate | None) -> None:
        small: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for source in _to_send(self.sources, include_frozen):
            view = self.views[source.name]
            if source.layer is None and source.param.nbytes < _BATCHED_COPY_BYTES:
                small[0].append(view.rows)
                small[1].append(source.param)
            else:
                source.value(stats, out=view.rows)
            if view.padding is not None:
                view.padding.zero_()
        if small[0]:
            torch._foreach_copy_(*small)

    @torch.no_grad()
    def __call__(self, include_frozen: bool, stats: RetainedUpdate | None) -> None:
        if stats is not None or not self.cuda:  # the retained-update statistics are computed eagerly
            self._write(include_frozen, stats)
            return
        if self.capture is not None and self.capture.reads_same_memory(include_frozen):
            self.capture.graph.replay()
            # The replay read the captured tensors; whether they are still the model's adapters is read
            # while the device writes (the trainer's parameters were among the addresses just checked).
            if not self.capture.adapters.changed():
                return
        adapters = FactorsKey(self.layers)
        self._write(include_frozen, None)  # also compiles the merge kernel before its capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._write(include_frozen, None)
        reads = self._reads()
        # Only a completed capture is ever replayed.
        self.capture = _Capture(graph, include_frozen, adapters, reads, list(map(torch.Tensor.data_ptr, reads)))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass
class _SharedMerge:
    """A merge into a shared base, worked out for one trainer model and one engine: the tensors the engine holds
    apart (copied), the LoRA layers merged in place, and their group (one launch for all of them, on CUDA; None
    where it cannot merge them). Working it out reads every layer's adapter state, about as long as the device's
    merge at 1.5B: kept while the parameters, the engine's views of them and the adapters are those it was worked
    out from (:meth:`holds`, read in C: :class:`~colocate_grpo.lora.FactorsKey`)."""

    copied: list[_Source]
    merging: list[_Source]
    group: MergeGroup | None
    adapters: FactorsKey
    params: list[torch.Tensor]  # every source's parameter, and the engine's rows of the ones sent
    requires_grad: list[bool]
    addresses: list[int]

    @classmethod
    def of(cls, writes: _InPlaceWrites) -> _SharedMerge:
        adapters = FactorsKey(writes.layers)
        active = {id(layer) for layer in adapters.active_layers}
        sources = list(_to_send(writes.sources, include_frozen=False))
        shared = {s.name: writes.views[s.name].rows.data_ptr() == s.param.data_ptr() for s in sources}
        copied = [s for s in sources if not shared[s.name]]
        merging = [s for s in sources if shared[s.name] and id(s.layer) in active]
        dtypes = [getattr(s.layer, "merge_dtype", None) for s in merging]
        group = MergeGroup.of([s.param for s in merging], [lora_factors(s.layer) for s in merging], dtypes)
        params = [s.param for s in writes.sources] + [writes.views[s.name].rows for s in sources]
        requires_grad = list(map(_REQUIRES_GRAD, params[: len(writes.sources)]))
        return cls(copied, merging, group, adapters, params, requires_grad, list(map(torch.Tensor.data_ptr, params)))

    def holds(self) -> bool:
        """Whether the parameters, their addresses, which of them train and the adapters are still the same."""
        sources = len(self.requires_grad)
        return (
            list(map(torch.Tensor.data_ptr, self.params)) == self.addresses
            and list(map(_REQUIRES_GRAD, self.params[:sources])) == self.requires_grad
            and not self.adapters.changed()
        )


# Per engine model (vLLM's nn.Module), per trainer model, merged or not (None: not writable in place):
# dropped with the engine's model, so that the views into its parameters do not keep its memory alive.
_WritesByModel = weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, _InPlaceWrites | None]]
_writes_of: weakref.WeakKeyDictionary[torch.nn.Module, _WritesByModel] = weakref.WeakKeyDictionary()


def _in_place_writes(model: torch.nn.Module, engine: Engine, merge: bool) -> _InPlaceWrites | None:
    """The model's in-place writes into the engine, or None when the engine cannot take them."""
    if not engine.writes_in_place:
        return None
    per_model = _writes_of.setdefault(engine.model, weakref.WeakKeyDictionary()).setdefault(model, {})
    if merge not in per_model:
        sources = _sources(model, merge)
        views = parameter_views(engine.model, {s.name: tuple(s.param.shape) for s in sources})
        per_model[merge] = None if views is None else _InPlaceWrites(sources, views)
    return per_model[merge]


def push_weights(
    model: torch.nn.Module, engine: Engine, stats: RetainedUpdate | None = None, merge: bool = True
) -> None:
    """Send the trainer's current (merged) weights to the engine and drop its prefix cache.

    On GPUs each merged weight is computed straight into the engine's parameter (its rows of a
    fused qkv_proj or gate_up_proj), with the launches replayed as one CUDA graph: no second copy
    of the model, no per-tensor loader calls. Elsewhere (CPU, layouts vLLM changes) the tensors go
    through vLLM's loader. Frozen tensors are sent only when the engine lost its weights (a
    level-2 sleep, a failed load): after a level-1 sleep, or awake, it still holds them.

    Args:
        stats: filled with the retained-update statistics of this sync when given.
        merge: merge each LoRA layer's adapter into its weight; False sends the base weights alone
            (an engine that applies the adapter itself: :mod:`colocate_grpo.adapters`).
    """
    include_frozen = engine.state.weights not in (Weights.RESIDENT, Weights.OFFLOADED)
    writes = _in_place_writes(model, engine, merge)
    if merge and writes is not None and writes.merges_into_the_base():
        raise ValueError(
            "The trainer's base weights are the engine's (one shared copy): a merged push would write into the base "
            "itself. Use merge_into_shared_base, which records how to restore it."
        )
    if writes is None:
        sources = _to_send(_sources(model, merge), include_frozen)
        engine.load_weights((source.name, source.value(stats)) for source in sources)
        return
    with engine.writing_weights():
        writes(include_frozen, stats)


@dataclass
class _GroupMerged:
    """A :class:`~colocate_grpo.lora.MergeGroup`'s merge in place: its records' memory, their outlier counts once
    settled, and the records carved from it (by layer index) once asked for."""

    group: MergeGroup
    memory: MergeRecords
    appended: list[int] | None = None
    carved: dict[int, Overwritten] = dataclasses.field(default_factory=dict)

    def record(self, i: int) -> Overwritten:
        if i not in self.carved:
            record = self.memory.record(i)
            record.appended = None if self.appended is None else self.appended[i]
            self.carved[i] = record
        return self.carved[i]


class MergedInPlace:
    """The base weights a sync merged into in place (shared with the engine), and how to restore them bitwise.

    Empty when the trainer's weights are its own. The engine serves the merged weights until
    :meth:`restore`; the trainer must not compute in between (``ColocatedGeneration`` restores
    after every generation, and after a sync that fails part way).

    On CUDA a sync merges every layer by one kernel launch that writes the merged weights and their records
    (:meth:`merge_group`), into memory allocated for all of them at once, and restores them by one; a merge
    of one layer (:meth:`merge`) is a kernel of its own (:func:`lora.merge_in_place`). Nothing waits on the host
    until :meth:`settle`, once for all the merges, checks that none ran out of room for its outliers (and redoes
    those that did with a copy). Elsewhere each merge is computed, then written over the base
    (:func:`lora.overwrite`).

    An interrupt (Ctrl-C) anywhere leaves records that :meth:`restore` makes exact, whether or not it was
    itself interrupted before: a kernel's records are kept before its launch, and say on the device whether
    their merge ran, which a kernel once launched does whole; a restore's kernel undoes only merges that ran and
    are not undone, and marks each undone when the last of its programs finishes. A record that a copy replaces is
    kept until the copy holds the old bits, and a group's restore runs before the copies'. PyTorch's records put
    the outliers' old bits back first (their steps are 0, so this is idempotent), then add the steps, then mark
    themselves restored.

    Args:
        in_host_memory: keep the records' steps (a byte per merged weight) in host memory, where the
            device cannot hold them beside the engine (the memory plan decides). Each merge then copies
            them to the host and each restore back, a weight at a time, into buffers allocated once
            (:meth:`reserve`) and reused; a group merges a layer at a time.
    """

    def __init__(self, in_host_memory: bool = False) -> None:
        self.in_host_memory = in_host_memory
        self._records: dict[int, Overwritten] = {}  # by the base weight's address, in the order merged
        self._group: _GroupMerged | None = None  # the group merged by one launch, until restored
        self._host_steps: dict[int, torch.Tensor] = {}  # by the base weight's address: views of one host buffer
        self._memory: MergeRecords | None = None  # the kernels' record memory of this merge, until restored
        self._unsettled: list[tuple[Overwritten, torch.Tensor, torch.Tensor, float]] = []  # kernels' merges, factors

    def __bool__(self) -> bool:
        return bool(self._records) or self._group is not None

    @property
    def records(self) -> dict[int, Overwritten]:
        """Every merged base weight's record, by its address (a group's carved from its memory on the way)."""
        records = dict(self._records)
        if self._group is not None:
            for i, target in enumerate(self._group.group.layout.targets):
                records.setdefault(target.data_ptr(), self._group.record(i))
        return records

    def reserve(self, bases: list[torch.Tensor]) -> None:
        """Allocate the records' memory for a merge into ``bases``, once before it: on CUDA the kernels' (freed by
        :meth:`restore`; a base merged without it gets memory of its own), and with ``in_host_memory`` the steps'
        host buffers of the bases that have none, as one allocation, page-locked on CUDA machines
        (:func:`_page_locked`), kept for the next merges."""
        by_kernel = [base for base in bases if merges_by_kernel(base)]
        if by_kernel and self._memory is None:
            self._memory = MergeRecords(by_kernel, staging=self.in_host_memory)
        self._reserve_host(bases)

    def _reserve_host(self, bases: list[torch.Tensor]) -> None:
        if not self.in_host_memory:
            return
        missing = [base for base in bases if base.data_ptr() not in self._host_steps]
        if not missing:
            return
        buffer = _page_locked(self, sum(base.numel() for base in missing))
        for base, steps in zip(missing, buffer.split([base.numel() for base in missing]), strict=True):
            self._host_steps[base.data_ptr()] = steps.view(base.shape)

    def add(self, base: torch.Tensor, merged: torch.Tensor) -> None:
        """Write ``merged`` into ``base`` in place, remembering how to undo it."""
        self._check_unmerged(base)
        self._reserve_host([base])
        self._records[base.data_ptr()] = overwrite(base, merged, self._host_steps.get(base.data_ptr()))

    def merge(
        self,
        base: torch.Tensor,
        lora_A: torch.Tensor,
        lora_B: torch.Tensor,
        scaling: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Merge ``cast(base + scaling * lora_B @ lora_A)`` (in ``dtype``, None: the base's) into ``base`` in place,
        remembering how to undo it; on CUDA without waiting for the device (:meth:`settle` does, once).

        Shapes: base (out_features, in_features), lora_A (r, in_features), lora_B (out_features, r).
        """
        self._check_unmerged(base)
        if not merges_by_kernel(base, dtype):
            self.add(base, merged_weight(base, lora_A, lora_B, scaling, dtype))
            return
        self._reserve_host([base])
        record = self._memory.blank(base) if self._memory is not None else None
        if record is None:
            record = MergeRecords([base], staging=self.in_host_memory).blank(base)
        # Kept before its kernel runs: until then the record changes nothing, after it undoes the merge.
        self._records[base.data_ptr()] = record
        merge_in_place(record, lora_A, lora_B, scaling, self._host_steps.get(base.data_ptr()))
        self._unsettled.append((record, lora_A, lora_B, scaling))

    def merge_group(self, group: MergeGroup) -> None:
        """Merge every layer of ``group`` into its base weight in place, as :meth:`merge` does each, by one kernel
        launch (with ``in_host_memory``, a launch a layer); nothing waits on the device (:meth:`settle` does)."""
        if self.in_host_memory:  # the steps cross to the host a layer at a time, through one staging buffer
            self.reserve(group.layout.targets)
            for base, (lora_A, lora_B, scaling) in zip(group.layout.targets, group.factors, strict=True):
                self.merge(base, lora_A, lora_B, scaling)
            return
        if self._group is not None or (
            self._records and any(address in self._records for address in group.layout.index)
        ):
            raise RuntimeError("these base weights are merged already: restore() them before merging again")
        merged = _GroupMerged(group, MergeRecords(group.layout))
        self._group = merged  # kept before the launch: until it runs, its records change nothing
        group.merge(merged.memory)

    def _check_unmerged(self, base: torch.Tensor) -> None:
        grouped = self._group is not None and base.data_ptr() in self._group.group.layout.index
        if grouped or base.data_ptr() in self._records:
            raise RuntimeError("this base weight is merged already: restore() it before merging again")

    def settle(self) -> None:
        """Wait for the kernels' merges (the merge's one wait on the device) and redo, with a copy of its old bits
        as the record, each merge whose outliers ran out of room (it left some values unmerged). Before the engine
        serves the merge; a no-op where every merge is settled."""
        group = self._group if self._group is not None and self._group.appended is None else None
        if not self._unsettled and group is None:
            return
        counts = [group.memory.states[:, 0]] if group is not None else []
        if self._unsettled:
            counts.append(torch.stack([record.state[0] for record, *_ in self._unsettled]))
        appended = (torch.cat(counts) if len(counts) > 1 else counts[0]).tolist()
        if group is not None:
            layers = len(group.group.layout.targets)
            group.appended, appended = appended[:layers], appended[layers:]
            for i, record in group.carved.items():
                record.appended = group.appended[i]
            for i, (count, capacity) in enumerate(zip(group.appended, group.group.layout.capacities, strict=True)):
                if count > capacity:
                    self._redo_with_copy(group.record(i), *group.group.factors[i])
        for (record, lora_A, lora_B, scaling), count in zip(self._unsettled, appended, strict=True):
            record.appended = count
            if count > record.outliers.numel():
                self._redo_with_copy(record, lora_A, lora_B, scaling)
        self._unsettled.clear()

    def _redo_with_copy(self, record: Overwritten, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> None:
        """Replace a kernel's record whose merge left outliers unmerged with a copy of the old bits, and finish
        the merge from them. The record kept at each moment restores the base: the kernel's until the copy's, which
        :meth:`restore` applies after a group's (the kernel's record, marked undone once the copy's is kept, is passed
        by; marked or not, the copy is the last word)."""
        from colocate_grpo.kernels import MERGED_WORD, fused_merged_weight

        base = record.target
        old = record.original()
        self._records[base.data_ptr()] = kept_whole(base, old, record.appended)
        record.state[MERGED_WORD].zero_()
        fused_merged_weight(old, lora_A, lora_B, scaling, base.dtype, out=base)

    def original(self, base: torch.Tensor) -> torch.Tensor:
        """``base``'s values before its merge (``base`` itself where it was not merged)."""
        record = self._records.get(base.data_ptr())
        if record is None and self._group is not None:
            i = self._group.group.layout.index.get(base.data_ptr())
            record = None if i is None else self._group.record(i)
        return base if record is None else record.original()

    @property
    def outlier_fraction(self) -> float:
        """Share of the merged values whose change needed more than a byte to record."""
        records = self.records.values()
        total = sum(record.target.numel() for record in records)
        return sum(record.outlier_count for record in records) / total if total else 0.0

    def restore(self) -> None:
        """Put every merged base weight back, bitwise, and forget the records and their memory. After an
        interrupt part way, calling it again restores the rest.

        A group goes back first, by one launch; then the records of their own, the last merged first: where an
        interrupt stopped the merges, its steps may still be in the staging buffer of steps kept in host memory
        (:func:`lora.merge_in_place`), which the others' restores overwrite."""
        if self._group is not None:
            self._group.group.restore(self._group.memory)
            self._group = None
        for key, record in reversed(list(self._records.items())):
            record.restore()
            del self._records[key]
        self._unsettled.clear()
        self._memory = None


def _page_locked(owner: object, nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory (int8) that stays page-locked while ``owner`` lives, on CUDA machines.

    Copies between the device and page-locked memory run at the link's speed and in stream order;
    from ordinary memory they wait for the device. torch's pinned allocator rounds each allocation
    up to a power of two (up to 2x a record of several GiB), so the pages of an ordinary tensor are
    registered with the driver instead, which pins exactly what it holds.
    """
    buffer = torch.empty(nbytes, dtype=torch.int8)
    if not torch.cuda.is_available() or not nbytes:
        return buffer
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) != 0:
        logger.warning(
            "Could not page-lock %.1f GiB of host memory: the merge record's copies will be slower.", nbytes / 2**30
        )
        return buffer
    # The finalizer holds the buffer, so its pages are unregistered before they are freed.
    weakref.finalize(owner, lambda locked: cudart.cudaHostUnregister(locked.data_ptr()), buffer)
    return buffer


@torch.no_grad()
def merge_into_shared_base(
    model: torch.nn.Module,
    engine: Engine,
    merged: MergedInPlace,
    stats: RetainedUpdate | None = None,
    settle: bool = True,
) -> None:
    """Serve the trainer's merged weights where its base weights are the engine's: each LoRA layer's merged
    weight goes into its base weight in place, recorded in ``merged``.

    Trainable tensors that are not shared (``modules_to_save``) are copied into the engine as by
    :func:`push_weights`; frozen shared ones are the engine's already. On an exception part way the
    layers merged so far stay in ``merged``, for the caller to restore.

    Args:
        settle: wait for the merges and check them (:meth:`MergedInPlace.settle`) before returning. False leaves
            that to the caller, before the engine generates: host work in between overlaps the device's merges.

    Raises:
        RuntimeError: where the engine's parameters do not map onto the trainer's tensors.
    """
    writes = _in_place_writes(model, engine, merge=True)
    if writes is None:
        raise RuntimeError("the engine's parameters do not map onto the trainer's tensors: nothing can be shared")
    # A tensor the engine holds apart is copied into it; a shared one with LoRA factors is merged in place.
    plan = writes.shared_merge()
    if plan.group is None:
        merged.reserve([source.param for source in plan.merging])
    with engine.writing_weights():
        for source in plan.copied:
            source.value(stats, out=writes.views[source.name].rows)
        if plan.group is None:
            for source in plan.merging:
                source.merge_into_base(merged, stats)
        else:
            if stats is not None:  # before the merge overwrites the bases that the statistics compare with
                for source in plan.merging:
                    source.account(stats)
            merged.merge_group(plan.group)
        if settle:
            merged.settle()


@torch.no_grad()
def served_weight_mismatches(
    model: torch.nn.Module, engine: Engine, merged: MergedInPlace | None = None
) -> list[str] | None:
    """HF names of the trainer's weights that differ, bitwise, from what the engine holds.

    An empty list means the engine serves exactly the trainer's (merged) weights. None when the
    engine's parameters do not map onto the trainer's tensors (see :func:`~colocate_grpo.engine.parameter_views`).
    With ``merged``, a base weight merged in place counts with its values before the merge: the
    engine must serve the merge of what :meth:`MergedInPlace.restore` gives the trainer back.
    """
    sources = _sources(model)
    views = parameter_views(engine.model, {s.name: tuple(s.param.shape) for s in sources})
    if views is None:
        return None
    mismatches = []
    for source in sources:
        factors = lora_factors(source.layer) if source.layer is not None else None
        if merged and factors is not None:
            base = merged.original(source.param)
            expected = merged_weight(base, *factors, getattr(source.layer, "merge_dtype", None))
        else:
            expected = source.value(None)
        served = views[source.name].rows
        if not torch.equal(served.to(expected.device), expected):
            mismatches.append(source.name)
    return mismatches


@torch.no_grad()
def save_merged(model: torch.nn.Module, directory: str | Path, tokenizer: Any = None) -> Path:
    """Write a plain Hugging Face model directory with the LoRA merged in.

    Its tensors are the ones a sync sends to the engine, so the checkpoint is bit for bit what
    vLLM served (with merge-aware LoRA: what the trainer optimized). Holds one copy of the model
    in CPU memory while writing.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` or by vLLM.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in merged_named_weights(model)}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
