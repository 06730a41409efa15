"""Kernel microbenchmarks: what colocate_grpo ships against the plain way, on random tensors of a shape.

Each experiment (``run(name, shape)``) returns ``{"device": ..., "rows": [...]}``, one row per measurement, times
in seconds (CUDA events on a GPU, the wall clock on a CPU; kernel times, from the profiler, on a GPU only).
The shape ``tiny`` stands for a few small layers, for the CPU checks.

- ``lora-speed``: forward + backward of merge-aware LoRA against PEFT's LoRA (the same factors), per layer and
  and (at 1.5B and tiny) for a whole random-weight model of the shape, bf16 autocast, r=16; the merged weight's fused
  kernel against plain PyTorch.
- ``merge-in-place``: merging a LoRA into every linear of a shape in place with the record that restores it
  (``colocate_grpo.sync.MergedInPlace``), as a sync does: its time (the push) against one plain copy of the
  same bytes (the copy floor), the restore's, the record's bytes and outliers, whether every restore was
  bitwise; by one launch of the one-pass kernels for every layer (in use on a GPU, ``lora.MergeGroup``), by a
  launch a layer, and by the merge then ``lora.overwrite``; on a GPU once more with the record's steps in
  page-locked host memory. Each row's ``what`` names its path; the one a sync takes says ``(in use)``.
- ``sync-kernels`` (CUDA): the sync's writes captured in a CUDA graph, as the sync replays them: the fused merge
  over every LoRA linear against one copy of the same bytes; the frozen tensors' copy by
  ``kernels.copy_by_kernel`` against ``copy_``; the adapter's factors by ``kernels.ScaledCopies`` against
  ``_foreach_copy_``.
- ``fp32-head-speed``: TRL's fused head forward + backward in bf16, in IEEE fp32 (TRL's
  ``cast_lm_head_to_fp32``) and in fp32 on TF32 cores (``colocate_grpo.head``), each one's largest
  log-probability difference from IEEE fp32.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from workload import DIMENSIONS, linear_shapes

RANK = 16
# How many kernels the profiled experiments list, by their time: where a phase's device time goes.
KERNEL_TABLE_ROWS = 15
SCALING = 2.0
TINY_LAYERS = [(256, 128), (128, 256)] * 4
TINY_MODEL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def seconds(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn()``: CUDA events around each call on a GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device() == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def kernel_profile(fn: Callable[[], object], iters: int = 3, top: int = 0) -> tuple[float | None, list[dict[str, Any]]]:
    """Seconds of CUDA kernel time per ``fn()`` (the profiler's), without the host's launch gaps, and the ``top``
    kernels by their time: rows of ``what`` "kernel", its ``name`` (cut to 120 characters), ``ms`` per call of
    ``fn`` and ``launches`` per call, ``share`` of the kernel time. (None, []) on a CPU."""
    if device() != "cuda":
        return None, []
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = (e for e in profile.key_averages() if e.self_device_time_total > 0)  # not the host's API calls
    events = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in events)
    table = [
        {
            "what": "kernel",
            "name": e.key[:120],
            "ms": e.self_device_time_total / 1e3 / iters,
            "launches": e.count / iters,
            "share": e.self_device_time_total / total_us,
        }
        for e in events[:top]
    ]
    return total_us / 1e6 / iters, table


def layers_of(shape: str) -> list[tuple[int, int]]:
    """(out, in) of the LoRA linears of ``shape``: every linear but the head, or a few small ones (``tiny``)."""
    return TINY_LAYERS if shape == "tiny" else linear_shapes(shape)


def lora_speed(shape: str) -> list[dict[str, Any]]:
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colocate_grpo import lora

    def with_lora(module: torch.nn.Module, targets: str | list[str]) -> torch.nn.Module:
        model = get_peft_model(module, LoraConfig(r=RANK, lora_alpha=RANK * SCALING, target_modules=targets))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=1e-3)
        return model

    def merge_aware(model: torch.nn.Module, on: bool) -> None:
        """The same LoRA layers (the same weights) under either forward."""
        if on:
            lora.install_merge_aware(model)
            return
        for layer in model.modules():
            if isinstance(layer, lora.MergeAwareLoraLinear):
                layer.__class__ = LoraLinear

    def forward_backward(model: torch.nn.Module, inputs: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            with torch.autocast(device(), dtype=torch.bfloat16):
                out = model(inputs)
                out = out.logits if hasattr(out, "logits") else out
            out.float().mean().backward()

        return step

    def compare(what: str, model: torch.nn.Module, inputs: torch.Tensor, tokens: int) -> dict[str, Any]:
        row: dict[str, Any] = {"what": what, "tokens": tokens}
        for name, on in (("peft", False), ("merge_aware", True)):
            merge_aware(model, on)
            if device() == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row[f"{name}_s"] = seconds(forward_backward(model, inputs), iters=5)
            row[f"{name}_kernel_s"], _ = kernel_profile(forward_backward(model, inputs))
            row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device() == "cuda" else None
        row["ratio"] = row["merge_aware_s"] / row["peft_s"]
        return row

    rows = []
    tokens_list = [128] if shape == "tiny" else [1024, 4096]
    layers = TINY_LAYERS[:2] if shape == "tiny" else [linear_shapes(shape)[i] for i in (0, 4, 6)]  # q, gate, down
    for out_features, in_features in layers:
        linear = torch.nn.Sequential()
        linear.add_module("proj", torch.nn.Linear(in_features, out_features, bias=False))
        model = with_lora(linear.to(device(), torch.bfloat16), ["proj"])
        for tokens in tokens_list:
            x = torch.randn(tokens, in_features, device=device(), dtype=torch.bfloat16, requires_grad=True)
            rows.append(compare(f"layer {out_features}x{in_features}", model, x, tokens))
        weight = torch.randn(out_features, in_features, device=device(), dtype=torch.bfloat16)
        a = torch.randn(RANK, in_features, device=device()) * 1e-2
        b = torch.randn(out_features, RANK, device=device()) * 1e-2
        merge = functools.partial(lora.merged_weight, weight, a, b, SCALING, torch.bfloat16)
        lora.FUSED_MERGE = False
        plain = seconds(merge, iters=20)
        reference = merge()
        lora.FUSED_MERGE = True
        rows.append(
            {
                "what": f"merged weight {out_features}x{in_features}",
                "plain_s": plain,
                "fused_s": seconds(merge, iters=20),
                "entries_differing": (merge() != reference).float().mean().item(),
            }
        )
    if shape not in ("tiny", "1.5B"):
        return rows
    torch.manual_seed(0)
    dims = TINY_MODEL | {"vocab_size": 1000} if shape == "tiny" else DIMENSIONS["1.5B"]
    base = Qwen2ForCausalLM(Qwen2Config(**dims, max_position_embeddings=8192)).to(device(), torch.bfloat16)
    model = with_lora(base, "all-linear")
    for tokens in tokens_list:
        ids = torch.randint(0, dims["vocab_size"], (1, tokens), device=device())
        rows.append(compare("model " + ("tiny" if shape == "tiny" else "1.5B-shaped"), model, ids, tokens))
    return rows


def merge_in_place(shape: str) -> list[dict[str, Any]]:
    from colocate_grpo.lora import MergeGroup, merged_weight
    from colocate_grpo.sync import MergedInPlace

    torch.manual_seed(0)
    layers = [
        (
            (torch.randn(out, in_, device=device()) * 0.02).to(torch.bfloat16),
            torch.randn(RANK, in_, device=device()) * 1e-2,
            torch.randn(out, RANK, device=device()) * 1e-4,  # an RL-sized update
        )
        for out, in_ in layers_of(shape)
    ]
    before = [weight.cpu() for weight, _, _ in layers]  # in host memory: a second copy may not fit the device
    weights = sum(weight.numel() for weight, _, _ in layers)
    floor = copy_floor_seconds(2 * weights)

    # As a sync runs it: one launch for every layer, its tables built once (sync._SharedMerge keeps them).
    group = MergeGroup.of([weight for weight, _, _ in layers], [(a, b, SCALING) for _, a, b in layers])

    def by_group(in_place: MergedInPlace) -> None:
        """The group's one launch (a layer at a time with the record in host memory), one wait."""
        in_place.merge_group(group)
        in_place.settle()

    def by_layers(in_place: MergedInPlace) -> None:
        """The record's memory for every layer, a merge each (a kernel each on a GPU), one wait."""
        in_place.reserve([weight for weight, _, _ in layers])
        for weight, a, b in layers:
            in_place.merge(weight, a, b, SCALING)
        in_place.settle()

    def by_overwrite(in_place: MergedInPlace) -> None:
        """The merge, then its record in PyTorch (lora.overwrite): several passes and a wait a layer."""
        for weight, a, b in layers:
            in_place.add(weight, merged_weight(weight, a, b, SCALING))

    if group is not None:
        ways = {
            "merge in place, one launch for all layers (in use)": by_group,
            "merge in place, a launch a layer": by_layers,
        }
    else:  # no kernels here: a sync merges a layer at a time in PyTorch
        ways = {"merge in place, PyTorch a layer at a time (in use)": by_layers}
    ways["merge, then lora.overwrite"] = by_overwrite
    rows = []
    for in_host_memory in (False, True) if device() == "cuda" else (False,):
        for what, push in ways.items():
            if in_host_memory and push is not by_group:
                continue  # with the record in host memory, the group merges a layer at a time: the one row
            what += ", record in host memory" if in_host_memory else ""
            in_place = MergedInPlace(in_host_memory=in_host_memory)
            rows.append({"what": what} | timed_merges(push, in_place, layers, before, floor))
    return rows


def synchronize() -> None:
    if device() == "cuda":
        torch.cuda.synchronize()


def copy_floor_seconds(nbytes: int) -> float:
    """Median seconds of one plain copy of ``nbytes`` bytes (the bandwidth floor of a write of them in place)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device())
    s = seconds(functools.partial(torch.empty_like(source).copy_, source))
    del source  # the copy's buffers go before the merges' records need the room
    if device() == "cuda":
        torch.cuda.empty_cache()
    return s


def timed_merges(
    push: Callable[[Any], None],
    in_place: Any,
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    before: list[torch.Tensor],
    copy_floor_s: float,
    repeats: int = 5,
) -> dict[str, Any]:
    """Median wall seconds of ``push(in_place)`` (merging every layer in place, waited for) and of its restore,
    against the copy floor; the record's bytes and outliers, and whether the base is bitwise ``before`` at the end
    (a restore that missed would stay: each merge starts from the last restore)."""
    pushes, restores = [], []
    for repeat in range(repeats + 1):  # the first compiles the kernels and allocates the host buffers
        synchronize()
        start = time.perf_counter()
        push(in_place)
        synchronize()
        pushed = time.perf_counter()
        records = in_place.records.values()
        size, outliers = sum(r.nbytes for r in records), sum(r.outlier_count for r in records)
        restore_start = time.perf_counter()
        in_place.restore()
        synchronize()
        if repeat:
            pushes.append(pushed - start)
            restores.append(time.perf_counter() - restore_start)
    bitwise = all(
        torch.equal(old.view(torch.int16), weight.cpu().view(torch.int16))
        for old, (weight, _, _) in zip(before, layers, strict=True)
    )
    weights = sum(weight.numel() for weight, _, _ in layers)
    push_s = statistics.median(pushes)
    return {
        "weights": weights,
        "push_s": push_s,
        "copy_floor_s": copy_floor_s,
        "push_over_copy_floor": push_s / copy_floor_s,
        "restore_s": statistics.median(restores),
        "record_on_device_bytes_per_weight": size / weights,
        "outlier_fraction": outliers / weights,
        "restored_bitwise": bitwise,
    }


def graph_seconds(write: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of one replay of ``write`` captured as a CUDA graph (compiled before the capture)."""
    write()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write()
    return seconds(graph.replay, warmup=2, iters=repeats)


def bandwidth_rows(ways: dict[str, Callable[[], object]], nbytes: int) -> list[dict[str, Any]]:
    """Each way of writing the same ``nbytes`` bytes (read and written): its replay's seconds and GB/s."""
    rows = []
    for what, write in ways.items():
        s = graph_seconds(write)
        rows.append({"what": what, "bytes": nbytes, "s": s, "gb_per_s": nbytes / s / 1e9})
    return rows


def merge_rows(shape: str) -> list[dict[str, Any]]:
    """The fused merge of every LoRA linear against one copy of the same bytes (the bandwidth floor)."""
    from colocate_grpo.kernels import fused_merged_weight

    # Every LoRA linear its own W, A, B and output, so that nothing is served from L2 between layers.
    layers = [
        (
            (torch.randn(out, in_, device="cuda") * 0.02).bfloat16(),
            torch.randn(RANK, in_, device="cuda") / in_**0.5,
            torch.randn(out, RANK, device="cuda") * 1e-3,
            torch.empty(out, in_, dtype=torch.bfloat16, device="cuda"),
        )
        for out, in_ in layers_of(shape)
    ]
    nbytes = sum(2 * w.nbytes for w, _, _, _ in layers)
    floor_source = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    floor_target = torch.empty_like(floor_source)

    def merge() -> None:
        for w, a, b, out in layers:
            fused_merged_weight(w, a, b, SCALING, torch.bfloat16, out=out)

    def copy() -> None:
        floor_target.copy_(floor_source)

    return bandwidth_rows(
        {"fused merge of every LoRA linear (in use)": merge, "one copy of the same bytes": copy}, nbytes
    )


def frozen_copy_rows(shape: str) -> list[dict[str, Any]]:
    """The embeddings' and the head's copy (the frozen tensors' large ones) by the Triton kernel and by copy_."""
    from colocate_grpo.kernels import copy_by_kernel

    dims = DIMENSIONS[shape]
    sources = [torch.randn(dims["vocab_size"], dims["hidden_size"], device="cuda").bfloat16() for _ in range(2)]
    targets = [torch.empty_like(s) for s in sources]
    nbytes = sum(2 * s.nbytes for s in sources)

    def by_kernel() -> None:
        for target, source in zip(targets, sources, strict=True):
            copy_by_kernel(target, source)

    def by_copy() -> None:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)

    return bandwidth_rows(
        {"embeddings and head by kernels.copy_by_kernel (in use)": by_kernel, "copy_": by_copy}, nbytes
    )


