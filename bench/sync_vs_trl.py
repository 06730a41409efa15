"""Stock TRL colocate against colocate_grpo, same random-weight model and GRPO settings, side by side.

Trainers: stock TRL (``stock``); ``user``, colocate_grpo as a user runs it: ``build_trainer`` with
the plain config a user would write (model, dataset, reward, batch keys, nothing else: every other
setting is a default; ``user-merged``, ``user-adapter`` and ``user-4bit`` add the one key that serves the
policy another way, ``user-fp32-head`` the key that computes the logits in fp32: ``USER_SERVING``;
``user-own`` is ``user`` on two copies of the base, the trainer's and the engine's, not one shared);
colocate_grpo with the same ordinary PEFT LoRA (``ours``),
and colocate_grpo with merge-aware bf16 LoRA, its default (``ours-ma``); ``ours-ma-fraction`` is
``ours-ma`` with its KV cache sized as TRL's (all of the memory fraction), not to the batch; ``ours-adapter``
is ``ours`` with the adapter served by vLLM's LoRA kernels (``serve_adapter``) instead of merged, the
trainer's base weights shared with the engine's; ``ours-adapter-own`` the same on two copies of the base;
``stock-4bit`` is stock TRL on the NF4 base that ``user-4bit`` (``load_in_4bit: true``) trains. Each
(shape, trainer) pair runs in its own process: vLLM allows one sleep-mode engine per process.
The driver builds each shape's random-weight model once, runs both trainers, and prints a table
with ratios (colocate_grpo / stock TRL): step time, sync time (the weights' wake and the push;
ours also wakes the KV cache there, while the device writes) and the push alone (ours timed on the
device, from its call until the weights are written; stock's is the sync less its wake), overhead
share (sleep + wake + sync over the step), device memory after each phase, mean
|logp_vLLM - logp_trainer| and the base weights' drift after the run.

    python bench/sync_vs_trl.py --shapes 1.5B --out bench/results/sync_vs_trl_1.5B.json   # GPU
    python bench/sync_vs_trl.py --shapes 7B --kinds user --card-gib 40   # as on a 40 GiB card
    python bench/sync_vs_trl.py --shapes tiny --kinds ours --steps 3                     # CPU check
    python bench/sync_vs_trl.py --shapes 1.5B --kinds stock user user-merged user-adapter --steps 200 --together
        # the mismatch over 200 steps, the four runs side by side on the device (their times are not a run's alone);
        # --train-seconds 450 ends each within a time limit, at the steps it reached; --completion-tokens 128
        # halves a step, for more steps within one

Settings of the measured runs: LoRA r=16 on all linears, 8 prompts x 8 generations, up to 256
completion tokens, vllm_gpu_memory_utilization 0.3, bf16, gradient checkpointing, lr 1e-5, the reward
``half_vocabulary_reward`` (every step trains; ``lora_b_max`` in the results says so). The results folders
up to ``2026-12-04-h200-3fe2623`` used a share of distinct tokens, which at 1.5B and 7B gave every
completion 1 and every step a zero gradient: their times and memory are of full steps, but their
weights never moved.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from shapes import QWEN25

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2Config, TrainerCallback
    from trl import GRPOConfig

SHAPES = QWEN25
PROMPT_TOKENS = 32
STARTED = "sync_vs_trl: engine started"
SHARP = "-sharp"
SHARP_LOGIT_STD = 8.0
WARMUP_STEPS = 2


def half_vocabulary_reward(completions: list[str], **_: object) -> list[float]:
    """Share of the completion's words in a fixed half of the vocabulary (those whose CRC-32 is even).

    A reward with spread at every shape, so that every step trains: a group's completions of 256 tokens
    differ by about 0.03, of 4 tokens (the tiny model) by about 0.25, and a policy earns more by moving
    probability into that half. (A share of distinct tokens has none at 1.5B and 7B: 256 tokens drawn
    from 152k rarely repeat, every reward is 1, and every gradient 0.)
    """
    return [sum(zlib.crc32(w.encode()) % 2 == 0 for w in c.split()) / max(1, len(c.split())) for c in completions]


def benchmark_prompts(model_path: str, count: int) -> list[str]:
    """``count`` prompts for the benchmarks' model at ``model_path``: the arithmetic task's on the tiny model,
    :func:`random_prompts` of its vocabulary on a ``build_model`` shape."""
    if "tiny" in model_path:
        from colocate_grpo.tasks import arithmetic_dataset

        return list(arithmetic_dataset(size=count)["prompt"])
    from transformers import AutoTokenizer

    return random_prompts(len(AutoTokenizer.from_pretrained(model_path)), count)


def random_prompts(vocab: int, count: int) -> list[str]:
    """``count`` prompts of ``PROMPT_TOKENS`` random words of a ``build_model`` vocabulary, the same every call."""
    import random

    rng = random.Random(0)
    return [" ".join(f"t{rng.randrange(2, vocab)}" for _ in range(PROMPT_TOKENS)) for _ in range(count)]


def shape_config(shape: str) -> Qwen2Config:
    """The Hugging Face config of the random-weight Qwen2 of ``shape`` (an untied head)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        **SHAPES[shape.removesuffix(SHARP)],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )


