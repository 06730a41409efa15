"""The trainers a training experiment compares ("kinds"), and one measured run of a kind in this process.

Every kind runs in a process of its own (vLLM allows one sleep-mode engine per process), started by
``run.py`` as ``python bench/run.py --child SPEC.json`` with the kind's ``env`` added to the environment
(and under ``torchrun`` for several ranks). A kind is a :class:`Kind` in ``KINDS``: a name, what it is, and
``build``, which returns the trainer and the engine object whose ``sleep``, ``wake_up`` and ``generate`` the
run times. A kind that needs another installation (its own packages on ``PYTHONPATH``) says so in ``env``;
its ``build`` imports them, in its own process.

Kinds:

- ``stock``: TRL's ``GRPOTrainer`` in colocate mode with PEFT LoRA r=16 on all linears (TRL's engine settings:
  memory fraction 0.3, max model length 512); ``stock-4bit`` the same on the NF4 base a QLoRA user loads.
- ``user``: colocate_grpo as a user runs it, ``build_trainer`` with the plain config (model, dataset, reward,
  batch keys, nothing else); ``user-merged``, ``user-adapter``, ``user-4bit``, ``user-fp32-head`` add the one
  key that serves the policy another way or computes the logits in fp32, and ``user-no-grouping``,
  ``user-checkpointing``, ``user-adamw-unfused`` the one that turns a training option off, ``user-liger`` the one that
  patches Liger's RMSNorm, SwiGLU and RoPE kernels into the trainer's model (``USER_KEYS``); ``user-expandable`` is
  the user's config in a process whose torch allocator has expandable segments on.
- ``ours``, ``ours-ma``, ``ours-adapter``: ``ColocateGRPOTrainer`` with stock's PEFT model and TRL arguments:
  ordinary LoRA merged, merge-aware LoRA, and the adapter served by vLLM's LoRA kernels.
- ``unsloth``, ``unsloth-4bit``: Unsloth's patched ``GRPOTrainer`` as its GRPO notebooks run it (fast inference,
  its own vLLM engine sharing the weights, standby on), on the bf16 base or on the 4-bit base it quantizes at load;
  GPU only, in a process whose ``PYTHONPATH`` starts with ``$UNSLOTH_SITE`` when that is set.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import workload
from workload import (
    COMPLETION_TOKENS,
    GENERATION_BATCH,
    NUM_GENERATIONS,
    PROMPT_TOKENS,
    REWARD,
    STEPS_PER_PASS,
    benchmark_prompts,
    layer_linears,
    user_config,
)

if TYPE_CHECKING:
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig

WARMUP_STEPS = 2  # steps left out of the medians: the first compiles and allocates
GIB = 2**30
PHASES = ("sync", "wake", "generate", "sleep")
ENGINE_STARTED = "bench: engine started"  # printed once the trainer is built (run.py's --together waits for it)
RUN_DIR = "run"  # a run's output_dir in its work folder; colocate_grpo writes its metrics.jsonl there
MAX_MODEL_LENGTH = 512  # stock TRL's engine's, as its colocate mode has it; Unsloth's max_seq_length the same


@dataclass(frozen=True)
class RunSpec:
    """One measured run of one kind, as ``run.py`` hands it to the kind's process.

    ``card_gib``: simulate a card of that many GiB (all but that much of the device taken before the run);
    ``stop_at``: stop after the first step that ends past this time (``time.time()``; run.py's ``--time-limit``);
    ``learning_rate`` None: 1e-5 (the user's config leaves it to the default, also 1e-5); ``profile_step``: the
    step (from 1) whose CUDA kernels the profiler records, for :func:`kernel_overlap` (None: no profile);
    ``reward``: the reward function's name in ``workload``; ``generation_batch``: sequences a step
    (``NUM_GENERATIONS`` a prompt).
    """

    experiment: str
    kind: str
    shape: str
    model_path: str
    workdir: str
    steps: int
    micro_batch: int = GENERATION_BATCH
    generation_batch: int = GENERATION_BATCH
    completion_tokens: int = COMPLETION_TOKENS
    card_gib: float | None = None
    learning_rate: float | None = None
    stop_at: float | None = None
    ranks: int = 1
    profile_step: int | None = None
    reward: str = REWARD

    @property
    def tiny(self) -> bool:
        return self.shape == "tiny"


@dataclass(frozen=True)
class Kind:
    """A trainer to measure. ``build(spec)`` runs in the kind's own process and returns the trainer and the
    object holding the engine's ``sleep``, ``wake_up`` and ``generate``; ``env`` is added to that process's
    environment (a separate installation's ``PYTHONPATH``, say)."""

    name: str
    description: str
    build: Callable[[RunSpec], tuple[Any, Any]]
    env: Mapping[str, str] = field(default_factory=dict)


# The one key a user adds to the plain config for each user-* kind.
USER_KEYS: dict[str, dict[str, Any]] = {
    "user": {},
    "user-merged": {"lora_merge_aware": None},
    "user-adapter": {"trl": {"vllm_lora_sync": True}},
    "user-4bit": {"load_in_4bit": True},
    "user-fp32-head": {"trl": {"cast_lm_head_to_fp32": True}},
    "user-no-grouping": {"group_by_length": False},
    "user-checkpointing": {"gradient_checkpointing": True},
    "user-adamw-unfused": {"trl": {"optim": "adamw_torch"}},
    "user-liger": {"trl": {"use_liger_kernel": True}},
    "user-bitwise": {"trl": {"vllm_bitwise_logprobs": True}},
    "user-async": {"async_generation": True},
    "user-seed1": {"seed": 1},
    "user-expandable": {},  # the config as it is; the kind's environment changes torch's allocator
}


def build_user(spec: RunSpec) -> tuple[Any, Any]:
    """colocate_grpo through the user's path: ``build_trainer`` with the plain config (and the kind's one key)."""
    from colocate_grpo.train import build_trainer

    config = user_config(
        spec.model_path,
        Path(spec.workdir),
        spec.steps,
        spec.micro_batch,
        spec.completion_tokens,
        USER_KEYS[spec.kind],
        reward=spec.reward,
        generation_batch=spec.generation_batch,
    )
    if spec.learning_rate is not None:
        config["learning_rate"] = spec.learning_rate
    trainer = build_trainer(config)
    return trainer, trainer.engine


def batch_args(spec: RunSpec) -> dict[str, Any]:
    """The ``GRPOConfig`` keys every TRL-based kind shares: the batch, the learning rate, the steps, logging."""
    return dict(
        output_dir=str(Path(spec.workdir) / RUN_DIR),
        per_device_train_batch_size=spec.micro_batch,
        gradient_accumulation_steps=spec.generation_batch // spec.micro_batch,
        num_generations=NUM_GENERATIONS,
        max_completion_length=spec.completion_tokens,
        learning_rate=1e-5 if spec.learning_rate is None else spec.learning_rate,
        max_steps=spec.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )


def model_length(spec: RunSpec) -> int:
    """Stock TRL's and Unsloth's engine length: ``MAX_MODEL_LENGTH``, or a prompt and the completion where that is
    longer (the completion frontier), as a user of either sets it."""
    return max(MAX_MODEL_LENGTH, PROMPT_TOKENS + spec.completion_tokens)


def card_share(spec: RunSpec) -> float:
    """The share of the device a simulated card is (1 on the whole device): an engine's memory fraction is of the
    whole device, so on a simulated card it is scaled by this."""
    import torch

    return spec.card_gib * GIB / torch.cuda.mem_get_info()[1] if torch.cuda.is_available() and spec.card_gib else 1.0


def grpo_args(spec: RunSpec) -> GRPOConfig:
    """Stock TRL's settings for these runs (the ``ours*`` kinds take them too)."""
    import torch
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    return GRPOConfig(
        **batch_args(spec),
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=cuda,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=(0.1 if spec.tiny else 0.3) * card_share(spec),
        vllm_max_model_length=32 if spec.tiny else model_length(spec),
    )


def peft_model(spec: RunSpec) -> torch.nn.Module:
    """The PEFT LoRA model that stock TRL and the ``ours*`` kinds train (merge-aware for ``ours-ma``); for
    ``stock-4bit`` on the NF4 base that a QLoRA user loads, as ``load_in_4bit`` does."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if spec.kind == "stock-4bit":
        from transformers import BitsAndBytesConfig

        quantized = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            spec.model_path, dtype=torch.bfloat16, quantization_config=quantized
        )
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.bfloat16).to(device)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    if spec.kind == "ours-ma":
        from colocate_grpo.lora import install_merge_aware

        install_merge_aware(model, "bf16")
    return model


def trainer_inputs(spec: RunSpec) -> dict[str, Any]:
    """The keyword arguments stock TRL's trainer and ``ColocateGRPOTrainer`` share."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    return dict(
        model=peft_model(spec),
        reward_funcs=[getattr(workload, spec.reward)],
        args=grpo_args(spec),
        train_dataset=Dataset.from_dict({"prompt": benchmark_prompts(spec.model_path)}),
        processing_class=AutoTokenizer.from_pretrained(spec.model_path),
    )


def build_stock(spec: RunSpec) -> tuple[Any, Any]:
    """TRL's own GRPOTrainer in colocate mode; its engine is TRL's ``vllm.LLM``."""
    from trl import GRPOTrainer

    trainer = GRPOTrainer(**trainer_inputs(spec))
    return trainer, trainer.vllm_generation.llm


def build_ours(spec: RunSpec) -> tuple[Any, Any]:
    """``ColocateGRPOTrainer`` on stock's PEFT model and TRL arguments, CUDA graphs on as stock's engine has them."""
    from colocate_grpo.config import VLLMConfig
    from colocate_grpo.trainer import ColocateGRPOTrainer

    inputs = trainer_inputs(spec)
    options = VLLMConfig(
        gpu_memory_utilization=inputs["args"].vllm_gpu_memory_utilization,
        max_model_len=inputs["args"].vllm_max_model_length,
        enforce_eager=False,
    )
    trainer = ColocateGRPOTrainer(**inputs, vllm_options=options, serve_adapter=spec.kind == "ours-adapter")
    return trainer, trainer.engine


# All the linears of a Qwen2 layer, as Unsloth's notebooks list them (stock's "all-linear" is the same set).
UNSLOTH_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_unsloth(spec: RunSpec) -> tuple[Any, Any]:
    """Unsloth as its GRPO notebooks run it: ``FastLanguageModel`` with fast inference (its vLLM engine shares the
    weights with training, standby frees only the KV cache), LoRA r=16 on all linears with its gradient
    checkpointing, and its patched ``GRPOTrainer`` on the batch, reward and learning rate of the other kinds.
    ``unsloth-4bit`` loads the bf16 files in 4 bits, as ``load_in_4bit=True`` does. The engine is the trainer's
    ``vllm_generation.llm`` (Unsloth's engine, which TRL's ``VLLMGeneration`` takes instead of starting one)."""
    try:
        # First of the libraries it patches: importing unsloth rewrites transformers' and TRL's classes.
        from unsloth import FastLanguageModel
    except Exception as error:  # not only ImportError: without an accelerator it raises NotImplementedError
        why = " ".join(f"{type(error).__name__}: {error}".split())
        raise SystemExit(
            f"bench: {spec.kind} needs Unsloth, and import unsloth failed ({why}); install it, or set UNSLOTH_SITE "
            "to a folder that has it"
        ) from None
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer  # Unsloth's patched classes, once unsloth is imported

    share = card_share(spec)
    if share < 1.0:
        # Standby raises the engine's fraction to its own share of the whole device, more than a simulated card has.
        os.environ["UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE"] = "1"
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=spec.model_path,
        max_seq_length=model_length(spec),
        load_in_4bit=spec.kind == "unsloth-4bit",
        fast_inference=True,
        max_lora_rank=16,
        gpu_memory_utilization=0.9 * share,
        random_state=0,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        target_modules=UNSLOTH_TARGETS,
        lora_alpha=32,  # stock's: the same LoRA scale on both sides
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    # Unsloth turns on vLLM, its colocate mode and sleep mode itself when the model has its engine.
    args = GRPOConfig(**batch_args(spec), use_vllm=True, bf16=True)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[getattr(workload, spec.reward)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": benchmark_prompts(spec.model_path)}),
    )
    return trainer, trainer.vllm_generation.llm


def unsloth_env() -> dict[str, str]:
    """The Unsloth kinds' environment: standby on (read at import, so set before it), and ``$UNSLOTH_SITE``, when
    set, ahead of ``PYTHONPATH``: Unsloth's own trl and datasets must shadow those installed beside vLLM."""
    env = {"UNSLOTH_VLLM_STANDBY": "1"}
    site = os.environ.get("UNSLOTH_SITE")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(path for path in (site, os.environ.get("PYTHONPATH")) if path)
    return env


KINDS: dict[str, Kind] = {
    "stock": Kind("stock", "TRL's GRPOTrainer, colocate mode, PEFT LoRA, TRL's engine settings", build_stock),
    "stock-4bit": Kind("stock-4bit", "stock on the NF4 base a QLoRA user loads", build_stock),
    "user": Kind("user", "build_trainer with the plain config a user writes (every default)", build_user),
    "user-merged": Kind("user-merged", "user + lora_merge_aware: null (PEFT's LoRA, merged)", build_user),
    "user-adapter": Kind("user-adapter", "user + trl.vllm_lora_sync: true (the adapter served)", build_user),
    "user-4bit": Kind(
        "user-4bit", "user + load_in_4bit: true (NF4 values in bf16 where they fit, else one NF4 base)", build_user
    ),
    "user-fp32-head": Kind("user-fp32-head", "user + trl.cast_lm_head_to_fp32: true", build_user),
    "user-no-grouping": Kind("user-no-grouping", "user + group_by_length: false (TRL's padding)", build_user),
    "user-checkpointing": Kind("user-checkpointing", "user + gradient_checkpointing: true", build_user),
    "user-adamw-unfused": Kind("user-adamw-unfused", "user + trl.optim: adamw_torch (not fused)", build_user),
    "user-liger": Kind(
        "user-liger", "user + trl.use_liger_kernel: true (Liger's RMSNorm, SwiGLU, RoPE; GPU, liger-kernel)", build_user
    ),
    "user-bitwise": Kind(
        "user-bitwise",
        "user + trl.vllm_bitwise_logprobs: true (vLLM's batch-invariant kernels on both sides)",
        build_user,
    ),
    "user-async": Kind(
        "user-async", "user + async_generation: true (the next batch generates while this one trains)", build_user
    ),
    "user-seed1": Kind("user-seed1", "user + seed: 1 (another draw of the run: the run-to-run spread)", build_user),
    "user-expandable": Kind(
        "user-expandable",
        "user with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch's allocator grows segments in place "
        "instead of caching blocks of many sizes; vLLM turns it off around its sleep-mode pool)",
        build_user,
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    ),
    "ours": Kind("ours", "ColocateGRPOTrainer with stock's PEFT model and TRL arguments", build_ours),
    "ours-ma": Kind("ours-ma", "ours with merge-aware LoRA", build_ours),
    "ours-adapter": Kind("ours-adapter", "ours with the adapter served by vLLM's LoRA kernels", build_ours),
    "unsloth": Kind(
        "unsloth",
        "Unsloth's GRPOTrainer as its notebooks run it: fast inference, standby",
        build_unsloth,
        env=unsloth_env(),
    ),
    "unsloth-4bit": Kind("unsloth-4bit", "unsloth with load_in_4bit=True", build_unsloth, env=unsloth_env()),
}


# Dense bf16 tensor-core peak FLOP/s by the GPU's name (the first entry the name contains): NVIDIA's datasheets.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named ``device_name`` (an H100 SXM's 989e12), None where not known."""
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_name), None)


