"""Timing on the GPU, shared by the benchmarks that time one call at a time."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_time(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn()`` on the GPU (CUDA events around each call), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)