def build_model(shape: str, directory: Path) -> str:
    """A random-weight bf16 Qwen2 of ``shape`` with a word-level tokenizer covering its vocabulary.

    A shape ending in ``-sharp`` (``1.5B-sharp``) has its head scaled so that the logits' standard deviation
    is ``SHARP_LOGIT_STD``: a random model's next-token distributions are near uniform (entropy 11.2 nats of
    at most 11.9), a trained model's are sharp, and the head's rounding weighs with the logits' size.
    """
    if shape == "tiny":
        from colocate_grpo.tiny import tiny_model_path

        return str(tiny_model_path())
    if (directory / "config.json").exists():
        return str(directory)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    dims = SHAPES[shape.removesuffix(SHARP)]
    vocab = {f"t{i}": i for i in range(dims["vocab_size"])}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="t0", pad_token="t0", unk_token="t1")
    config = shape_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if shape.endswith(SHARP):  # the final norm's output has unit RMS: a logit's std is the head row's norm
        with torch.no_grad():
            model.lm_head.weight.mul_(SHARP_LOGIT_STD / (config.initializer_range * config.hidden_size**0.5))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # The runs measure the device's used memory, which would count this process's cache (30 GiB at 7B).
    del model
    torch.cuda.empty_cache()
    return str(directory)


def copy_floor_s(model: torch.nn.Module) -> float:
    """Seconds to read and write the model's bytes once on the device: the floor for any sync."""
    import torch

    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" not in n)
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del source, target
    torch.cuda.empty_cache()
    return min(times)


def _timed_part(phases: list[str], totals: dict[str, float], name: str, fn):  # noqa: ANN001, ANN202
    """``fn`` whose wall seconds are added to ``totals["<phase>.<name>_s"]``, ``phase`` the innermost of
    ``phases`` (the timed calls in progress); calls outside any phase are not counted."""

    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if phases:
                key = f"{phases[-1]}.{name}_s"
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    return wrapper


def time_sleep_mode_parts(phases: list[str], totals: dict[str, float]) -> None:
    """Time where sleep and wake spend their time: vLLM's driver calls, its collection, torch's cache."""
    import gc
    import types

    import torch
    from vllm.device_allocator import cumem

    cumem.create_and_map = _timed_part(phases, totals, "map", cumem.create_and_map)
    cumem.unmap_and_release = _timed_part(phases, totals, "unmap", cumem.unmap_and_release)
    cumem.gc = types.SimpleNamespace(collect=_timed_part(phases, totals, "gc", gc.collect))
    torch.cuda.empty_cache = _timed_part(phases, totals, "empty_cache", torch.cuda.empty_cache)
    torch.accelerator.empty_cache = _timed_part(phases, totals, "empty_cache", torch.accelerator.empty_cache)


def time_gc_pauses(phases: list[str], totals: dict[str, float]) -> None:
    """Time Python's garbage collections inside the timed calls, as ``totals["<phase>.gc_pause_s"]``."""
    import gc

    started: list[float] = []

    def on_collection(event: str, _: dict) -> None:
        if event == "start":
            started.append(time.perf_counter())
        elif started:
            seconds = time.perf_counter() - started.pop()
            if phases:
                key = f"{phases[-1]}.gc_pause_s"
                totals[key] = totals.get(key, 0.0) + seconds

    gc.callbacks.append(on_collection)


def time_sync_parts(phases: list[str], totals: dict[str, float]) -> None:
    """Time the Python of colocate_grpo's sync: the push (launches only: the writes run
    asynchronously), the check of the graph's addresses before a replay, the LoRA factors' key (read
    while the device writes, served merged or as the adapter), the prefix-cache reset, and the phase
    clock's reads and waits (a wait there is where the device finishes the push). With the adapter
    served: its push's wall time. With merged serving on the shared base: the restore of the base
    after each generation (launches)."""
    from colocate_grpo import sync, trainer
    from colocate_grpo.engine import Engine
    from colocate_grpo.metrics import PhaseClock

    trainer.push_weights = _timed_part(phases, totals, "push", trainer.push_weights)
    sync._Capture.reads_same_memory = _timed_part(phases, totals, "addresses", sync._Capture.reads_same_memory)
    sync.FactorsKey.changed = _timed_part(phases, totals, "key", sync.FactorsKey.changed)
    Engine.reset_prefix_cache = _timed_part(phases, totals, "prefix_reset", Engine.reset_prefix_cache)
    PhaseClock._allocator_stats = _timed_part(phases, totals, "clock_stats", PhaseClock._allocator_stats)
    PhaseClock._synchronize = _timed_part(phases, totals, "clock_wait", PhaseClock._synchronize)
    trainer.push_adapter = _timed_part(phases, totals, "adapter_push", trainer.push_adapter)
    sync.MergedInPlace.restore = _timed_part(phases, totals, "restore", sync.MergedInPlace.restore)