def adapter_write_rows(shape: str) -> list[dict[str, Any]]:
    """The adapter's factors into vLLM's LoRA buffers: one ScaledCopies launch against _foreach_copy_."""
    from colocate_grpo.kernels import ScaledCopies

    factors_a = [torch.randn(RANK, in_, device="cuda") / in_**0.5 for _, in_ in layers_of(shape)]
    factors_b = [torch.randn(out, RANK, device="cuda") * 1e-3 for out, _ in layers_of(shape)]
    # vLLM's LoRA buffers: one slot's (rank, in) and (out, rank) slices, bf16.
    slots_a = [torch.zeros(RANK, in_, dtype=torch.bfloat16, device="cuda") for _, in_ in layers_of(shape)]
    slots_b = [torch.zeros(out, RANK, dtype=torch.bfloat16, device="cuda") for out, _ in layers_of(shape)]
    scales = [1.0] * len(factors_a) + [SCALING] * len(factors_b)
    one_launch = ScaledCopies([*slots_a, *slots_b], [*factors_a, *factors_b], scales)

    def foreach() -> None:
        torch._foreach_copy_(slots_a, factors_a)
        torch._foreach_copy_(slots_b, torch._foreach_mul(factors_b, SCALING))

    ways = {"adapter by kernels.ScaledCopies, one launch (in use)": one_launch, "adapter by _foreach_copy_": foreach}
    return [{"what": what, "tensors": len(scales), "s": graph_seconds(write)} for what, write in ways.items()]


