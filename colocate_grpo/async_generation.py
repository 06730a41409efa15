"""Asynchronous generation (``async_generation: true``): the engine generates the next batch while the trainer
trains on this one.

TRL's GRPOTrainer generates a batch, then trains on it. Here, as soon as batch n has been handed to the trainer,
a background thread generates batch n+1 (on a GPU, on a CUDA stream of its own) with the adapter the engine holds
at that moment: version n, the trainer's optimizer step count. The trainer then scores batch n and trains on it;
the optimizer step updates the trainer's LoRA factors, which are not what the engine reads: a sync copies them
into the engine's LoRA slot, and only between generations. The shared base weights are written by nobody. At the
next hand-over the trainer takes batch n+1 (sampled one update before the weights it trains), and TRL's
importance-sampling correction reweights its tokens with the log-probabilities vLLM sampled them with.

vLLM's ``LLM`` is driven by one thread at a time: every call of the trainer's thread that reaches the engine (a
sync, a generation, the end of training) first waits for the batch in flight. With one batch in flight, a batch's
staleness when training on it starts is at most 1; ``max_staleness`` (TRL's AsyncGRPOConfig key) bounds it, and
an older batch is dropped and generated again. An exception in the worker is re-raised in the trainer's thread at
the next hand-over, with the worker's message; the end of training (also by an exception or an interrupt) waits
for the worker with a deadline.

The trainer gets the next batch's prompts by looking ahead in its data loader's iterator (:class:`Lookahead`),
without changing what the loader yields: the prompts trained on at each step are exactly those generated for,
in the loader's order.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.generation.vllm_generation import VLLMGeneration

from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import Weights
from colocate_grpo.engine_state import GenerationWorkerError
from colocate_grpo.metrics import PhaseMetrics
from colocate_grpo.plan import RunPlan, plan_for_model
from colocate_grpo.serving import AsyncMode
from colocate_grpo.trainer import ColocatedGeneration, ColocateGRPOTrainer

logger = logging.getLogger(__name__)

# How long the end of training waits for a batch in flight, in seconds: far longer than a generation takes.
STOP_TIMEOUT_S = 300.0


@dataclass
class Upcoming:
    """The next generation batch, tokenized: what the worker generates once the current batch is handed over.

    Attributes:
        prompt_ids: token ids of each prompt, one list per completion to sample (TRL repeats each prompt
            ``num_generations`` times).
        num_generations: completions per prompt, as TRL passes it to ``generate``.
    """

    prompt_ids: list[list[int]]
    num_generations: int


@dataclass
class Rollout:
    """One generation: its prompts, the adapter version it samples with, and its output or error once done.

    Times are ``time.perf_counter()`` seconds; ``finished`` is None while it runs.
    """

    prompt_ids: list[list[int]]
    num_generations: int
    version: int
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    output: tuple | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None


class OverlapClock:
    """Per optimizer step: how long generation and training overlapped, how long each side was idle, and the
    staleness of the batches taken for training.

    Generations (in the worker or, where none was ready, in the trainer's thread) and the trainer's waits for
    them are intervals; each step's metrics are their parts within the step. The trainer waits only while a
    generation runs, so the overlap is the generating time less the waiting time.
    """

    def __init__(self) -> None:
        self.generations: list[Rollout] = []
        self.waits: list[tuple[float, float]] = []
        self.staleness: list[int] = []
        self.dropped = 0
        self._step_start = time.perf_counter()

    def start_step(self) -> None:
        self._step_start = time.perf_counter()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the enclosed block as the trainer waiting for a generation."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waits.append((start, time.perf_counter()))

    def end_step(self) -> dict[str, float]:
        """The step's ``async/*`` metrics (seconds and counts), and a fresh start for the next step."""
        now = time.perf_counter()
        start = self._step_start

        def within(begin: float, end: float | None) -> float:
            return max(0.0, min(now if end is None else end, now) - max(begin, start))

        generating = sum(within(r.started, r.finished) for r in self.generations)
        waiting = sum(within(begin, end) for begin, end in self.waits)
        metrics = {
            "async/overlap_s": max(0.0, generating - waiting),
            "async/trainer_idle_s": waiting,
            "async/engine_idle_s": max(0.0, (now - start) - generating),
            "async/dropped": float(self.dropped),
        }
        if self.staleness:
            metrics["async/staleness"] = sum(self.staleness) / len(self.staleness)
            metrics["async/staleness_max"] = float(max(self.staleness))
        self.generations = [r for r in self.generations if r.finished is None]  # the batch still in flight
        self.waits, self.staleness, self.dropped = [], [], 0
        return metrics


class AsyncColocatedGeneration(ColocatedGeneration):
    """:class:`~colocate_grpo.trainer.ColocatedGeneration` that generates the next batch in a background thread.

    The trainer sets :attr:`upcoming` before TRL asks for a batch; once the batch asked for is handed over, the
    upcoming one starts generating with the adapter the engine holds. The engine stays awake. Serves the adapter
    only (the plan refuses the rest): the worker reads the base weights, which nobody writes, and the engine's LoRA
    slot, which only a sync writes, after the worker finished.

    Attributes:
        max_staleness: optimizer steps a batch's adapter may lag behind :attr:`version` when it is taken.
        version: returns the trainer's adapter version (its optimizer step count).
        served_version: the version the engine's LoRA slot holds (the last sync's), None before the first.
        upcoming: the batch to generate once the next one is handed over (set by the trainer).
        pending: the batch in flight or generated, not yet taken.
        overlap: the per-step overlap, idle time and staleness.
    """

    def __init__(self, *args: Any, max_staleness: int = 1, **kwargs: Any) -> None:
        self.max_staleness = max_staleness
        self.version: Callable[[], int] = lambda: 0
        self.served_version: int | None = None
        self.upcoming: Upcoming | None = None
        self.pending: Rollout | None = None
        self.overlap = OverlapClock()
        self._stream: torch.cuda.Stream | None = None
        super().__init__(*args, **kwargs)

    def sync_weights(self) -> None:
        # The worker reads the LoRA slot that a sync writes, and vLLM's LLM is driven by one thread at a time.
        self._finish_pending()
        super().sync_weights()
        self.served_version = self.version()

    def generate(
        self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None
    ) -> tuple[Any, ...]:
        """TRL's ``generate``: the batch generated ahead for these prompts where it is there and fresh enough,
        else a generation now; then the upcoming batch starts generating. Returns TRL's tuple."""
        upcoming, self.upcoming = self.upcoming, None
        rollout = self._take(prompts, images, num_generations)
        if rollout is None:
            rollout = self._generate_now(prompts, images, num_generations, profiler)
        self.overlap.staleness.append(self.version() - rollout.version)
        if upcoming is not None:
            self._launch(upcoming)
        return rollout.output

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the batch in flight, if any, and drop it (the end of training).

        Raises:
            GenerationWorkerError: when the worker is still generating after ``timeout`` seconds.
        """
        rollout, self.pending, self.upcoming = self.pending, None, None
        if rollout is None or rollout.thread is None:
            return
        rollout.thread.join(timeout)
        if rollout.thread.is_alive():
            raise GenerationWorkerError(
                f"The generation worker was still generating {timeout:.0f} s after training ended; the engine is in "
                "use by it. Restart the process to use the engine again."
            )
        self._after_worker()
        if rollout.error is not None:
            logger.warning("The batch generated ahead failed and is not trained on: %s", _described(rollout.error))

    # --- internals ---------------------------------------------------------------------------
    def _finish_pending(self) -> Rollout | None:
        """Wait for the batch in flight; raise its error in this thread. The finished batch stays pending."""
        rollout = self.pending
        if rollout is None or rollout.thread is None:
            return rollout
        with self.clock.phase("generate"), self.overlap.waiting():
            rollout.thread.join()
        self._after_worker()
        rollout.thread = None
        if rollout.error is not None:
            self.pending = None
            raise GenerationWorkerError(
                f"Generating the next batch in the background failed: {_described(rollout.error)}"
            ) from rollout.error
        return rollout

    def _take(self, prompts: list[list[int]], images: Any, num_generations: int) -> Rollout | None:
        """The pending batch, finished, where it was generated for these prompts and is fresh enough; None when a
        batch must be generated now. Another request (an evaluation's prompts) leaves the pending batch for later."""
        rollout = self._finish_pending()
        if rollout is None or images is not None:
            return None
        if rollout.prompt_ids != prompts or rollout.num_generations != num_generations:
            return None
        self.pending = None
        staleness = self.version() - rollout.version
        if staleness > self.max_staleness:
            self.overlap.dropped += 1
            logger.info("Dropped a batch %d steps stale (max_staleness %d).", staleness, self.max_staleness)
            return None
        return rollout

    def _generate_now(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any) -> Rollout:
        """Generate in this thread, with the adapter the engine holds (the trainer synced it for this step)."""
        if self.llm.state.weights in (Weights.DISCARDED, Weights.GARBAGE):
            self.sync_weights()
        self._wake()
        rollout = Rollout(prompts, num_generations, self._served())
        self.overlap.generations.append(rollout)
        try:
            with self.clock.phase("generate"), self.overlap.waiting():
                rollout.output = VLLMGeneration.generate(
                    self, prompts=prompts, images=images, num_generations=num_generations, profiler=profiler
                )
        finally:
            rollout.finished = time.perf_counter()
        return rollout

    def _launch(self, upcoming: Upcoming) -> None:
        """Start generating ``upcoming`` in the background with the adapter the engine holds now."""
        self._wake()
        rollout = Rollout(upcoming.prompt_ids, upcoming.num_generations, self._served())
        if torch.cuda.is_available() and not self.llm.cpu:
            # The highest priority there is (CUDA clamps a lower number to it): a decode step is many short kernels
            # that would otherwise queue behind the training's long matmuls for the GPU's SMs.
            self._stream = self._stream or torch.cuda.Stream(priority=-100)
            self._stream.wait_stream(torch.cuda.current_stream())  # the sync's writes into the LoRA slot first
        rollout.thread = threading.Thread(
            target=self._run, args=(rollout,), name="colocate_grpo-generation", daemon=True
        )
        self.pending = rollout
        self.overlap.generations.append(rollout)
        rollout.thread.start()

    def _run(self, rollout: Rollout) -> None:
        """The worker: generate ``rollout``'s batch on the worker's stream; keep the output or the error."""
        try:
            with self._on_worker_stream():
                # No profiler: TRL's writes the trainer's metrics, which only the trainer's thread touches.
                rollout.output = VLLMGeneration.generate(
                    self, prompts=rollout.prompt_ids, images=None, num_generations=rollout.num_generations
                )
                if self._stream is not None:
                    self._stream.synchronize()
        except BaseException as error:  # re-raised in the trainer's thread at the hand-over
            rollout.error = error
        finally:
            rollout.finished = time.perf_counter()

    @contextlib.contextmanager
    def _on_worker_stream(self) -> Iterator[None]:
        """The worker's CUDA stream for this thread's kernels and the engine's steps (nothing on a CPU)."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream), self.llm.steps_on(self._stream):
            yield

    def _after_worker(self) -> None:
        """Order the trainer's stream after the worker's: its next writes (a sync) follow the worker's reads."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def _wake(self) -> None:
        if not self.llm.state.ready:
            with self.clock.phase("wake"):
                self.llm.wake_up()

    def _served(self) -> int:
        return self.version() if self.served_version is None else self.served_version


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Lookahead:
    """An iterator that yields what ``iterator`` yields, and can look ahead without changing that.

    Args:
        iterator: an epoch's data loader iterator.
    """

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator
        self._buffer: collections.deque[Any] = collections.deque()

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        return self._buffer.popleft() if self._buffer else next(self.iterator)

    def peek(self, ahead: int) -> Any | None:
        """The item ``ahead`` places after the next one (0: the next), or None past the end."""
        while len(self._buffer) <= ahead:
            try:
                self._buffer.append(next(self.iterator))
            except StopIteration:
                return None
        return self._buffer[ahead]


class AsyncColocateGRPOTrainer(ColocateGRPOTrainer):
    """:class:`~colocate_grpo.trainer.ColocateGRPOTrainer` whose engine generates the next batch while it trains.

    Takes ColocateGRPOTrainer's arguments. ``plan`` must plan asynchronous generation (``plan.asynchronous``);
    without a plan, one is made from the model and ``args`` with the adapter served and ``max_staleness``.

    Args:
        max_staleness: optimizer steps a batch's adapter may lag behind the trainer's when training on it starts
            (without a plan; a plan has its own).
    """

    generation_class = AsyncColocatedGeneration

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: Any,
        *,
        plan: RunPlan | None = None,
        max_staleness: int = 1,
        vllm_options: VLLMConfig | None = None,
        sequence_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        if plan is None:
            plan = plan_for_model(
                model,
                args,
                vllm_options=vllm_options,
                serve_adapter=True,
                sequence_tokens=sequence_tokens,
                asynchronous=AsyncMode(max_staleness),
            )
        elif plan.asynchronous is None or not plan.serving.serves_adapter:
            raise ValueError(
                "The plan does not generate asynchronously with the adapter served: use ColocateGRPOTrainer."
            )
        elif vllm_options is not None or sequence_tokens is not None:
            raise ValueError("Pass either a plan or vllm_options and sequence_tokens: the plan has them.")
        if args.world_size > 1:
            raise ValueError(
                "Asynchronous generation runs in one process; with several, train sequentially (no async_generation)."
            )
        self._lookahead: Lookahead | None = None
        self._handed: collections.deque[Any] = collections.deque()  # batches handed to training, not yet prepared
        super().__init__(model, reward_funcs, args, plan=plan, **kwargs)
        generation = self.vllm_generation
        generation.max_staleness = plan.asynchronous.max_staleness
        generation.version = lambda: self.state.global_step
        self.add_callback(PhaseMetrics(generation.overlap, record=self._record_metrics))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``; at its end (also by an exception or an interrupt) the batch in flight is waited for,
        with a deadline, and dropped, so that the engine is free."""
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            try:
                self.vllm_generation.stop()
            except GenerationWorkerError as error:  # the original exception is the one to report
                logger.error("%s", error)
            raise
        self.vllm_generation.stop()
        return result

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        # Read the epoch's batches through a lookahead, so that the next generation batch is known in advance.
        if self._lookahead is None or self._lookahead.iterator is not epoch_iterator:
            self._lookahead = Lookahead(epoch_iterator)
            self._handed.clear()
        batches, items = super().get_batch_samples(self._lookahead, num_batches, device)
        self._handed.extend(batches)
        return batches, items

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        if self._handed:
            self._handed.popleft()  # this micro-batch: the batches after it are the next ones in the handed queue
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            self.vllm_generation.upcoming = self._upcoming(generate_every)
        return super()._prepare_inputs(generation_batch)

    def _upcoming(self, generate_every: int) -> Upcoming | None:
        """The generation batch after this one, tokenized as TRL tokenizes it; None at the end of the epoch or of
        training (nothing is generated that would not be trained on)."""
        accumulation = self.args.gradient_accumulation_steps
        remaining = (self.state.max_steps - self.state.global_step) * accumulation - self._step % accumulation
        if generate_every >= remaining or self._lookahead is None:
            return None
        ahead = generate_every - 1
        handed = len(self._handed)
        batch = self._handed[ahead] if ahead < handed else self._lookahead.peek(ahead - handed)
        if batch is None:
            return None
        prompt_ids, images, _ = self._tokenize_prompts(copy.deepcopy([example["prompt"] for example in batch]))
        if images is not None:
            return None  # images go to vLLM with their prompts: generated when their batch comes
        return Upcoming(prompt_ids, self.num_generations)
