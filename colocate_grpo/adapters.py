"""Serving the trainer's LoRA adapter with vLLM's LoRA kernels instead of merged weights.

The engine loads the adapter once (``Engine.load_adapter``) and keeps it pinned in its one LoRA
slot. Each sync then writes the trainer's factors straight into vLLM's LoRA buffers: A as it is,
B times the layer's scaling (vLLM's layout), both cast to the engine's dtype. No file, no load
request, no merge: the base weights the engine holds are never changed by a sync. On GPUs the
write, a few hundred small copies with a cast, is one kernel launch (``kernels.ScaledCopies``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from peft.tuners.lora import LoraLayer

from colocate_grpo.engine import Engine
from colocate_grpo.lora import FactorsKey, lora_factors
from colocate_grpo.sync import hf_name

if TYPE_CHECKING:
    from colocate_grpo.kernels import ScaledCopies


@dataclass(frozen=True)
class _FactorViews:
    """One trainer LoRA layer and where its factors live in the engine's buffers."""

    name: str  # Hugging Face module name, e.g. model.layers.0.self_attn.q_proj
    layer: LoraLayer
    a: torch.Tensor  # rank x in_features, a view into vLLM's lora_a_stacked
    b: torch.Tensor  # out_features x rank, a view into vLLM's lora_b_stacked


