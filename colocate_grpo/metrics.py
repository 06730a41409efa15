"""Run metrics: time and memory per phase of each step, and every log event kept and written as JSONL."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import TrainerCallback

from colocate_grpo.metrics_file import append_line

logger = logging.getLogger(__name__)

GIB = 2**30
# Phases timed explicitly; "train" is the rest of the step (scoring, logprobs, forward, backward, optimizer).
ENGINE_PHASES = ("wake", "sync", "generate", "sleep")

REWARD_KEY = "reward"


class MetricsLog(TrainerCallback):
    """Keeps every training log event (a dict with ``step``) and appends it to a JSONL file.

    Args:
        path: the JSONL file; created on the first event, parents included.

    Attributes:
        context: strings added to every event, such as ``served_as`` (how the engine serves the policy).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.history: list[dict[str, Any]] = []
        self.context: dict[str, str] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if not logs or not state.is_world_process_zero:
            return
        values = {k: v for k, v in logs.items() if isinstance(v, int | float | str)}
        event = {"step": state.global_step, **self.context, **values}
        self.history.append(event)
        append_line(self.path, json.dumps(event))  # one write of the whole line: a kill leaves no torn record

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, in order, skipping missing and NaN values."""
        return series(self.history, key)


def series(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of metric ``key`` in a list of log events, skipping missing and NaN values."""
    return [
        (e["step"], float(e[key])) for e in history if isinstance(e.get(key), int | float) and not math.isnan(e[key])
    ]