def time_push_on_device(pushes: list, function: str = "push_weights") -> None:
    """Record CUDA events around colocate_grpo's push, into ``pushes``: from its call until the device has
    written the weights. Its wall time cannot show that, as the KV cache's wake runs during the writes.
    ``function`` is the trainer module's push to time: ``push_weights`` (the weights, merged unless the
    adapter is served), ``merge_into_shared_base`` (merged into the shared base in place) or ``push_adapter``
    (the adapter's factors into vLLM's LoRA buffers)."""
    import torch

    from colocate_grpo import trainer

    push = getattr(trainer, function)

    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return push(*a, **k)
        finally:
            end.record()
            pushes.append((start, end))

    setattr(trainer, function, wrapper)


def push_s(timings: dict[str, float]) -> float:
    """Seconds of a sync's push: device-timed for ours; for stock TRL the sync less its wake of the weights."""
    return timings["push_s"] if "push_s" in timings else timings.get("sync_s", 0.0) - timings.get("sync_wake_s", 0.0)


def pool_layout() -> dict[str, list[int]]:
    """vLLM's sleep-mode allocations: count and GiB per tag."""
    from vllm.device_allocator.cumem import CuMemAllocator

    layout: dict[str, list[int]] = {}
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        count, size = layout.get(data.tag, [0, 0])
        layout[data.tag] = [count + 1, size + data.handle[1]]
    return {tag: [count, round(size / 2**30, 3)] for tag, (count, size) in layout.items()}


GENERATION_BATCH = 64  # sequences generated a step: 8 prompts x 8 generations
NUM_GENERATIONS = 8
COMPLETION_TOKENS = 256  # the most a completion may have; random weights rarely stop sooner
PROMPTS = 256
STEPS_PER_PASS = PROMPTS // (GENERATION_BATCH // NUM_GENERATIONS)  # steps that draw every prompt once

# The user's kinds: the plain config, and the one key a user sets to serve the policy another way.
USER_SERVING = {
    "user": {},
    "user-merged": {"lora_merge_aware": None},
    "user-adapter": {"trl": {"vllm_lora_sync": True}},
    "user-4bit": {"load_in_4bit": True},
    "user-fp32-head": {"trl": {"cast_lm_head_to_fp32": True}},
    "user-own": {},  # the plain config with two copies of the base (not shared): what sharing saves, and costs
}


def user_config(
    model_path: str,
    prompts: list[str],
    steps: int,
    tiny: bool,
    directory: Path,
    kind: str = "user",
    micro_batch: int = 64,
    completion_tokens: int = COMPLETION_TOKENS,
) -> dict:
    """The config a user writes for this run: model, dataset, reward and batch keys, all else default
    (plus, for ``user-*`` kinds, the key that picks how the policy is served: ``USER_SERVING``)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    serving = USER_SERVING[kind]
    return {
        "base_model": model_path,
        "output_dir": str(directory / "run"),
        "task": None,
        "dataset": {"path": str(data), "chat": False},
        "micro_batch_size": micro_batch,
        "gradient_accumulation_steps": GENERATION_BATCH // micro_batch,
        "max_steps": steps,
        **{key: value for key, value in serving.items() if key != "trl"},
        "trl": {
            "reward_funcs": ["sync_vs_trl.half_vocabulary_reward"],
            "num_generations": NUM_GENERATIONS,
            "max_completion_length": 4 if tiny else completion_tokens,
            **serving.get("trl", {}),
        },
    }


def take_device_memory(card_gib: float) -> object:
    """Allocate all but ``card_gib`` GiB of the device in one tensor: the run then sees a card of that size."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return torch.empty(int(total - card_gib * 2**30 - (total - free)), dtype=torch.uint8, device="cuda")


def grpo_args(
    kind: str,
    steps: int,
    tiny: bool,
    card_gib: float | None,
    micro_batch: int,
    learning_rate: float | None,
    device_total: int,
    completion_tokens: int = COMPLETION_TOKENS,
) -> GRPOConfig:
    """Stock TRL's settings for these runs (``ours*`` kinds take them too; ``user*`` kinds take the user's config).
    ``device_total``: the device's bytes (0 on a CPU)."""
    import torch
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    return GRPOConfig(
        output_dir=f"/tmp/sync_vs_trl/{kind}",
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=GENERATION_BATCH // micro_batch,
        num_generations=NUM_GENERATIONS,
        max_completion_length=4 if tiny else completion_tokens,
        learning_rate=1e-5 if learning_rate is None else learning_rate,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=cuda,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        # TRL's fraction is of the whole device: on a simulated card, the same fraction of the card.
        vllm_gpu_memory_utilization=(0.1 if tiny else 0.3) * (card_gib * 2**30 / device_total if card_gib else 1),
        vllm_max_model_length=32 if tiny else 512,
        seed=0,
    )


