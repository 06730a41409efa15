"""One copy of the base weights: the trainer's frozen weights become views of the engine's parameters.

A LoRA model's base weights never change in training, and the engine starts with the same bf16
tensors from the same checkpoint. Sharing makes the trainer's frozen parameters (q/k/v and gate/up
as row views of vLLM's fused ones, the embedding as the first rows of its padded one, a tied head
with it) point at the engine's memory, and the trainer's own copy is freed.

When the engine serves the adapter (:mod:`colocate_grpo.adapters`), a sync sends only the adapter
and nothing writes the shared tensors. With merged serving, a sync merges each LoRA layer into its
shared base weight in place, keeping about a byte per weight to restore it bitwise once the
generation ends (:class:`colocate_grpo.sync.MergedInPlace`), so the trainer always computes with
the checkpoint's base. The engine keeps the weights resident (``Engine.pin_weights``: its KV cache
sleeps alone). The trainer's model may still be in host memory when it shares (a GPU run loads it
there, so that the device never holds two copies): its frozen weights then move to the device as
views of the engine's, and the rest follows when the trainer moves the model.
"""

from __future__ import annotations

import torch

from colocate_grpo.engine import Engine, Weights, parameter_views
from colocate_grpo.quantized import share_4bit_base
from colocate_grpo.sync import frozen_base, merged_names


@torch.no_grad()
def share_base_weights(model: torch.nn.Module, engine: Engine, write_all: bool = False) -> int:
    """Point the trainer's frozen base weights at the engine's parameters and pin those; returns the bytes freed.

    A 4-bit base is always shared (:func:`colocate_grpo.quantized.share_4bit_base`: the trainer holds
    no other). A bf16 base is not (0 is returned) where the engine's parameters do not map onto the
    trainer's tensors (:func:`~colocate_grpo.engine.parameter_views`), where the engine cannot keep its
    weights while its KV cache sleeps (``Engine.can_sleep_kv_cache_alone``), or where some tensor differs from the
    engine's, bitwise: then the two sides do not hold the same weights, and sharing would change
    what is trained. The LoRA layers' base weights are written into the engine first, as a sync
    would write them: a reused engine may still hold another run's merged weights there. ``write_all`` writes
    every base weight: the trainer's are not the checkpoint's that the engine loaded (a 4-bit base's NF4 values).
    """
    if engine.spec.quantization is not None:
        return share_4bit_base(model, engine)
    if not engine.can_sleep_kv_cache_alone:
        return 0
    base = frozen_base(model)
    views = parameter_views(engine.model, {name: tuple(param.shape) for name, param in base.items()})
    if views is None:
        return 0
    engine.wake_up(["weights"])
    lost = engine.state.weights is not Weights.RESIDENT  # a level-2 sleep discarded them: all of the trainer's go in
    written = set(base) if lost or write_all else merged_names(model) & set(base)
    # Straight into the views: vLLM's loader no longer knows the Hugging Face names once LoRA wrapped the layers.
    with engine.writing_weights():
        for name in written:
            views[name].rows.copy_(base[name])
            if views[name].padding is not None:
                views[name].padding.zero_()
    for name, param in base.items():
        rows = views[name].rows
        if rows.dtype != param.dtype or (name not in written and not torch.equal(rows, param.to(rows.device))):
            return 0
    engine.pin_weights()
    freed = 0
    for name, param in base.items():
        freed += param.nbytes
        param.data = views[name].rows
    return freed


def shares_base_weights(model: torch.nn.Module, engine: Engine) -> bool:
    """Whether every frozen base weight of the trainer lives in the engine's parameters' memory."""
    engine_storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    base = frozen_base(model)
    return bool(base) and all(p.untyped_storage().data_ptr() in engine_storages for p in base.values())