def sync_kernels(shape: str) -> list[dict[str, Any]]:
    if device() != "cuda":
        raise RuntimeError("sync-kernels times Triton kernels in CUDA graphs: it needs a CUDA device")
    torch.manual_seed(0)
    rows = []
    for part in (merge_rows, frozen_copy_rows, adapter_write_rows):
        rows += part(shape)
        torch.cuda.empty_cache()
    return rows


def fp32_head_speed(shape: str) -> list[dict[str, Any]]:
    from trl.kernels import ChunkedLogProbFunction

    from colocate_grpo.head import TF32ChunkedLogProb

    chunk = 32768  # TRL's vocabulary tile (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)

    def forward_backward(
        function: type, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        hidden = hidden.detach().requires_grad_()
        log_probs, *_ = function.apply(hidden, weight, None, targets, 1.0, chunk, None, 1.0, ("entropy",))
        log_probs.sum().backward()
        return log_probs.detach().float()

    torch.manual_seed(0)
    hidden_size, vocab = (
        (64, 1000) if shape == "tiny" else (DIMENSIONS[shape]["hidden_size"], DIMENSIONS[shape]["vocab_size"])
    )
    weight = (torch.randn(vocab, hidden_size, device=device()) * 0.02).bfloat16()
    rows = []
    for tokens in [128] if shape == "tiny" else [2048, 16384]:
        hidden = torch.randn(tokens, hidden_size, device=device()).bfloat16()
        targets = torch.randint(0, vocab, (tokens,), device=device())
        heads = {
            "bf16 (TRL's default)": (ChunkedLogProbFunction, hidden),
            "fp32, IEEE (TRL's cast_lm_head_to_fp32)": (ChunkedLogProbFunction, hidden.float()),
            "fp32 on TF32 cores (ours)": (TF32ChunkedLogProb, hidden.float()),
        }
        reference = forward_backward(*heads["fp32, IEEE (TRL's cast_lm_head_to_fp32)"], weight, targets)
        for what, (function, inputs) in heads.items():
            rows.append(
                {
                    "what": what,
                    "tokens": tokens,
                    "s": seconds(functools.partial(forward_backward, function, inputs, weight, targets), 1, 5),
                    "max_abs_logp_diff_from_ieee_fp32": (
                        forward_backward(function, inputs, weight, targets) - reference
                    )
                    .abs()
                    .max()
                    .item(),
                }
            )
    return rows


def training_step(shape: str) -> list[dict[str, Any]]:
    """One GRPO micro-batch's forward and backward as TRL computes it (the fused head, merge-aware LoRA r=16 on all
    linears, AdamW), by micro-batch and gradient checkpointing: the step's device memory above the weights
    against the memory plan's estimate, its seconds and model FLOPs utilization; the top kernels of the largest
    micro-batch without checkpointing and, on a GPU where ``liger-kernel`` is installed, :func:`liger_row`."""
    from kinds import ModelFlops, peak_bf16_flops
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM
    from trl.trainer import add_fused_lm_head
    from workload import COMPLETION_TOKENS, PROMPT_TOKENS, shape_config

    from colocate_grpo import lora
    from colocate_grpo.memory_plan import LORA_ITEMSIZE, shape_of, training_activation_bytes

    torch.manual_seed(0)
    config = shape_config("1.5B") if shape == "tiny" else shape_config(shape)
    if shape == "tiny":
        for key, value in (TINY_MODEL | {"vocab_size": 1000}).items():
            setattr(config, key, value)
    with torch.device(device()):
        base = Qwen2ForCausalLM(config).to(torch.bfloat16)
    add_fused_lm_head(base, outputs=("log_probs", "entropy"))
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=RANK * SCALING, target_modules="all-linear"))
    lora.install_merge_aware(model)
    model.enable_input_require_grads()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device() == "cuda")
    completion = 8 if shape == "tiny" else COMPLETION_TOKENS
    sequence = PROMPT_TOKENS + completion
    plan_shape = shape_of(config)
    lora_gradients = sum(p.numel() for p in trainable) * LORA_ITEMSIZE
    flops = ModelFlops.of(model)
    peak = peak_bf16_flops(torch.cuda.get_device_name()) if device() == "cuda" else None

    def step(micro_batch: int) -> None:
        ids = torch.randint(1, config.vocab_size, (micro_batch, sequence), device=device())
        labels = ids.clone()
        labels[:, :PROMPT_TOKENS] = -100
        advantages = torch.randn(micro_batch, 1, device=device())
        with torch.autocast(device(), dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
        logps = out.log_probs[:, -completion:]
        ratio = torch.exp(logps - logps.detach())
        (-(ratio * advantages).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1)  # AdamW's states exist from here on, as after a run's first step
    rows = []
    for checkpointing in (True, False):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        for micro_batch in (2,) if shape == "tiny" else (8, 16, 32, 64):
            row: dict[str, Any] = {"gradient_checkpointing": checkpointing, "micro_batch": micro_batch}
            estimate = training_activation_bytes(
                plan_shape, torch.bfloat16, micro_batch, sequence, completion, checkpointing, False
            )
            row["plan_activations_gib"] = estimate / 2**30
            try:
                if device() == "cuda":
                    torch.cuda.empty_cache()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                row["s"] = seconds(functools.partial(step, micro_batch), warmup=1, iters=3)
            except torch.OutOfMemoryError:
                row["out_of_memory"] = True
                optimizer.zero_grad(set_to_none=True)
                rows.append(row)
                print(f"out of memory: {row}", flush=True)
                continue
            tokens = micro_batch * sequence
            # The harness's convention (bench/README.md, "Model FLOPs"): the head scores the completions alone.
            model_flops, _ = flops.counted(
                micro_batch, sequence, [sequence] * micro_batch, micro_batch * completion, True
            )
            row["tokens_per_s"] = tokens / row["s"]
            row["mfu"] = model_flops / row["s"] / peak if peak else None
            if device() == "cuda":
                row["measured_above_weights_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
                row["plan_above_weights_gib"] = (estimate + lora_gradients) / 2**30
                row["measured_over_plan"] = row["measured_above_weights_gib"] / row["plan_above_weights_gib"]
            rows.append(row)
    fitted = {row["micro_batch"]: row["s"] for row in rows if not row["gradient_checkpointing"] and "s" in row}
    if fitted:  # where the device time of the fastest way goes (checkpointing is off from the last sweep on)
        largest = max(fitted)
        busy, kernels = kernel_profile(functools.partial(step, largest), iters=1, top=KERNEL_TABLE_ROWS)
        if busy is not None:
            rows.append({"what": "device busy", "micro_batch": largest, "kernel_s": busy})
        rows.extend(kernels)
        if device() == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
            try:  # a failure here keeps the rows above
                rows.append(
                    liger_row(base, functools.partial(step, largest), fitted[largest], config.vocab_size, sequence)
                )
            except Exception as error:  # noqa: BLE001
                rows.append({"what": LIGER_ROW, "failed": repr(error)[:300]})
    return rows


LIGER_ROW = "liger rms_norm swiglu rope"  # the training-step row of the step with Liger's kernels


def liger_row(
    base: torch.nn.Module, step: Callable[[], None], plain_s: float, vocab: int, sequence: int
) -> dict[str, Any]:
    """The same step with Liger's RMSNorm, SwiGLU and RoPE kernels patched into ``base`` (the head left to TRL's
    fused one): its seconds against ``plain_s``, and the largest difference it makes to 8 sequences' token
    log-probabilities. Patches the model in place: measured last."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    ids = torch.randint(1, vocab, (8, sequence), generator=torch.Generator().manual_seed(1)).to(device())

    @torch.no_grad()
    def logps() -> torch.Tensor:
        with torch.autocast(device(), dtype=torch.bfloat16):
            out = base(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
        return out.log_probs.float()

    before = logps()
    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=False, model=base)
    difference = (logps() - before).abs().max().item()
    liger_s = seconds(step, warmup=1, iters=3)
    return {
        "what": LIGER_ROW,
        "s": liger_s,
        "speedup": plain_s / liger_s,
        "max_logp_diff": difference,
    }


def generate_speed(shape: str) -> list[dict[str, Any]]:
    """The benchmark's generation batch (64 sequences of up to 256 tokens) from a run's engine, as TRL samples it,
    against the bandwidth floor (each decode step reads the weights once); the profiler's device-busy share; with
    and without the sampled tokens' log-probabilities, and at other batch sizes."""
    from pathlib import Path

    from vllm import SamplingParams
    from workload import COMPLETION_TOKENS, GENERATION_BATCH, benchmark_prompts, build_model

    from colocate_grpo.engine import Engine
    from colocate_grpo.plan import standalone_engine

    path = build_model(shape, Path("/tmp/bench_models"))
    tokens = 4 if shape == "tiny" else COMPLETION_TOKENS
    prompts = benchmark_prompts(path)[:GENERATION_BATCH]
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    bandwidth = {"H100": 3.35e12, "H200": 4.8e12}
    name = torch.cuda.get_device_name() if device() == "cuda" else ""
    floor = next((tokens * weights / value for key, value in bandwidth.items() if key in name), None)
    rows = []
    with Engine(standalone_engine(path, generation_batch=GENERATION_BATCH)) as engine:

        def generate(batch: int, logprobs: int | None, flat: bool = False) -> Callable[[], object]:
            params = SamplingParams(
                n=1, temperature=1.0, max_tokens=tokens, logprobs=logprobs, detokenize=False, flat_logprobs=flat
            )
            return lambda: engine.generate((prompts * 4)[:batch], params)

        # flat_logprobs: vLLM's log-probabilities as a few flat lists a sequence instead of a dict and an object per
        # token (fewer Python objects made each decode step, the host's share of a step).
        variants = [
            (GENERATION_BATCH, 0, False),
            (GENERATION_BATCH, None, False),
            (GENERATION_BATCH // 2, 0, False),
            (GENERATION_BATCH, 0, True),
        ]
        for batch, logprobs, flat in variants:
            wall = seconds(generate(batch, logprobs, flat), warmup=1, iters=3)
            generated = sum(len(o.outputs[0].token_ids) for o in generate(batch, logprobs, flat)())
            row = {"batch": batch, "logprobs": logprobs, "flat_logprobs": flat, "s": wall}
            row["tokens_per_s"] = generated / wall
            if floor and batch == GENERATION_BATCH:
                row["over_bandwidth_floor"] = wall / floor
            rows.append(row)
        busy, kernels = kernel_profile(generate(GENERATION_BATCH, 0), iters=1, top=KERNEL_TABLE_ROWS)
        if busy is not None:
            rows.append({"what": "device busy share", "kernel_s": busy, "share": busy / rows[0]["s"]})
        rows.extend(kernels)
    return rows


MICROBENCHMARKS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "lora-speed": lora_speed,
    "merge-in-place": merge_in_place,
    "sync-kernels": sync_kernels,
    "fp32-head-speed": fp32_head_speed,
    "training-step": training_step,
    "generate-speed": generate_speed,
}


def run(experiment: str, shape: str) -> dict[str, Any]:
    """The microbenchmark ``experiment`` at ``shape``: the device and its rows (printed as they are)."""
    rows = MICROBENCHMARKS[experiment](shape)
    for row in rows:
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return {"device": torch.cuda.get_device_name() if device() == "cuda" else "cpu", "rows": rows}
