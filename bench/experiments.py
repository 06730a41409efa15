"""The named experiments of the harness: each a small config that ``run.py`` runs.

An experiment has a runner (``training``: each kind's training run, one process each; ``frontier``: the
smallest simulated card each kind runs on; ``kernel``: a microbenchmark in one process), the shapes and kinds
it covers, and its settings. ``check`` holds what its CPU check changes (the tiny shape, few steps), or None
where the experiment needs a GPU; ``slow_check`` marks a check the test suite runs only with its slow tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from workload import COMPLETION_TOKENS, GENERATION_BATCH, PROMPT_TOKENS, REWARD


@dataclass(frozen=True)
class Experiment:
    """One named experiment.

    ``steps``: optimizer steps a training run takes; ``micro_batch``: sequences per forward and backward (of the
    ``generation_batch`` a step generates: 64, 8 prompts of 8, unless set); ``card_gib``: a simulated card's GiB
    (None: the whole device); ``cards``: the simulated cards a frontier searches, in GiB; ``ranks``: the GPU
    counts of a data-parallel experiment (one run each); ``together``: run the kinds side by side on the device
    (for what does not depend on time, such as the mismatch over a long run); ``completion_lengths``: a frontier
    over completion lengths (the longest that runs on ``card_gib``) instead of over ``cards``; ``profile_step``:
    the step whose CUDA kernels the profiler records in each training run (its busy time by stream, and the time
    kernels of two streams ran at once); ``reward``: the reward function's name in ``workload``.
    """

    name: str
    runner: str
    description: str
    shapes: tuple[str, ...] = ("1.5B",)
    kinds: tuple[str, ...] = ("stock", "user")
    steps: int = 6
    micro_batch: int = GENERATION_BATCH
    generation_batch: int = GENERATION_BATCH
    completion_tokens: int = COMPLETION_TOKENS
    card_gib: float | None = None
    cards: tuple[float, ...] = ()
    ranks: tuple[int, ...] = (1,)
    together: bool = False
    learning_rate: float | None = None
    completion_lengths: tuple[int, ...] = ()
    profile_step: int | None = None
    reward: str = REWARD
    check: dict[str, Any] | None = field(default=None, compare=False)
    slow_check: bool = True

    def checked(self) -> Experiment:
        """This experiment as its CPU check runs it."""
        if self.check is None:
            raise ValueError(f"{self.name} has no CPU check: it needs a GPU")
        return replace(self, **self.check)


TINY = {"shapes": ("tiny",), "steps": 2}

EXPERIMENTS = {
    e.name: e
    for e in [
        Experiment(
            "step-vs-trl",
            "training",
            "The user's plain config against stock TRL at 1.5B, one after the other: step, phases, memory, mismatch",
            check={**TINY, "kinds": ("user",)},
        ),
        Experiment(
            "step-vs-trl-7B",
            "training",
            "The same at 7B with micro-batch 8 (stock TRL's activations at micro-batch 64 do not fit beside it)",
            shapes=("7B",),
            micro_batch=8,
        ),
        Experiment(
            "step-vs-unsloth",
            "training",
            "Unsloth as its GRPO notebooks run it (bf16 and 4-bit bases) against the user's config and stock TRL",
            shapes=("1.5B", "7B"),
            kinds=("unsloth", "unsloth-4bit", "user", "user-4bit", "stock"),
            # No CPU check: Unsloth needs an accelerator.
        ),
        Experiment(
            "serving-ways",
            "training",
            "Each way of serving the policy a user picks by one key, and colocate_grpo on stock's PEFT model",
            kinds=("user", "user-merged", "user-adapter", "user-4bit", "ours", "ours-ma", "ours-adapter"),
            check={**TINY, "kinds": ("ours-ma", "user-adapter")},
        ),
        Experiment(
            "fp32-head",
            "training",
            "The fp32 head on both sides against the bf16 head, on a 1.5B with sharp (trained-like) logits",
            shapes=("1.5B-sharp",),
            kinds=("user", "user-fp32-head"),
            steps=4,
        ),
        Experiment(
            "training-options",
            "training",
            "The training phase: the user's defaults, each option off (grouping by length, gradient checkpointing, "
            "the fused AdamW), and Liger's kernels on, on completions of varied length: train phase, model FLOPs, MFU, "
            "padding",
            shapes=("1.5B-stops", "7B-stops"),
            kinds=("user", "user-no-grouping", "user-checkpointing", "user-adamw-unfused", "user-liger"),
            micro_batch=8,  # the user's default micro-batch: 8 of them make a step's 64 completions
            steps=8,
            check={**TINY, "kinds": ("user", "user-no-grouping")},
        ),
        Experiment(
            "bitwise",
            "training",
            "trl.vllm_bitwise_logprobs against the user's config over 20 steps at Qwen2.5 1.5B, Qwen3 1.7B and "
            "Qwen2.5 7B: the mode's price in step time and memory, and the share of sampled tokens whose logprobs "
            "vLLM and the trainer compute bit for bit",
            shapes=("1.5B", "1.7B", "7B"),
            kinds=("user", "user-bitwise"),
            steps=20,
            profile_step=5,  # where each kind's step spends the device's time, kernel by kernel
            # No CPU check: the mode needs CUDA (refused on a CPU).
        ),
        Experiment(
            "async",
            "training",
            "async_generation: true against the sequential mode, with the user's defaults (the merged weights served) "
            "and with the adapter served as the async mode serves it: step, phases, overlap, staleness",
            shapes=("1.5B", "7B"),
            kinds=("user", "user-adapter", "user-async"),
            profile_step=5,  # one measured step (after two warm-up steps and an async run's first two)
            check={**TINY, "steps": 3, "kinds": ("user-async",)},
        ),
        Experiment(
            "learning-curve",
            "training",
            "The training reward over 200 steps at 1.5B: the user's config, the same with another seed (the "
            "run-to-run spread), the bitwise mode and the async mode, side by side on the device (not for times), "
            "on a reward a policy learns (completions that end within 32 tokens, of a model whose completions end)",
            shapes=("1.5B-stops",),
            kinds=("user", "user-seed1", "user-bitwise", "user-async"),
            steps=200,
            completion_tokens=64,
            reward="brevity_reward",
            # Side by side, each plans on the memory free when it starts, before the others train: micro-batches of
            # 16 keep every run's activations small (the same 64 sequences a step, in four micro-batches).
            micro_batch=16,
            # Up to about 17 minutes on an H100 with the four: their engines start one after another (about 100 s each)
            # and the bitwise run's steps take 3.1 s beside the others. Where a call is shorter, run it in parts
            # (--kinds) into one folder, each with --time-limit.
            together=True,
            # On a small random model of the -stops kind (CPU, 60 steps) brevity_reward rose from 0.28 to about 0.47
            # at 3e-5, went to 1.0 within 10 steps at 1e-4, and barely moved at 1e-5.
            learning_rate=3e-5,
        ),
        Experiment(
            "allocator",
            "training",
            "The user's config with torch's expandable segments against without, on the whole card: the allocator's "
            "reserved against allocated peak by phase, its retries, the step (at 1.5B a run reserved up to 78.9 GiB "
            "in training for 52 GiB of tensors, and retried)",
            shapes=("1.5B", "7B"),
            kinds=("user", "user-expandable"),
            steps=6,
            # No CPU check: the setting is CUDA's allocator's.
        ),
        Experiment(
            "published-32B",
            "training",
            "Unsloth's published frontier, the 16-bit LoRA: a Qwen3-32B shape at 6,144 tokens of context on an 80 GB "
            "H100, with the user's config and one prompt of 8 completions a step (the model takes 65 GB of disk)",
            shapes=("32B",),
            kinds=("user",),
            # One step, the point being that it runs: 8 completions of 6,112 tokens decode for minutes at 32B.
            steps=1,
            micro_batch=8,
            generation_batch=8,
            completion_tokens=6144 - PROMPT_TOKENS,
            # No CPU check: the shape is the point, and it needs an 80 GB GPU.
        ),
        Experiment(
            "published-8B-4bit",
            "training",
            "Unsloth's published frontier, the 4-bit base: a Llama 3.1 8B shape at 47,500 tokens of context on an "
            "80 GB H100, with load_in_4bit: true and one prompt of 8 completions a step",
            shapes=("Llama8B",),
            kinds=("user-4bit",),
            steps=1,  # 47,468 decode steps: about 5 minutes on an H100
            micro_batch=8,
            generation_batch=8,
            completion_tokens=47500 - PROMPT_TOKENS,
        ),
        Experiment(
            "stock-4bit",
            "training",
            "Stock TRL on an NF4 base against the user's load_in_4bit: true",
            kinds=("stock-4bit", "user-4bit"),
        ),
        Experiment(
            "mismatch-long",
            "training",
            "The logprob mismatch over 200 training steps, four kinds side by side on the device (not for times)",
            kinds=("stock", "user", "user-merged", "user-adapter"),
            steps=200,
            completion_tokens=64,
            micro_batch=16,  # as learning-curve's: small activations beside each other
            together=True,
            check={**TINY, "kinds": ("user", "user-adapter")},
        ),
        Experiment(
            "memory-growth",
            "training",
            "Host and device memory after every step of 200 steps of the user's config on the tiny model",
            shapes=("tiny",),
            kinds=("user",),
            steps=200,
            # No CPU check of its own: step-vs-trl's is the same kind on the same model.
        ),
        Experiment(
            "data-parallel",
            "training",
            "The user's config on 1, 2 and 4 GPUs of one host (torchrun, one engine per GPU): samples a second",
            kinds=("user",),
            steps=8,
            ranks=(1, 2, 4),
            check={**TINY, "steps": 3, "ranks": (1,)},
        ),
        Experiment(
            "memory-frontier",
            "frontier",
            "The smallest simulated card each way of serving runs on, 1.5B to 14B, micro-batch 8; stock TRL's too",
            shapes=("1.5B", "3B", "7B", "14B"),
            kinds=("user", "user-merged", "user-adapter", "user-4bit", "stock"),
            steps=3,
            micro_batch=8,
            cards=(12, 16, 24, 40, 80),
            # The CPU check prints the memory plan's side of the search: no training.
            check={"kinds": ("user", "user-merged", "user-adapter", "user-4bit")},
        ),
        Experiment(
            "frontier-vs-unsloth",
            "frontier",
            "The smallest simulated card each tool runs each shape on with its own defaults, 64 sequences a step: "
            "the user's config (the plan picks the micro-batches), Unsloth (gpu_memory_utilization 0.9 of the card) "
            "and stock TRL",
            shapes=("1.5B", "7B"),
            kinds=("user", "unsloth", "stock"),
            steps=3,
            cards=(6, 8, 12, 16, 20, 24, 40),  # Unsloth trains a 1.5B in "about 5 GB" (its GRPO blog post)
            check={"kinds": ("user",)},
            slow_check=False,
        ),
        Experiment(
            "completion-frontier",
            "frontier",
            "The longest completion each tool trains at 1.5B on a simulated 24 GiB card, 64 sequences a step",
            shapes=("1.5B",),
            kinds=("user", "unsloth", "stock"),
            steps=3,
            card_gib=24,
            completion_lengths=(1024, 2048, 4096, 8192, 16384, 32000),
            check={"kinds": ("user",)},
        ),
        Experiment(
            "completion-frontier-7B",
            "frontier",
            "The longest completion each tool trains at 7B on a simulated 40 GiB card, 64 sequences a step",
            shapes=("7B",),
            kinds=("user", "unsloth", "stock"),
            steps=3,
            card_gib=40,
            completion_lengths=(1024, 2048, 4096, 8192, 16384, 32000),
            check={"kinds": ("user",)},
        ),
        Experiment(
            "lora-speed",
            "kernel",
            "Forward + backward of merge-aware LoRA against PEFT's LoRA: layers, a 1.5B-shaped model; the fused merge",
            shapes=("1.5B", "7B"),
            kinds=(),
            check={"shapes": ("tiny",)},
        ),
        Experiment(
            "merge-in-place",
            "kernel",
            "Merging a LoRA into the shared base in place with its restore record against a copy, the bitwise restore",
            shapes=("1.5B", "7B"),
            kinds=(),
            check={"shapes": ("tiny",)},
            slow_check=False,
        ),
        Experiment(
            "sync-kernels",
            "kernel",
            "The sync's kernels in a CUDA graph: the fused merge, the frozen tensors' copy, the adapter's write",
            shapes=("1.5B", "7B"),
            kinds=(),
        ),
        Experiment(
            "fp32-head-speed",
            "kernel",
            "TRL's fused head forward + backward: bf16, IEEE fp32, fp32 on TF32 cores (ours); logprob error",
            shapes=("1.5B", "7B"),
            kinds=(),
            check={"shapes": ("tiny",)},
        ),
        Experiment(
            "training-step",
            "kernel",
            "One micro-batch's forward + backward as TRL computes it, by micro-batch and gradient checkpointing: "
            "memory against the memory plan's estimate, seconds, model FLOPs utilization",
            shapes=("1.5B", "7B"),
            kinds=(),
            check={"shapes": ("tiny",)},
            slow_check=False,
        ),
        Experiment(
            "generate-speed",
            "kernel",
            "The generation batch from a run's engine against its bandwidth floor; the device's busy share; with and "
            "without log-probabilities, and at half the batch",
            shapes=("1.5B", "7B"),
            kinds=(),
            check={"shapes": ("tiny",)},
        ),
    ]
}