@dataclass(frozen=True)
class ModelFlops:
    """The FLOPs of a decoder's forwards and backwards (the convention is bench/README.md's, "Model FLOPs").

    ``linear``: N, the decoder layers' linear weights (non-embedding, head excluded, biases and norms left out);
    ``head``: hidden x vocabulary; ``attention``: layers x the queries' width, so that a forward's attention
    scores and weighted sums take 4 * attention * length^2 per sequence; ``trains_weights``: whether the
    backward computes the decoder's weight gradients (full fine-tuning) or only the activations' (LoRA: the base
    is frozen, the LoRA factors' own FLOPs are negligible); ``recomputes``: gradient checkpointing's second
    forward of the decoder, counted in the hardware's FLOPs, not the model's.
    """

    linear: int
    head: int
    attention: int
    trains_weights: bool
    recomputes: bool

    @classmethod
    def of(cls, model: Any) -> ModelFlops:
        config = model.config.get_text_config().to_dict()
        heads_width = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        linear = config["num_hidden_layers"] * sum(o * i for o, i in layer_linears(config).values())
        frozen_base = all("lora_" in n or not p.requires_grad for n, p in model.named_parameters())
        return cls(
            linear=linear,
            head=config["hidden_size"] * config["vocab_size"],
            attention=config["num_hidden_layers"] * config["num_attention_heads"] * heads_width,
            trains_weights=not frozen_base,
            recomputes=bool(getattr(model, "is_gradient_checkpointing", False)),
        )

    def forward(self, tokens: float, scored: float, squares: float, head: bool = True) -> float:
        """A forward over ``tokens`` tokens (``squares``: the sum of the sequences' squared lengths) whose head
        scores ``scored`` positions."""
        return 2 * self.linear * tokens + (2 * self.head * scored if head else 0) + 4 * self.attention * squares

    def backward(self, tokens: float, scored: float, squares: float) -> float:
        """The backward of that forward: the activations' gradients (as many FLOPs as the forward's matmuls, twice
        the attention's), and the weights' where they train."""
        matmuls = 2 * self.linear * tokens + 2 * self.head * scored
        return matmuls * (2 if self.trains_weights else 1) + 8 * self.attention * squares

    def counted(self, rows: int, width: int, lengths: list[int], scored: int, grad: bool) -> tuple[float, float]:
        """(model FLOPs, hardware FLOPs) of one forward over ``rows`` x ``width`` tokens whose sequences have
        ``lengths`` real tokens, with its backward when ``grad``: the model's over the real tokens, the
        hardware's over the computed ones (padding included), with the recomputed forward."""
        tokens, squares = sum(lengths), sum(n * n for n in lengths)
        model = self.forward(tokens, scored, squares) + (self.backward(tokens, scored, squares) if grad else 0.0)
        computed, computed_squares = rows * width, rows * width * width
        hardware = self.forward(computed, scored, computed_squares)
        if grad:
            hardware += self.backward(computed, scored, computed_squares)
            if self.recomputes:
                hardware += self.forward(computed, 0, computed_squares, head=False)
        return model, hardware