class AdapterWrites:
    """Writing one trainer model's LoRA factors into one engine's LoRA buffers.

    On GPUs the write is one kernel launch from a table of the factors' and buffers' addresses
    (``kernels.ScaledCopies``): the optimizer updates the factors in place, and vLLM's buffers stay at
    their addresses through its sleeps. Which factors each layer uses (PEFT's active adapter, its
    scaling) is read while the device writes; where it changed, or a factor moved, the table is built
    again and the write launched again. A stale launch only writes values that the next one overwrites
    (the table holds the tensors it reads: never freed memory).

    Raises:
        ValueError: when a trainer LoRA layer has no place in the engine (vLLM serves no LoRA on that
            module) or its shapes differ from the engine's buffers.
    """

    def __init__(self, model: torch.nn.Module, engine: Engine) -> None:
        trained = {
            hf_name(name): module
            for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and len(module.lora_A) > 0
        }
        engine_layers, slot = engine.lora_layers()
        packed = getattr(engine.model, "packed_modules_mapping", None) or {}
        self.views: list[_FactorViews] = []
        self.buffers: list[torch.Tensor] = []  # every LoRA buffer of the engine, all slots
        self.copies: ScaledCopies | None = None  # the GPU's write, and the key of the factors it reads
        self.copies_key: FactorsKey | None = None
        # The engine's slot may hold another trainer's adapter (a reused engine), with slices this one leaves out.
        self.cleared = False
        for module_name, module in engine_layers.items():
            prefix, _, leaf = module_name.rpartition(".")
            a_stacked, b_stacked = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
            if a_stacked is None or b_stacked is None:
                continue
            self.buffers += [*a_stacked, *b_stacked]
            for part_index, part in enumerate(packed.get(leaf, [leaf])):
                layer = trained.pop(f"{prefix}.{part}", None)
                if layer is None:  # not adapted (only q and v of q/k/v, say): its slice stays zero
                    continue
                factors = lora_factors(layer)
                if factors is None:
                    raise ValueError(f"{prefix}.{part}: its adapter is disabled or merged; cannot serve it.")
                lora_A, lora_B, _ = factors
                rank = lora_A.shape[0]
                a = a_stacked[part_index][slot, 0, :rank, :]
                b = b_stacked[part_index][slot, 0, :, :rank]
                if a.shape != lora_A.shape or b.shape != lora_B.shape:
                    raise ValueError(
                        f"{prefix}.{part}: the trainer's LoRA factors {tuple(lora_A.shape)} and "
                        f"{tuple(lora_B.shape)} do not fit vLLM's buffers {tuple(a.shape)} and {tuple(b.shape)}."
                    )
                self.views.append(_FactorViews(f"{prefix}.{part}", layer, a, b))
        if trained:
            raise ValueError(
                f"vLLM serves no LoRA on {', '.join(sorted(trained)[:5])}: adapter serving covers the linear "
                "layers of the decoder. Target those (lora_target_linear: true), or serve merged weights "
                "(remove trl.vllm_lora_sync)."
            )

    def expected(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, A, B x scaling) of every adapted layer, as the engine should hold them (its dtype)."""
        out = []
        for view in self.views:
            lora_A, lora_B, scaling = lora_factors(view.layer)
            out.append((view.name, lora_A.to(view.a.dtype), (lora_B * scaling).to(view.b.dtype)))
        return out

    @torch.no_grad()
    def __call__(self, clear: bool) -> None:
        """Write every layer's factors; ``clear`` zeroes all LoRA buffers first (after they were lost).

        The first write of these views always clears.
        """
        if clear or not self.cleared:
            torch._foreach_zero_(self.buffers)
            self.cleared = True
        if self.copies is not None:
            self.copies()
            if not self.copies_key.changed():  # read while the device writes
                return
        factors = self._factors()
        self.copies = self._scaled_copies(factors)
        if self.copies is None:
            self._write(factors)
            return
        self.copies_key = FactorsKey([view.layer for view in self.views])
        self.copies()

    def _factors(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        factors = [lora_factors(view.layer) for view in self.views]
        if any(f is None for f in factors):
            raise ValueError("An adapter was disabled or merged since the engine loaded it; cannot serve it.")
        return factors

    def _scaled_copies(self, factors: list[tuple[torch.Tensor, torch.Tensor, float]]) -> ScaledCopies | None:
        """The write as one kernel, where the device and layouts allow it (CUDA, contiguous, one dtype per side)."""
        targets = [v.a for v in self.views] + [v.b for v in self.views]
        sources = [f[0] for f in factors] + [f[1] for f in factors]
        scales = [1.0] * len(factors) + [f[2] for f in factors]
        if (
            not sources
            or not sources[0].is_cuda
            or len({t.dtype for t in sources}) > 1
            or len({t.dtype for t in targets}) > 1
            or not all(t.is_contiguous() for t in targets + sources)
        ):
            return None
        from colocate_grpo.kernels import ScaledCopies

        return ScaledCopies(targets, sources, scales)

    def _write(self, factors: list[tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        torch._foreach_copy_([v.a for v in self.views], [f[0] for f in factors])
        scaled = torch._foreach_mul([f[1] for f in factors], [f[2] for f in factors])
        torch._foreach_copy_([v.b for v in self.views], scaled)


# Per engine model (vLLM's nn.Module), per trainer model: dropped with either.
_writes_of: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()


def _adapter_writes(model: torch.nn.Module, engine: Engine) -> AdapterWrites:
    if engine.adapter_request is None:
        engine.load_adapter(model.save_pretrained)
    per_model = _writes_of.setdefault(engine.model, weakref.WeakKeyDictionary())
    if model not in per_model:
        per_model[model] = AdapterWrites(model, engine)
    return per_model[model]


def push_adapter(model: torch.nn.Module, engine: Engine, clear: bool) -> None:
    """Write the trainer's current LoRA factors into the engine's LoRA buffers, in place.

    The first call loads the adapter into the engine (vLLM's loader, once). If the write raises or is
    interrupted, generation is refused until a later write completes.

    Args:
        clear: zero every LoRA buffer first: needed when the engine lost them (a level-2 sleep
            discards them with the weights). The first write of a trainer into an engine always clears.
    """
    writes = _adapter_writes(model, engine)
    with engine.writing_weights():
        writes(clear)


@torch.no_grad()
def served_adapter_mismatches(model: torch.nn.Module, engine: Engine) -> list[str]:
    """Names of the trainer's LoRA layers whose factors differ, bitwise, from the engine's buffers.

    Compared in the engine's dtype: A cast, and B times the scaling, cast. Empty when the engine
    serves exactly the trained adapter.
    """
    writes = _adapter_writes(model, engine)
    mismatches = []
    for view, (name, a, b) in zip(writes.views, writes.expected(), strict=True):
        if not (torch.equal(view.a, a.to(view.a.device)) and torch.equal(view.b, b.to(view.b.device))):
            mismatches.append(name)
    return mismatches