def peft_model(kind: str, model_path: str) -> torch.nn.Module:
    """The PEFT LoRA model that stock TRL and the ``ours*`` kinds train (merge-aware for ``ours-ma*``); for
    ``stock-4bit`` on the NF4 base that a QLoRA user loads, as ``load_in_4bit`` does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if kind == "stock-4bit":
        from transformers import BitsAndBytesConfig

        quantized = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, quantization_config=quantized)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(device)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if kind.startswith("ours-ma"):
        from colocate_grpo.lora import install_merge_aware

        install_merge_aware(model, "bf16")
    return model


class StepRecorder:
    """Times one run's engine calls and optimizer steps.

    ``current`` is the step in progress: ``<call>_s``, the seconds of each timed call (sync, sleep, wake, generate),
    ``<call>_device_gib``, the device's used memory after it, ``overhead_s``, the outermost calls but generate (a wake
    inside a sync counts once), ``push_s``, the pushes' device-timed seconds, and the parts that ``time_*`` add.
    ``steps`` are the finished steps. With ``train_seconds`` training stops after the first step that ends past that
    many seconds from ``train_start``.
    """

    def __init__(self, cuda: bool, train_seconds: float | None) -> None:
        self.cuda = cuda
        self.train_seconds = train_seconds
        self.train_start = math.nan
        self.current: dict = {}
        self.phases: list[str] = []  # the timed calls in progress, outermost first
        self.steps: list[dict] = []
        self.pushes: list = []  # CUDA events around ours' pushes (time_push_on_device)
        self.adapter_pushes: list = []

    def device_used_gib(self) -> float:
        import torch

        if not self.cuda:
            return 0.0
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def alloc_retries(self) -> int:
        import torch

        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else 0

    def timed(self, name: str, fn):  # noqa: ANN001, ANN202
        """``fn``, its seconds and the memory after it recorded under ``name``."""
        import torch

        current, phases = self.current, self.phases

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            # Calls made inside another (a wake inside a sync) are not synchronized: ours wakes the KV cache
            # while the device writes the weights, and waiting would undo that.
            outermost = not phases
            if self.cuda and outermost:
                torch.cuda.synchronize()
            start = time.perf_counter()
            phases.append(name)
            try:
                return fn(*a, **k)
            finally:
                phases.pop()
                if self.cuda and outermost:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                current[f"{name}_s"] = current.get(f"{name}_s", 0.0) + elapsed
                if name == "wake" and not outermost and (a[0] if a else k.get("tags")) == ["weights"]:
                    current["sync_wake_s"] = current.get("sync_wake_s", 0.0) + elapsed
                if outermost and name != "generate":  # a wake inside a sync counts once
                    current["overhead_s"] = current.get("overhead_s", 0.0) + elapsed
                current[f"{name}_device_gib"] = max(current.get(f"{name}_device_gib", 0.0), self.device_used_gib())

        return wrapper

    def add_push_s(self) -> None:
        """Move the pushes' device-timed seconds into ``current["push_s"]`` (the device synchronized); the
        adapter's writes also into ``current["adapter_push_s"]``."""
        for events, keys in ((self.pushes, ["push_s"]), (self.adapter_pushes, ["push_s", "adapter_push_s"])):
            for start, end in events:
                for key in keys:
                    self.current[key] = self.current.get(key, 0.0) + start.elapsed_time(end) / 1e3
            events.clear()

    def callback(self) -> TrainerCallback:
        """The trainer callback that starts and ends each step's record, and adds TRL's logged mismatch and entropy."""
        import torch
        from transformers import TrainerCallback

        recorder, current, steps = self, self.current, self.steps

        class Steps(TrainerCallback):
            def on_step_begin(self, *_, **__):  # noqa: ANN002, ANN003, ANN202
                current.clear()
                current["start"] = time.perf_counter()
                current["alloc_retries_before"] = recorder.alloc_retries()

            def on_step_end(self, args, state, control, **_):  # noqa: ANN001, ANN003, ANN202
                seconds = recorder.train_seconds
                if seconds is not None and time.perf_counter() - recorder.train_start > seconds:
                    control.should_training_stop = True
                if recorder.cuda:
                    torch.cuda.synchronize()
                current["step_s"] = time.perf_counter() - current.pop("start")
                current["alloc_retries"] = recorder.alloc_retries() - current.pop("alloc_retries_before")
                recorder.add_push_s()
                current["train_device_gib"] = recorder.device_used_gib()
                steps.append(dict(current))

            def on_log(self, args, state, control, logs=None, **_):  # noqa: ANN001, ANN003, ANN202
                if logs and "sampling/sampling_logp_difference/mean" in logs and steps:
                    steps[-1]["logp_diff"] = logs["sampling/sampling_logp_difference/mean"]
                if logs and "entropy" in logs and steps:
                    steps[-1]["entropy"] = logs["entropy"]

        return Steps()