def first_and_last_tenth(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last tenth (at least one value each) of a series."""
    if not values:
        return math.nan, math.nan
    n = max(1, len(values) // 10)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def tenths_difference_noise(values: list[float]) -> float:
    """Standard error of (last tenth's mean - first tenth's mean) of a series, from the spread within the
    two tenths: a difference within about twice it is what chance gives. NaN below two values a tenth."""
    n = len(values) // 10
    if n < 2:
        return math.nan
    return math.sqrt((statistics.variance(values[:n]) + statistics.variance(values[-n:])) / n)


class PhaseClock:
    """Seconds and memory per phase of each optimizer step.

    Engine phases are wrapped with :meth:`phase`; whatever else happens in the step counts as
    ``train``. :meth:`end_step` returns ``time/<phase>`` (seconds, every phase every step, 0 when
    a phase did not run) and, per phase that ran, ``memory/<phase>/...`` in GiB: on a GPU the
    device's used memory after the phase, torch's peak allocated and reserved memory during it
    (vLLM's sleep-mode pool is part of torch's), and ``vllm_<tag>_gib``, what that pool holds on
    the device by tag (``weights``, ``kv_cache``); on CPU the process's resident memory after it.

    Attributes:
        pools: returns the device bytes vLLM's pool holds, by tag (set once the engine exists).
        failed_phase: the engine phase an exception escaped from in this step, if any.
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.failed_phase: str | None = None
        self.pools: Callable[[], dict[str, int]] = dict
        self._seconds: dict[str, float] = defaultdict(float)
        self._memory: dict[str, dict[str, float]] = {}
        self._step_start = time.perf_counter()

    def start_step(self) -> None:
        self._seconds.clear()
        self._memory.clear()
        self.failed_phase = None
        self._reset_peak()
        self._step_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed work as phase ``name`` (accumulated if it runs several times in a step)."""
        self._close_train_segment()
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed_phase = name
            raise
        finally:
            self._synchronize()
            self._seconds[name] += time.perf_counter() - start
            stats = self._allocator_stats()
            self._memory[name] = {**self._peaks(stats), **self._resident(stats)}
            self._reset_peak()

    def end_step(self) -> dict[str, float]:
        self._close_train_segment()
        total = time.perf_counter() - self._step_start
        engine = sum(self._seconds[p] for p in ENGINE_PHASES)
        metrics = {f"time/{p}": self._seconds[p] for p in ENGINE_PHASES}
        metrics["time/train"] = max(0.0, total - engine)
        metrics["time/step"] = total
        metrics["time/engine_share"] = engine / total if total > 0 else 0.0
        self._memory["train"].update(self._resident(self._allocator_stats()))
        for phase, values in self._memory.items():
            for key, value in values.items():
                metrics[f"memory/{phase}/{key}"] = value
        return metrics

    def _close_train_segment(self) -> None:
        """Fold the peaks since the last phase into ``train`` (the work between engine phases)."""
        self._synchronize()
        train = self._memory.setdefault("train", {})
        for key, value in self._peaks(self._allocator_stats()).items():
            train[key] = max(value, train.get(key, 0.0))
        self._reset_peak()

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def _allocator_stats(self) -> dict[str, int]:
        """torch's allocator statistics, read once per phase boundary (each read builds the whole table)."""
        return torch.cuda.memory_stats() if self.cuda else {}

    def _peaks(self, stats: dict[str, int]) -> dict[str, float]:
        if not self.cuda:
            return {}
        return {
            "peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
            "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GIB,
        }

    def _resident(self, stats: dict[str, int]) -> dict[str, float]:
        pools = {f"vllm_{tag}_gib": size / GIB for tag, size in self.pools().items()}
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            allocated = stats.get("allocated_bytes.all.current", 0) / GIB
            return {"device_used_gib": (total - free) / GIB, "allocated_gib": allocated, **pools}
        return {"rss_gib": psutil.Process().memory_info().rss / GIB, **pools}


class PhaseMetrics(TrainerCallback):
    """Feeds a per-step clock (a :class:`PhaseClock`, or anything with ``start_step()`` and ``end_step() -> dict``)
    into the trainer's metrics once per optimizer step."""

    def __init__(self, clock: Any, record: Any) -> None:
        self.clock = clock
        self.record = record

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.clock.start_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.record(self.clock.end_step())


EQUAL_KEY = "sampling/logp_equal_fraction"
# TRL's keys for the mean and largest |logprob vLLM - logprob trainer|, which it logs only with its importance-sampling
# correction on.
DIFFERENCE_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")


class LogpAgreement:
    """The trainer's log-probabilities of the sampled tokens, from the forward that the loss is computed with,
    against the engine's: ``sampling/logp_equal_fraction``, the share equal bit for bit, each micro-batch scored
    with the weights that sampled it (before the first optimizer step after the generation).

    Args:
        record: receives the metrics (averaged into the step's log).
        bitwise: whether the run computes them bit for bit (``trl.vllm_bitwise_logprobs``): a share below 1 is
            then warned about, once each time it drops.
        log_differences: also record TRL's mean and largest |difference| (TRL logs them itself only with its
            importance-sampling correction on).
    """

    def __init__(self, record: Callable[[dict[str, float]], None], bitwise: bool, log_differences: bool) -> None:
        self.record, self.bitwise, self.log_differences = record, bitwise, log_differences
        self.equal = True

    def check(self, trained: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, step: int) -> None:
        """Record how ``trained`` (fp32, one row a completion) agrees with ``sampled`` over ``mask``'s tokens that
        the engine scored (NaN where it could not)."""
        metrics = logp_agreement(trained, sampled, mask)
        if not metrics:
            return
        if not self.log_differences:
            metrics = {EQUAL_KEY: metrics[EQUAL_KEY]}
        self.record(metrics)
        equal = metrics[EQUAL_KEY] == 1.0
        if self.bitwise and self.equal and not equal:
            logger.warning(
                "%s is %.4f at step %d: the trainer's log-probabilities differ from the engine's on some sampled "
                "tokens, though trl.vllm_bitwise_logprobs computes them with the same kernels (docs/bitwise.md).",
                EQUAL_KEY,
                metrics[EQUAL_KEY],
                step,
            )
        self.equal = equal


def logp_agreement(trained: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The share of ``mask``'s tokens whose two log-probabilities are equal bit for bit, and TRL's mean and largest
    |difference|; tokens the engine could not score (NaN) are left out. Empty when no token is left."""
    valid = mask.bool() & ~torch.isnan(sampled)
    trained, sampled = trained.detach().float()[valid], sampled.float()[valid]
    if trained.numel() == 0:
        return {}
    difference = (trained - sampled).abs()
    # Bit for bit: the fp32 patterns (0.0 and -0.0 differ; equal values always have equal patterns otherwise).
    equal = trained.view(torch.int32) == sampled.view(torch.int32)
    mean, largest = DIFFERENCE_KEYS
    return {
        # A count over the total, not a float mean: CUDA's mean multiplies the sum by 1/n, and every token equal
        # read 0.99999994 (an H100 at 1.5B, at a step whose mean |difference| was exactly 0).
        EQUAL_KEY: equal.sum().item() / equal.numel(),
        mean: difference.mean().item(),
        largest: difference.max().item(),
    }
