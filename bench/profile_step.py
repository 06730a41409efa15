"""The CUDA kernels of one optimizer step of a user's run: the step's wall time, kernel time, top kernels.

Runs one ``sync_vs_trl.py`` kind (``user``, ``user-fp32-head``, ...) for three optimizer steps on its
random-weight model and profiles the third (generation, sync and every micro-batch's forward and
backward) under ``torch.profiler``: wall time against the sum of the kernels' device time says how much
of the step the device sat idle, and the kernels by time say where the rest went. The profiler's
per-kernel cost makes the wall time longer than an unprofiled step's.

    python bench/profile_step.py --kind user-fp32-head --shape 7B --micro-batch 8      # GPU only
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import sync_vs_trl
import torch

from colocate_grpo.trainer import ColocateGRPOTrainer

STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="user", choices=sorted(sync_vs_trl.USER_SERVING))
    parser.add_argument("--shape", default="7B")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    parser.add_argument("--top", type=int, default=25, help="kernels (and host operators) to print")
    parser.add_argument("--host", action="store_true", help="also profile the host: operators by their own CPU time")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    micro_batches = sync_vs_trl.GENERATION_BATCH // args.micro_batch
    training_step = ColocateGRPOTrainer.training_step
    calls = 0
    activities = [torch.profiler.ProfilerActivity.CUDA] + [torch.profiler.ProfilerActivity.CPU] * args.host
    profile = torch.profiler.profile(activities=activities)
    start = 0.0
    retries = 0

    def profiled_step(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        # The last step's micro-batches: its first also generates and syncs (TRL's _prepare_inputs).
        nonlocal calls, start, retries
        calls += 1
        if calls == (STEPS - 1) * micro_batches + 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            profile.__enter__()
        out = training_step(self, *a, **k)
        if calls == STEPS * micro_batches:
            torch.cuda.synchronize()
            profile.__exit__(None, None, None)
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            report(args, time.perf_counter() - start, retries, profile.key_averages())
        return out

    ColocateGRPOTrainer.training_step = profiled_step
    model_path = sync_vs_trl.build_model(args.shape, Path(args.models) / args.shape)
    result = sync_vs_trl.run_one(args.kind, model_path, STEPS, tiny=False, micro_batch=args.micro_batch)
    print("step s (the last profiled):", ", ".join(f"{step['step_s']:.3f}" for step in result["steps"]))


def report(args: argparse.Namespace, wall_s: float, retries: int, averages: list) -> None:  # noqa: ANN001
    """Print the step's wall and kernel time, its allocator retries (each a device-wide synchronization while
    torch frees its cache to allocate again) and its top kernels."""
    kernel_ms = sum(event.device_time_total for event in averages) / 1e3
    print(f"{args.kind} {args.shape}, micro-batch {args.micro_batch}, step {STEPS}: wall {wall_s:.3f} s, ", end="")
    print(f"kernels {kernel_ms / 1e3:.3f} s, allocator retries {retries}")
    kernels = [event for event in averages if event.device_time_total > 0]
    for event in sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[: args.top]:
        print(f"  {event.device_time_total / 1e3:9.2f} ms x{event.count:<5d} {event.key[:120]}", flush=True)
    if args.host:
        print("host operators by their own CPU time:")
        for event in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]:
            print(f"  {event.self_cpu_time_total / 1e3:9.2f} ms x{event.count:<5d} {event.key[:120]}", flush=True)


if __name__ == "__main__":
    main()