def kernel_overlap(kernels: list[tuple[int, float, float]]) -> dict[str, Any]:
    """What a step's CUDA kernels (``(stream, start, end)``, in seconds) kept the device busy with: ``busy_s`` (any
    kernel running), ``by_stream_s`` (each stream's busy time, its id as a string) and ``overlap_s`` (kernels of two
    streams or more running at once: asynchronous generation's overlap as the device saw it)."""
    edges = sorted(
        [(start, 1, stream) for stream, start, _ in kernels] + [(end, -1, stream) for stream, _, end in kernels]
    )
    running: dict[int, int] = {}
    busy = overlap = 0.0
    by_stream: dict[int, float] = {}
    last = edges[0][0] if edges else 0.0
    for time_s, change, stream in edges:
        active = [s for s, n in running.items() if n > 0]
        span = time_s - last
        busy += span if active else 0.0
        overlap += span if len(active) > 1 else 0.0
        for s in active:
            by_stream[s] = by_stream.get(s, 0.0) + span
        running[stream] = running.get(stream, 0) + change
        last = time_s
    return {"busy_s": busy, "overlap_s": overlap, "by_stream_s": {str(s): t for s, t in sorted(by_stream.items())}}


def kernel_time_by_name(kernels: list[tuple[str, float]], top: int = 20) -> list[dict[str, Any]]:
    """The ``top`` kernels by their summed time in a step (``(name, seconds)`` each run): ``name`` (cut to 120
    characters), ``s`` and ``count``, longest first. Where a step's device time goes, kernel by kernel."""
    totals: dict[str, list[float]] = {}
    for name, seconds in kernels:
        entry = totals.setdefault(name[:120], [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [{"name": name, "s": seconds, "count": int(count)} for name, (seconds, count) in ranked]


def profile_callback(step: int, into: dict[str, Any]) -> TrainerCallback:
    """A trainer callback that records the CUDA kernels of optimizer step ``step`` (from 1) with torch's profiler
    and puts their :func:`kernel_overlap` and :func:`kernel_time_by_name` (``top_kernels``) into ``into``."""
    import json
    import tempfile

    import torch
    from transformers import TrainerCallback

    class Profile(TrainerCallback):
        profiler: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step + 1 == step:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self.profiler.start()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            if self.profiler is None:
                return
            torch.cuda.synchronize()
            self.profiler.stop()
            with tempfile.TemporaryDirectory() as directory:
                trace = Path(directory) / "trace.json"
                self.profiler.export_chrome_trace(str(trace))
                events = json.loads(trace.read_text())["traceEvents"]
            events = [e for e in events if e.get("cat") == "kernel" and "stream" in e.get("args", {})]
            kernels = [(e["args"]["stream"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events]
            into.update(step=step, kernels=len(kernels), **kernel_overlap(kernels))
            into["top_kernels"] = kernel_time_by_name([(e.get("name", "?"), e["dur"] / 1e6) for e in events])
            self.profiler = None

    return Profile()


def count_flops(model: Any, recorder: StepRecorder) -> None:
    """Add each forward of ``model`` (the trainer's: the scoring pass, the micro-batches' forwards, a reference's)
    and its backward to the step in progress: ``flops`` {``model``, ``hardware``, ``tokens`` (real),
    ``computed_tokens`` (with padding)}, from the call's ``input_ids``, ``attention_mask`` and ``labels``."""
    import torch

    flops = ModelFlops.of(model)

    def hook(_: Any, args: tuple, kwargs: dict) -> None:
        ids, mask, labels = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask"), None
        if ids is None:
            return
        mask = torch.ones_like(ids) if mask is None else mask
        labels = kwargs.get("labels")
        # TRL's fused head scores the labelled positions (on a GPU only those); a full head every position.
        scored = int((labels[:, 1:] != -100).sum()) if labels is not None else ids.numel()
        lengths = mask.sum(1).tolist()
        model_flops, hardware_flops = flops.counted(*ids.shape, lengths, scored, torch.is_grad_enabled())
        counts = recorder.current.setdefault(
            "flops", {"model": 0.0, "hardware": 0.0, "tokens": 0, "computed_tokens": 0}
        )
        counts["model"] += model_flops
        counts["hardware"] += hardware_flops
        counts["tokens"] += int(sum(lengths))
        counts["computed_tokens"] += ids.numel()

    model.register_forward_pre_hook(hook, with_kwargs=True)


def take_device_memory(card_gib: float) -> torch.Tensor:
    """Allocate all but ``card_gib`` GiB of the device in one tensor: the run then sees a card of that size."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return torch.empty(int(total - card_gib * GIB - (total - free)), dtype=torch.uint8, device="cuda")


# A step record's fields from the trainer's logs of the same names.
LOGGED_FIELDS = {
    "sampling/sampling_logp_difference/mean": "logp_diff",
    "sampling/logp_equal_fraction": "logp_equal_fraction",
    "entropy": "entropy",
    "reward": "reward",
}
# colocate_grpo's own per-phase clock and merge checks, kept as the run logged them (a step record's ``logged``).
OWN_PREFIXES = ("time/", "memory/", "lora_merge/", "sync/", "lora_sync/", "async/")


def logged_fields(logs: Mapping[str, Any]) -> dict[str, Any]:
    """What a step record takes from one of the trainer's logs: the logprob agreement, entropy and reward, the
    served == trained checks (all of them true), and ``logged``: colocate_grpo's own numbers."""
    fields: dict[str, Any] = {name: logs[key] for key, name in LOGGED_FIELDS.items() if key in logs}
    checks = [value for key, value in logs.items() if key.endswith("served_equals_trained")]
    if checks:
        fields["served_equals_trained"] = bool(min(checks))
    fields["logged"] = {k: v for k, v in logs.items() if k.startswith(OWN_PREFIXES) and isinstance(v, int | float)}
    return fields


def logged_steps(workdir: Path) -> list[dict[str, Any]]:
    """The steps a colocate_grpo run wrote to its metrics file (``metrics.jsonl`` in its output_dir) as step
    records: ``step``, ``step_s`` (its own ``time/step``) and :func:`logged_fields`. What remains of a run that
    ended before it wrote its record; none for the other kinds, which write no such file."""
    from colocate_grpo.output_dir import METRICS

    path = workdir / RUN_DIR / METRICS
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            logs = json.loads(line)
        except json.JSONDecodeError:  # the torn last line of a full disk
            continue
        if "step" in logs and "reward" in logs:
            steps.append({"step": logs["step"], "step_s": logs.get("time/step"), **logged_fields(logs)})
    return steps


class StepRecorder:
    """Times one run's engine calls and optimizer steps.

    ``current`` is the step in progress: each phase's seconds (a wake inside a sync is counted in both) and the
    device's used GiB after it, ``overhead_s`` (the outermost calls but generate), and what the trainer logged.
    ``steps`` are the finished steps. With ``stop_at`` training stops after the first step that ends past that
    time (``time.time()``).
    """

    def __init__(self, cuda: bool, stop_at: float | None) -> None:
        self.cuda = cuda
        self.stop_at = stop_at
        self.current: dict[str, Any] = {}
        self.threads = threading.local()  # each thread's timed calls in progress, outermost first
        self.steps: list[dict[str, Any]] = []

    @property
    def calls(self) -> list[str]:
        if not hasattr(self.threads, "calls"):
            self.threads.calls = []
        return self.threads.calls

    def device_used_gib(self) -> float:
        """The whole device's used memory (every process's, the simulated card's allocation too), in GiB."""
        import torch

        if not self.cuda:
            return 0.0
        free, total = torch.cuda.mem_get_info()
        return (total - free) / GIB

    def alloc_retries(self) -> int:
        import torch

        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else 0

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, with its seconds and the device's used memory after it recorded under ``name``."""
        import torch

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # A call inside another (a wake inside a sync) is not synchronized: colocate_grpo wakes the KV cache
            # while the device writes the weights, and waiting would undo that.
            outermost = not self.calls
            # A call on another thread (async_generation's worker generating while the trainer trains) is timed
            # without synchronizing the device, which would wait for the trainer's work, and is no overhead of
            # the trainer's thread.
            background = threading.current_thread() is not threading.main_thread()
            synchronize = self.cuda and outermost and not background
            if synchronize:
                torch.cuda.synchronize()
            start = time.perf_counter()
            self.calls.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.pop()
                if synchronize:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                phase = self.current.setdefault("phases", {}).setdefault(name, {"s": 0.0, "device_gib": 0.0})
                phase["s"] += elapsed
                phase["device_gib"] = max(phase["device_gib"], self.device_used_gib())
                if background:
                    phase["background"] = True
                elif outermost and name != "generate":
                    self.current["overhead_s"] = self.current.get("overhead_s", 0.0) + elapsed

        return wrapper

    def callback(self) -> TrainerCallback:
        """The trainer callback that starts and ends each step's record and adds what the trainer logs."""
        import psutil
        import torch
        from transformers import TrainerCallback

        recorder = self

        class Steps(TrainerCallback):
            def on_step_begin(self, *_: Any, **__: Any) -> None:
                recorder.current.clear()
                recorder.current["start"] = time.perf_counter()
                recorder.current["alloc_retries"] = recorder.alloc_retries()

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                current = recorder.current
                if recorder.stop_at is not None and time.time() > recorder.stop_at:
                    control.should_training_stop = True
                if recorder.cuda:
                    torch.cuda.synchronize()
                current["step_s"] = time.perf_counter() - current.pop("start")
                # The training phase: the step but its engine calls (scoring, rewards, forwards, backwards, the
                # optimizer; colocate_grpo's time/train).
                generate = current.get("phases", {}).get("generate", {})
                generate_s = 0.0 if generate.get("background") else generate.get("s", 0.0)
                current["train_s"] = current["step_s"] - current.get("overhead_s", 0.0) - generate_s
                current["alloc_retries"] = recorder.alloc_retries() - current["alloc_retries"]
                current["train_device_gib"] = recorder.device_used_gib()
                current["host_rss_gib"] = psutil.Process().memory_info().rss / GIB
                recorder.steps.append({"step": len(recorder.steps) + 1, **current})

            def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **_: Any) -> None:
                if not logs or not recorder.steps:
                    return
                step = recorder.steps[-1]
                fields = logged_fields(logs)
                # Merged: the run's last on_log (its summary, train_runtime and the like) has none of these.
                step.setdefault("logged", {}).update(fields.pop("logged"))
                step.update(fields)
                # Generation on async_generation's worker overlaps the trainer's step, and the trainer may wait for
                # it outside the calls timed here: its own clock of the training phase is the one to read.
                if step.get("phases", {}).get("generate", {}).get("background") and "time/train" in logs:
                    step["train_s"] = logs["time/train"]

        return Steps()


def torch_peaks(steps: list[dict[str, Any]], cuda: bool) -> dict[str, float | None]:
    """torch's allocator's peaks over the run, in GiB: ``trainer_peak_allocated_gib`` (tensors) and
    ``trainer_peak_reserved_gib`` (with the blocks it caches; vLLM's sleep-mode pool is part of both); None without
    CUDA. colocate_grpo logs each phase's (``memory/<phase>/peak_*``, resetting torch's peaks at each phase), so its
    runs take the largest it logged; a run that logs none (stock TRL, Unsloth) takes torch's peaks since training
    started."""
    import torch

    kinds = ("allocated", "reserved")
    if not cuda:
        return {f"trainer_peak_{kind}_gib": None for kind in kinds}
    return {
        f"trainer_peak_{kind}_gib": max(
            (v for s in steps for k, v in s.get("logged", {}).items() if k.endswith(f"peak_{kind}_gib")),
            default=getattr(torch.cuda, f"max_memory_{kind}")() / GIB,
        )
        for kind in kinds
    }


def training_phase_summary(measured: list[dict[str, Any]], device_name: str) -> dict[str, Any]:
    """The training phase's medians over the measured steps: ``train_s``, ``model_tflop`` (a step's model FLOPs,
    in 10^12), ``train_tflops`` (model FLOPs a second of the training phase), ``mfu`` and ``hfu`` (model and
    hardware FLOPs a second over the GPU's dense bf16 peak; None where the peak is not known, as on a CPU), and
    ``padding_share`` (of the tokens the forwards computed, those that were padding)."""
    counted = [s for s in measured if s.get("flops") and s["train_s"] > 0]
    peak = peak_bf16_flops(device_name)
    model_rate = median([s["flops"]["model"] / s["train_s"] for s in counted])
    hardware_rate = median([s["flops"]["hardware"] / s["train_s"] for s in counted])
    computed = sum(s["flops"]["computed_tokens"] for s in counted)
    return {
        "train_s": median([s["train_s"] for s in measured]),
        "model_tflop": median([s["flops"]["model"] / 1e12 for s in counted]),
        "train_tflops": model_rate / 1e12 if model_rate is not None else None,
        "mfu": model_rate / peak if peak and model_rate is not None else None,
        "hfu": hardware_rate / peak if peak and hardware_rate is not None else None,
        "padding_share": 1 - sum(s["flops"]["tokens"] for s in counted) / computed if computed else None,
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def mismatch_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean |logp_vLLM - logp_trainer| over the run, in its first and last tenth, per pass over the prompts (a
    step's mismatch depends on the prompts it draws: two passes compare the same prompts), and by the staleness of
    the batch trained on (asynchronous generation: optimizer steps between its adapter and the trainer's)."""
    values = [s["logp_diff"] for s in steps if "logp_diff" in s]
    by_staleness = collections.defaultdict(list)
    for s in steps:
        if "logp_diff" in s and "async/staleness" in s.get("logged", {}):
            by_staleness[round(s["logged"]["async/staleness"])].append(s["logp_diff"])
    equal = [s["logp_equal_fraction"] for s in steps if "logp_equal_fraction" in s]
    tenth = max(1, len(values) // 10)
    passes = [values[i : i + STEPS_PER_PASS] for i in range(0, len(values) - STEPS_PER_PASS + 1, STEPS_PER_PASS)]
    return {
        "mean": mean(values),
        "first_tenth": mean(values[:tenth]),
        "last_tenth": mean(values[-tenth:]),
        "by_pass": [statistics.mean(p) for p in passes],
        "by_staleness": {str(age): statistics.mean(v) for age, v in sorted(by_staleness.items())},
        # The share of sampled tokens whose two log-probabilities are equal bit for bit: its mean and lowest step.
        "equal_fraction": mean(equal),
        "equal_fraction_min": min(equal, default=None),
    }


def run_kind(spec: RunSpec) -> dict[str, Any]:
    """One training run of ``spec.kind`` in this process: the result's ``steps``, ``summary``, ``memory``,
    ``mismatch``, ``served_equals_trained`` and ``metrics`` (of the harness's schema, see ``run.py``)."""
    import torch

    cuda = torch.cuda.is_available()
    device_total_gib = torch.cuda.mem_get_info()[1] / GIB if cuda else 0.0
    taken = take_device_memory(spec.card_gib) if cuda and spec.card_gib else None
    trainer, engine = KINDS[spec.kind].build(spec)
    print(ENGINE_STARTED, flush=True)
    model = trainer.model
    base_before = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if "lora_" not in n}

    recorder = StepRecorder(cuda, spec.stop_at)
    generation = trainer.vllm_generation
    generation.sync_weights = recorder.timed("sync", generation.sync_weights)
    for phase in ("sleep", "wake_up", "generate"):
        setattr(engine, phase, recorder.timed(phase.removesuffix("_up"), getattr(engine, phase)))
    trainer.add_callback(recorder.callback())
    profiled: dict[str, Any] = {}
    if cuda and spec.profile_step is not None:
        trainer.add_callback(profile_callback(spec.profile_step, profiled))
    count_flops(model, recorder)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    del taken

    steps = recorder.steps
    measured = steps[WARMUP_STEPS:] or steps
    drift = [
        (p.detach().cpu().float() - base_before[n].float()).abs()
        for n, p in model.named_parameters()
        if "lora_" not in n
    ]
    peaks = {
        phase: max((s.get("phases", {}).get(phase, {}).get("device_gib", 0.0) for s in steps), default=0.0)
        for phase in PHASES
    }
    peaks["train"] = max((s["train_device_gib"] for s in steps), default=0.0)
    peak = max(peaks.values())
    checks = [s["served_equals_trained"] for s in steps if "served_equals_trained" in s]
    step_s = median([s["step_s"] for s in measured])
    return {
        "steps": steps,
        "summary": {
            "step_s": step_s,
            **training_phase_summary(measured, torch.cuda.get_device_name() if cuda else ""),
            "phase_s": {p: median([s.get("phases", {}).get(p, {}).get("s", 0.0) for s in measured]) for p in PHASES},
            "overhead_share": median([s.get("overhead_s", 0.0) / s["step_s"] for s in measured]),
            # Completions generated and trained a second, over every rank.
            "samples_per_s": spec.ranks * spec.generation_batch / step_s if step_s else None,
            "steps_run": len(steps),
        },
        "memory": {
            "peak_device_gib_by_phase": peaks,
            "peak_device_gib": peak,
            # Of a simulated card: the device's used memory counts the allocation that simulates it.
            "card_used_gib": peak - (device_total_gib - spec.card_gib) if cuda and spec.card_gib else None,
            **torch_peaks(steps, cuda),
        },
        "mismatch": mismatch_summary(steps),
        "served_equals_trained": min(checks) if checks else None,
        "metrics": {
            # The policy's mean entropy (nats): how sharp its next-token distributions are (see build_model).
            "entropy": mean([s["entropy"] for s in steps if "entropy" in s]),
            # 0 when no step trained (a reward without spread in any group): the run's weights never moved.
            "lora_b_max": max(
                (float(p.detach().abs().max()) for n, p in model.named_parameters() if "lora_B" in n), default=0.0
            ),
            # torch's allocator freed its cache and tried again (a device-wide synchronization each time).
            "alloc_retries": sum(s.get("alloc_retries", 0) for s in measured),
            "base_drift_max": max((float(d.max()) for d in drift), default=0.0),
            # The profiled step's CUDA kernels: the device's busy time, by stream, and two streams at once.
            "kernels": profiled or None,
        },
    }


def is_rank_zero() -> bool:
    """Whether this process writes the result: the only one, or rank 0 of a ``torchrun`` launch."""
    return os.environ.get("RANK", "0") == "0"