def sync_again(generation: object, recorder: StepRecorder, count: int, level: int) -> list[dict]:
    """``count`` more syncs, each from an engine asleep at ``level`` (2: weights discarded, as in the loop; 1: kept);
    each sync's record."""
    executor = generation.llm.llm_engine.model_executor
    records = []
    for _ in range(count):
        asleep = sorted(getattr(executor, "sleeping_tags", ()))
        if asleep:  # vLLM ignores sleep() unless every tag is awake (and fails to wake an awake tag)
            generation.llm.wake_up(tags=asleep)
        generation.llm.sleep(level=level)
        recorder.current.clear()
        generation.sync_weights()
        recorder.add_push_s()
        records.append(dict(recorder.current))
    return records


def run_one(
    kind: str,
    model_path: str,
    steps: int,
    tiny: bool,
    card_gib: float | None = None,
    micro_batch: int = 64,
    repeat_syncs: int = 10,
    train_seconds: float | None = None,
    learning_rate: float | None = None,
    completion_tokens: int = COMPLETION_TOKENS,
) -> dict:
    """One training run in this process; returns its measurements. With ``train_seconds`` the run stops
    after the first step that ends past that many seconds of training; its results are of the steps run.
    ``learning_rate`` None: 1e-5, which the user's config leaves to the default."""

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from colocate_grpo.config import VLLMConfig
    from colocate_grpo.metrics import first_and_last_tenth
    from colocate_grpo.trainer import ColocateGRPOTrainer

    cuda = torch.cuda.is_available()
    device_total = torch.cuda.mem_get_info()[1] if cuda else 0
    taken = take_device_memory(card_gib) if card_gib else None  # noqa: F841 (held for the run)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_dict({"prompt": benchmark_prompts(model_path, PROMPTS)})
    args = grpo_args(kind, steps, tiny, card_gib, micro_batch, learning_rate, device_total, completion_tokens)
    if kind.endswith("-own"):  # what sharing the base weights saves, and costs
        import colocate_grpo.trainer as trainer_module

        trainer_module.share_base_weights = lambda model, engine: 0
    if kind in USER_SERVING:
        from colocate_grpo.train import build_trainer

        config = user_config(
            model_path,
            dataset["prompt"],
            steps,
            tiny,
            Path(f"/tmp/sync_vs_trl/{kind}"),
            kind,
            micro_batch,
            completion_tokens,
        )
        if learning_rate is not None:
            config["learning_rate"] = learning_rate
        trainer = build_trainer(config)
        model = trainer.model
    else:
        model = peft_model(kind, model_path)
    # The floor's two copies of the weights would not fit beside the run on a simulated card.
    floor_s = copy_floor_s(model) if cuda and not card_gib and not kind.endswith("4bit") else float("nan")
    base_before = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if "lora_" not in n}
    common = dict(
        model=model, reward_funcs=[half_vocabulary_reward], args=args, train_dataset=dataset, processing_class=tokenizer
    )
    if kind.startswith("stock"):
        trainer = GRPOTrainer(**common)
    elif kind not in USER_SERVING:
        # CUDA graphs on, as stock TRL's engine has them.
        options = VLLMConfig(
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_length,
            enforce_eager=False,
            kv_cache="memory_fraction" if kind.endswith("-fraction") else "batch",
        )
        trainer = ColocateGRPOTrainer(**common, vllm_options=options, serve_adapter=kind.startswith("ours-adapter"))

    print(STARTED, flush=True)  # the engine has started: see run_children_together

    recorder = StepRecorder(cuda, train_seconds)
    if cuda:
        time_sleep_mode_parts(recorder.phases, recorder.current)
    time_gc_pauses(recorder.phases, recorder.current)
    if not kind.startswith("stock"):
        time_sync_parts(recorder.phases, recorder.current)
        if cuda:
            time_push_on_device(recorder.pushes)
            time_push_on_device(recorder.pushes, "merge_into_shared_base")
            time_push_on_device(recorder.adapter_pushes, "push_adapter")
    generation = trainer.vllm_generation
    generation.sync_weights = recorder.timed("sync", generation.sync_weights)
    llm = generation.llm
    llm.sleep = recorder.timed("sleep", llm.sleep)
    llm.wake_up = recorder.timed("wake", llm.wake_up)
    llm.generate = recorder.timed("generate", llm.generate)
    trainer.add_callback(recorder.callback())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    recorder.train_start = time.perf_counter()
    trainer.train()
    drift = [
        (p.detach().cpu().float() - base_before[n].float()).abs()
        for n, p in model.named_parameters()
        if "lora_" not in n
    ]
    step_log = recorder.steps
    measured = step_log[WARMUP_STEPS:] or step_log
    # More syncs from the same state the loop syncs from: asleep at level 2, weights discarded.
    repeated = sync_again(generation, recorder, repeat_syncs, level=2)
    serve_adapter = getattr(generation, "serve_adapter", False)
    # The adapter's push when the engine kept its base weights (a level-1 sleep): the adapter alone.
    repeated_adapter = sync_again(generation, recorder, repeat_syncs, level=1) if cuda and serve_adapter else []

    def median(key: str) -> float:
        values = [s.get(key, 0.0) for s in measured]
        return statistics.median(values) if values else float("nan")

    overhead = [s.get("overhead_s", 0.0) / s["step_s"] for s in measured]
    parts = sorted({k for s in measured for k in s if "." in k})
    peaks = {
        phase: max(s.get(f"{phase}_device_gib", 0.0) for s in step_log)
        for phase in ("sync", "wake", "generate", "sleep", "train")
    }
    return {
        "parts_s": {k: median(k) for k in parts},
        "pool": pool_layout() if cuda else {},
        "kind": kind,
        "steps": step_log,
        "step_s": median("step_s"),
        "sync_s": median("sync_s"),
        "loop_push_s": statistics.median(push_s(s) for s in measured),
        "repeat_sync_s": statistics.median(r["sync_s"] for r in repeated),
        "repeat_push_s": statistics.median(push_s(r) for r in repeated),
        "adapter_push_s": median("adapter_push_s") if serve_adapter else float("nan"),
        "repeat_adapter_push_s": (
            statistics.median(r.get("adapter_push_s", float("nan")) for r in repeated_adapter)
            if repeated_adapter
            else float("nan")
        ),
        "copy_floor_s": floor_s,
        "overhead_share": statistics.median(overhead),
        "peak_device_gib": peaks,
        # Of a simulated card: the device's used memory counts the allocation that simulates it.
        "card_used_gib": max(peaks.values()) - (device_total / 2**30 - card_gib) if card_gib else None,
        "trainer_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "logp_diff": statistics.mean(s["logp_diff"] for s in step_log if "logp_diff" in s),
        # The policy's mean entropy (nats): how sharp its next-token distributions are (see build_model).
        "entropy": statistics.mean([s["entropy"] for s in step_log if "entropy" in s] or [float("nan")]),
        # Whether the mismatch grows as training moves the weights (the run summary's test: by more than 10%).
        "logp_diff_tenths": first_and_last_tenth([s["logp_diff"] for s in step_log if "logp_diff" in s]),
        # 0 when no step trained (a reward without spread in any group): every other number is then of a
        # run whose weights never moved.
        "lora_b_max": max(
            (float(p.detach().abs().max()) for n, p in model.named_parameters() if "lora_B" in n), default=0.0
        ),
        # torch's allocator freed its cache and tried again (a device-wide synchronization each time): a step
        # slower than its kernels with no other cause. Summed over the measured steps.
        "alloc_retries": sum(s.get("alloc_retries", 0) for s in measured),
        "base_drift_max": max(float(d.max()) for d in drift),
        "base_drift_fraction": sum(int((d > 0).sum()) for d in drift) / sum(d.numel() for d in drift),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["1.5B", "7B"], help="1.5B, 7B, either with -sharp, or tiny (CPU check)"
    )
    parser.add_argument("--kinds", nargs="+", default=["stock", "user", "ours", "ours-ma", "ours-ma-fraction"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="sync_vs_trl.json")
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    parser.add_argument("--card-gib", type=float, help="take all but this many GiB of the device before each run")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=GENERATION_BATCH,
        help=f"sequences per forward and backward; the {GENERATION_BATCH} generated a step are trained in "
        "generation_batch / micro_batch accumulation steps",
    )
    parser.add_argument(
        "--repeat-syncs",
        type=int,
        default=10,
        help="syncs timed again after training (stock TRL's merge into a 4-bit 7B base takes seconds each)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run a shape's kinds side by side on the device (for the mismatch over a long run, not for times)",
    )
    parser.add_argument(
        "--train-seconds",
        type=float,
        help="stop each run's training after the step that passes this many seconds (to end within a time limit); "
        "the results are of the steps it ran",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        help="instead of 1e-5; one too small to move the weights (1e-12) is a control for the mismatch over a "
        "long run: what the engine's cycles and the prompts do to it without training",
    )
    parser.add_argument(
        "--completion-tokens",
        type=int,
        default=COMPLETION_TOKENS,
        help="the most tokens a completion may have (the tiny model: 4); fewer for more steps within a time "
        "limit, as in the mismatch over a long run",
    )
    parser.add_argument("--child", nargs=3, metavar=("KIND", "MODEL_PATH", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TRL_TELEMETRY", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.child:
        kind, model_path, out = args.child
        result = run_one(
            kind,
            model_path,
            args.steps,
            "tiny" in model_path,
            card_gib=args.card_gib,
            micro_batch=args.micro_batch,
            repeat_syncs=args.repeat_syncs,
            train_seconds=args.train_seconds,
            learning_rate=args.learning_rate,
            completion_tokens=args.completion_tokens,
        )
        Path(out).write_text(json.dumps(result))
        return

    if args.repeat_syncs < 1:
        parser.error("--repeat-syncs: at least 1 (the sync's time is their median)")
    if args.together and args.card_gib:
        parser.error("--together shares the device between the runs: it cannot also simulate a card (--card-gib)")
    results = []
    Path(args.models).mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        model_path = build_model(shape, Path(args.models) / shape)
        outs = {kind: Path(args.models) / f"{shape}-{kind}.json" for kind in args.kinds}
        commands = {}
        for kind, out in outs.items():
            out.unlink(missing_ok=True)
            command = [sys.executable, __file__, "--steps", str(args.steps), "--child", kind, model_path, str(out)]
            if args.card_gib:
                command += ["--card-gib", str(args.card_gib)]
            command += ["--micro-batch", str(args.micro_batch), "--repeat-syncs", str(args.repeat_syncs)]
            command += ["--completion-tokens", str(args.completion_tokens)]
            if args.train_seconds is not None:
                command += ["--train-seconds", str(args.train_seconds)]
            if args.learning_rate is not None:
                command += ["--learning-rate", str(args.learning_rate)]
            commands[kind] = command
        if args.together:
            for kind, (returncode, tail) in run_children_together(commands, Path(args.models)).items():
                record(results, shape, kind, returncode, tail, outs[kind], args.out)
        else:
            for kind, command in commands.items():
                record(results, shape, kind, *run_child(command), outs[kind], args.out)

    print(table(results))
    if args.together:
        print("\nThe runs shared the device (--together): their times and memory are not a run's alone.")


def record(results: list[dict], shape: str, kind: str, returncode: int, tail: str, out: Path, path: str) -> None:
    """Add one run's result (or its failure) to ``results`` and write them all to ``path``."""
    if returncode != 0 or not out.exists():
        print(f"{shape} {kind}: failed (exit {returncode})\n{tail}", file=sys.stderr)
        results.append({"shape": shape, "kind": kind, "failed": tail})
    else:
        results.append({"shape": shape, **json.loads(out.read_text())})
        print(table(results[-1:]).splitlines()[2], flush=True)
    Path(path).write_text(json.dumps(results, indent=1))  # after each run: a later one may not finish


def run_children_together(commands: dict[str, list[str]], logs: Path) -> dict[str, tuple[int, str]]:
    """Run the measured processes side by side on one device, for what does not depend on time (the logprob
    mismatch over a long run). Each starts once the one before it has started its engine: stock TRL's vLLM
    measures the device's free memory while it starts, and a neighbour's allocations would move it. Their
    output goes to ``logs``/<kind>.log (stock TRL's runs start first); returns each one's exit code and the
    last 3,000 characters of its log."""
    children = {}
    for kind, command in sorted(commands.items(), key=lambda item: not item[0].startswith("stock")):
        log = logs / f"{kind}.log"
        with log.open("w") as sink:
            child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        children[kind] = (child, log)
        while child.poll() is None and STARTED not in log.read_text(errors="replace"):
            time.sleep(1)
        print(f"{kind}: started", file=sys.stderr, flush=True)
    ended = {}
    for kind, (child, log) in children.items():
        child.wait()
        ended[kind] = (child.returncode, log.read_text(errors="replace")[-3000:])
    return ended


def run_child(command: list[str]) -> tuple[int, str]:
    """Run one measured process with its output passed on to stderr as it comes (a run stopped by a time
    limit still shows how far it got); returns its exit code and the last 3,000 characters of its output."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:
            sys.stderr.write(line)
            tail.append(line)
    return child.returncode, "".join(tail)[-3000:]


RATIO_KEYS = [
    "step_s",
    "sync_s",
    "loop_push_s",
    "repeat_sync_s",
    "repeat_push_s",
    "overhead_share",
    "trainer_peak_allocated_gib",
    "logp_diff",
]


def mismatch_by_tenth(values: list[float]) -> str:
    """The mismatch's mean in each tenth of a run, and how far a tenth's mean moves by chance (its standard
    error, from the steps' spread within the tenths): a rise at the start, a steady growth and noise look
    alike in the first and last tenth alone."""
    n = len(values) // 10
    if n < 2:
        return "by tenth: too few steps"
    tenths = [values[i * n : (i + 1) * n] for i in range(10)]
    means = " ".join(f"{statistics.mean(tenth):.5f}" for tenth in tenths)
    error = math.sqrt(statistics.mean(statistics.variance(tenth) for tenth in tenths) / n)
    return f"by tenth: {means} (a tenth's standard error {error:.5f})"


def mismatch_by_pass(values: list[float]) -> str:
    """The mismatch's mean in each pass over the prompts: a step's mismatch depends on the prompts it draws
    (runs of the same seed agree step by step), so two passes compare the same prompts where two tenths
    of a run do not."""
    passes = [values[i : i + STEPS_PER_PASS] for i in range(0, len(values) - STEPS_PER_PASS + 1, STEPS_PER_PASS)]
    if len(passes) < 2:
        return "by pass over the prompts: fewer than two passes"
    means = [statistics.mean(p) for p in passes]
    shown = " ".join(f"{m:.5f}" for m in means)
    return f"by pass over the prompts ({STEPS_PER_PASS} steps each): {shown} (last / first {means[-1] / means[0]:.3g}x)"


def table(results: list[dict]) -> str:
    """A Markdown table of the runs, then each of ours against stock TRL as ratios."""
    keys = [*RATIO_KEYS, "copy_floor_s", "entropy", "lora_b_max", "base_drift_max", "alloc_retries"]
    lines = ["| shape | kind | " + " | ".join(keys) + " | peak device GiB by phase |", "|---" * (len(keys) + 3) + "|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['shape']} | {r['kind']} | failed |")
            continue
        peaks = " ".join(f"{p}={v:.1f}" for p, v in r["peak_device_gib"].items())
        values = " | ".join(f"{r.get(k, math.nan):.4g}" for k in keys)  # older results lack the newer keys
        lines.append(f"| {r['shape']} | {r['kind']} | {values} | {peaks} |")
    lines.append("")
    for r in results:
        if r.get("logp_diff_tenths"):
            first, last = r["logp_diff_tenths"]
            trend = "grew" if last > 1.1 * first else "did not grow"
            lines.append(
                f"{r['shape']} {r['kind']}: logp diff first tenth {first:.5f}, last tenth {last:.5f} over "
                f"{len(r['steps'])} steps ({trend} by more than 10%)"
            )
            mismatch = [s["logp_diff"] for s in r["steps"] if "logp_diff" in s]
            lines += [f"  {mismatch_by_tenth(mismatch)}", f"  {mismatch_by_pass(mismatch)}"]
    for r in results:
        if r.get("parts_s"):
            parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["parts_s"].items())
            lines.append(f"{r['shape']} {r['kind']} ms per step: {parts}; vLLM pool [count, GiB]: {r['pool']}")
    lines.append("")
    for shape in dict.fromkeys(r["shape"] for r in results):
        runs = {r["kind"]: r for r in results if r["shape"] == shape and "failed" not in r}
        stock = runs.get("stock")
        for kind, ours in runs.items():
            if kind.startswith("stock"):
                continue
            floor = (
                f"sync / copy floor {ours['repeat_sync_s'] / ours['copy_floor_s']:.3g}x, "
                f"push / copy floor {ours['repeat_push_s'] / ours['copy_floor_s']:.3g}x "
                f"(in the loop {ours['loop_push_s'] / ours['copy_floor_s']:.3g}x)"
            )
            if stock is None:
                lines.append(f"{shape} {kind}: {floor}")
                continue
            ratios = ", ".join(f"{k} {ours[k] / stock[k]:.3g}x" for k in RATIO_KEYS if stock[k])
            peak = max(ours["peak_device_gib"].values()) / max(stock["peak_device_gib"].values())
            lines.append(f"{shape} {kind} / stock: {ratios}, peak device {peak:.3g}x; {floor}")
            if ours.get("adapter_push_s", float("nan")) == ours.get("adapter_push_s"):  # not NaN: adapter served
                line = (
                    f"{shape} {kind}: adapter push {1e3 * ours['adapter_push_s']:.3f} ms in the loop (the base lost "
                    f"at each level-2 sleep is pushed besides), {1e3 * ours['repeat_adapter_push_s']:.3f} ms with "
                    f"the base kept (level-1 sleeps)"
                )
                merged = runs.get("ours")
                if merged:
                    ratio = merged["repeat_push_s"] / ours["repeat_adapter_push_s"]
                    line += f", merged push / adapter push {ratio:.3g}x"
                lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
