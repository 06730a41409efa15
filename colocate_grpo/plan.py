"""The run plan: every setting a run derives, decided once, before the model loads.

What the user wrote (:class:`~colocate_grpo.config.Config`) and what TRL's ``GRPOConfig``
makes of it become one frozen :class:`RunPlan`: how the policy is served, the engine's
identity and size, the dtype, the memory. It is printed at start and written beside the
config; the model loader, the trainer, the engine and the memory check read it and derive
nothing themselves.

Two constructors give the same plan for the same run: :func:`plan_run` from the YAML config
and what the run read (its device, the dataset's longest prompt, the model's shape, read
once), and :func:`plan_for_model` from a model and a ``GRPOConfig``, for direct use of the
trainer as the benchmarks and tests do. Both end in :func:`_derive`, the one place where the
engine's batch, ``max_model_len``, KV cache and memory fraction are worked out.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from dataclasses import dataclass, fields
from typing import Any

import torch

from colocate_grpo.config import Config, VLLMConfig
from colocate_grpo.memory_plan import (
    LORA_ITEMSIZE,
    MemoryPlan,
    ModelShape,
    engine_memory,
    kv_cache_bytes,
    lora_parameters,
    model_shape,
    plan_memory,
    shape_of,
    size_text,
    training_activation_bytes,
    training_bytes,
    weight_bytes,
)
from colocate_grpo.nf4 import BLOCK_SIZE as NF4_BLOCK_SIZE
from colocate_grpo.on_policy import scores_in_training_forward, trl_scores_old_logprobs
from colocate_grpo.serving import AsyncMode, Serving
from colocate_grpo.training_plan import TrainingPlan, fitting_training

# vLLM's batch limit (max_num_seqs) is TRL's generation batch and at least this. vLLM 0.26 crashed in its warm-up
# on the H200 with 16 (an illegal memory access) and ran with 64. Its own default there, 1024, costs memory that
# sleep mode does not free (CUDA graphs for batches up to 512).
MIN_NUM_SEQS = 64
# The adapter ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class EngineSpec:
    """The engine a run needs: its identity (what it computes) and its capacity (how much at once).

    Attributes:
        model_path: the base model; options: the ``vllm:`` block, ``max_model_len`` resolved (the run's token budget,
            at most the model's context); dtype: the torch dtype name the engine computes in.
        max_lora_rank: the rank of its one adapter slot (a rank vLLM serves); None serves the weights alone.
        fp32_head: compute the logits in fp32 from the head's weights (``trl.cast_lm_head_to_fp32``).
        quantization: ``"bitsandbytes"`` quantizes the checkpoint to NF4 as it loads (a 4-bit base), else None.
        generation_batch: sequences generated at once (TRL's generation batch): the KV cache holds them at full
            length; vLLM's batch limit (``max_num_seqs``) is this, at least ``MIN_NUM_SEQS``.
        sequence_tokens: tokens one sequence takes at most (the longest prompt + the completion), for the KV cache.
        memory_fraction, kv_cache_bytes: vLLM's ``gpu_memory_utilization`` and ``kv_cache_memory_bytes`` (None: vLLM
            sizes the cache from the fraction).
        batch_invariant: vLLM's batch-invariant mode, whose kernels the trainer's forward shares
            (``trl.vllm_bitwise_logprobs``, :mod:`colocate_grpo.bitwise`).
        full_length_sequences: where the device has no room for the whole batch's KV cache at full length, how
            many sequences at full length the smaller cache holds (vLLM queues the rest); None: the whole batch.
        nf4_values: the engine computes in ``dtype`` with a 4-bit base's NF4 values, which the trainer writes into
            its weights (:mod:`colocate_grpo.nf4`); its linear weights are not the checkpoint's.
    """

    model_path: str
    options: VLLMConfig
    dtype: str
    max_lora_rank: int | None
    fp32_head: bool
    quantization: str | None
    trust_remote_code: bool
    generation_batch: int
    sequence_tokens: int | None
    memory_fraction: float
    kv_cache_bytes: int | None
    seed: int
    batch_invariant: bool = False
    full_length_sequences: int | None = None
    nf4_values: bool = False

    @property
    def max_num_seqs(self) -> int:
        """vLLM's batch limit: the generation batch, at least ``MIN_NUM_SEQS`` (vLLM's warm-up needs it)."""
        return max(MIN_NUM_SEQS, self.generation_batch)

    @property
    def identity(self) -> dict[str, Any]:
        """What the engine computes, named as a user sets it: two engines of one identity serve the same runs."""
        return {
            "base_model": self.model_path,
            **{f"vllm.{f.name}": getattr(self.options, f.name) for f in fields(self.options)},
            "dtype": self.dtype,
            "LoRA rank": self.max_lora_rank,
            "trl.cast_lm_head_to_fp32": self.fp32_head,
            "quantization": self.quantization,
            # Only where on: other engines' identities (and plan.yaml) stay as they were.
            **({"trl.vllm_bitwise_logprobs": True} if self.batch_invariant else {}),
            **({"load_in_4bit": "NF4 values in bf16"} if self.nf4_values else {}),
        }

    def differences(self, wanted: EngineSpec) -> str:
        """Each setting of this engine's identity that ``wanted`` differs in, as ``key built (this run: wanted)``."""
        built, asked = self.identity, wanted.identity
        return "; ".join(
            f"{key} {built.get(key)!r} (this run: {asked.get(key)!r})"
            for key in {**asked, **built}
            if built.get(key) != asked.get(key)
        )

    def batch_shortfall(self, wanted: EngineSpec) -> str | None:
        """What keeps an engine built for this spec from generating ``wanted``'s batch in one pass, in words."""
        shortfalls = []
        # A KV cache sized for the batch holds that many sequences, of that length; else vLLM's batch limit counts.
        sized_by_batch = self.options.kv_cache == "batch"
        at_once = self.generation_batch if sized_by_batch else self.max_num_seqs
        wanted_at_once = wanted.generation_batch if sized_by_batch else wanted.max_num_seqs
        if wanted_at_once > at_once:
            shortfalls.append(f"{wanted_at_once} sequences at once where it generates {at_once}")
        cache_sized = sized_by_batch and wanted.sequence_tokens and self.sequence_tokens
        if cache_sized and wanted.sequence_tokens > self.sequence_tokens:
            shortfalls.append(
                f"sequences of {wanted.sequence_tokens} tokens where its KV cache holds {self.sequence_tokens}"
            )
        return "; ".join(shortfalls) or None


@dataclass(frozen=True)
class BitwiseMode:
    """``trl.vllm_bitwise_logprobs``: the trainer's log-probabilities of the sampled tokens equal the engine's bit for
    bit (docs/bitwise.md).

    Attributes:
        importance_sampling_correction: whether TRL still computes its importance-sampling correction, whose ratio
            is then exactly 1 (``trl.vllm_importance_sampling_correction``; off unless the config sets it).
    """

    importance_sampling_correction: bool

    def describe(self) -> str:
        correction = (
            "computed as asked (trl.vllm_importance_sampling_correction: true), though its ratio is 1"
            if self.importance_sampling_correction
            else "skipped, as its ratio is exactly 1"
        )
        return (
            "Log-probabilities: the trainer's equal the engine's bit for bit (vLLM's batch-invariant kernels on both "
            f"sides; sampling/logp_equal_fraction checks it every step); the importance-sampling correction is "
            f"{correction}."
        )


@dataclass(frozen=True)
class DeviceMemory:
    """The device's free and total bytes before the model loads, and the host memory available."""

    free: int
    total: int
    host_free: int | None = None


def read_device_memory() -> DeviceMemory:
    """What the CUDA device and the host have free now."""
    import psutil

    free, total = torch.cuda.mem_get_info()
    return DeviceMemory(free, total, psutil.virtual_memory().available)


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, decided before its model loads.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        dtype: the training dtype.
        serving: how the engine serves the trained policy.
        shared_base: whether the trainer's frozen base weights are meant to be the engine's (one copy); the
            trainer records whether the layouts allowed it.
        merge_aware: the merge-aware LoRA dtype (``"bf16"``, ``"fp16"``), or None for ordinary LoRA.
        engine: the engine the run needs.
        training: the trainer's micro-batches and gradient checkpointing.
        memory: the device memory plan on a GPU, else None.
        asynchronous: asynchronous generation's settings, or None: generate, then train.
        bitwise: the bitwise log-probabilities mode's settings, or None: the kernels of each side's own choosing.
    """

    device: str
    dtype: torch.dtype
    serving: Serving
    shared_base: bool
    merge_aware: str | None
    engine: EngineSpec
    training: TrainingPlan
    memory: MemoryPlan | None
    asynchronous: AsyncMode | None = None
    bitwise: BitwiseMode | None = None

    @property
    def nf4_values(self) -> bool:
        """Whether a 4-bit base (``load_in_4bit``) is kept as its NF4 values in bf16, where the device has room for
        them: the model QLoRA trains, on bf16 kernels (:mod:`colocate_grpo.nf4`), the adapter served on that base.
        False: the NF4 codes themselves (``Serving.QUANTIZED_BASE``), or no 4-bit base. The engine's to hold."""
        return self.engine.nf4_values

    @property
    def merge_record_in_host_memory(self) -> bool:
        """Whether merged serving keeps the record that restores the shared base in host memory."""
        return self.memory is not None and self.memory.merge_record_host > 0

    @property
    def served_as(self) -> str:
        return self.serving.describe(self.shared_base, self.engine.fp32_head)

    def summary(self) -> str:
        """The lines printed at start: how the policy is served, the engine's size and (on a GPU) the memory."""
        engine = self.engine
        if engine.kv_cache_bytes is None:
            cache = f"KV cache sized by vLLM from gpu_memory_utilization={engine.memory_fraction:.2g}"
        else:
            cache = f"KV cache {size_text(engine.kv_cache_bytes)}"
        at_once = f"{engine.generation_batch} sequences of up to {engine.sequence_tokens} tokens at once"
        if engine.full_length_sequences is not None:
            at_once = (
                f"{engine.generation_batch} sequences of up to {engine.sequence_tokens} tokens, "
                f"{engine.full_length_sequences} at once at full length (the device has no room for the whole "
                "batch's KV cache: vLLM queues the rest)"
            )
        lines = [
            f"Served as: {self.served_as}.",
            f"Engine: {at_once} (max_model_len {engine.options.max_model_len}), {cache}, {engine.dtype} on "
            f"{self.device}.",
        ]
        if self.asynchronous is not None:
            lines.append(f"Generation: {self.asynchronous.describe()}")
        if self.bitwise is not None:
            lines.append(self.bitwise.describe())
        if self.nf4_values:
            lines.append(
                "4-bit base: its NF4 values (QLoRA's: each linear weight but the head's rounded to NF4 in blocks of "
                f"{NF4_BLOCK_SIZE}) kept in {engine.dtype}, as the device has room for them: trained and served with "
                f"{engine.dtype} kernels, which generate faster than vLLM's NF4 ones."
            )
        lines.append(self.training.describe())
        if self.memory is not None:
            lines.append(self.memory.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain values (written to the output folder as plan.yaml)."""
        return {
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "serving": self.serving.value,
            "shared_base": self.shared_base,
            "merge_aware": self.merge_aware,
            "engine": {
                **self.engine.identity,
                **{
                    name: getattr(self.engine, name)
                    for name in (
                        "generation_batch",
                        "max_num_seqs",
                        "sequence_tokens",
                        "memory_fraction",
                        "kv_cache_bytes",
                        "seed",
                    )
                },
            },
            "training": dataclasses.asdict(self.training),
            "memory": None if self.memory is None else dataclasses.asdict(self.memory),
            # Only where the run generates asynchronously: a sequential run's plan.yaml stays as it was.
            **({} if self.asynchronous is None else {"async_generation": dataclasses.asdict(self.asynchronous)}),
            **({} if self.bitwise is None else {"bitwise_logprobs": dataclasses.asdict(self.bitwise)}),
            **({"nf4_values": True} if self.nf4_values else {}),
        }


def derived_max_model_len(budget: int | None, context: int | None) -> int | None:
    """The engine's ``max_model_len`` where ``vllm.max_model_len`` is unset: the run's prompt + completion
    ``budget`` (tokens), at most the model's ``context`` (vLLM refuses a longer one); None when neither is known."""
    return min((n for n in (budget, context) if n), default=None)


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM serves that holds a LoRA of ``rank`` (its buffers are padded to it)."""
    for supported in VLLM_LORA_RANKS:
        if supported >= rank:
            return supported
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {rank}.")


def merge_aware_mode(config: Config, dtype: torch.dtype) -> str | None:
    """``lora_merge_aware`` with ``auto`` resolved: the training dtype's name where merge-aware LoRA applies."""
    if config.lora_merge_aware != "auto":
        return config.lora_merge_aware
    # A served adapter (a 4-bit base included) is applied by the engine itself: there is no merge to match.
    if config.adapter != "lora" or config.peft_use_dora or config.load_in_8bit or _adapter_asked(config):
        return None
    return "fp16" if dtype == torch.float16 else "bf16"


def _adapter_asked(config: Config) -> bool:
    # Asynchronous generation serves the adapter: a merge would write the base while the trainer reads it.
    return bool(config.trl.get("vllm_lora_sync") or config.load_in_4bit or config.async_generation)


def serving_of(config: Config, dtype: torch.dtype) -> Serving:
    """How a run of ``config`` in ``dtype`` is served, as the config asks: a 4-bit base is ``QUANTIZED_BASE``, which
    the plan keeps as its NF4 values in bf16, with the adapter served, where they fit (``RunPlan.nf4_values``)."""
    if config.adapter != "lora":
        return Serving.FULL_WEIGHTS
    if config.load_in_4bit:
        return Serving.QUANTIZED_BASE
    if config.trl.get("vllm_lora_sync") or config.async_generation:
        return Serving.ADAPTER
    return Serving.MERGE_AWARE if merge_aware_mode(config, dtype) else Serving.MERGED


@dataclass(frozen=True)
class _Lora:
    """A LoRA run's size: its largest rank, its trainable parameters and the base weights it adapts."""

    rank: int
    parameters: int
    adapted_weights: int


def plan_run(
    config: Config,
    args: Any,
    *,
    model_path: str,
    device: str,
    dtype: torch.dtype,
    shape: ModelShape | None,
    longest_prompt: int | None = None,
    memory: DeviceMemory | None = None,
) -> RunPlan:
    """The plan of a run of ``config``, from what it read before loading its model.

    Args:
        args: the run's ``trl.GRPOConfig`` (made from ``config``): the generation batch, the completion length,
            the seed and the fp32 head are read from it, as the trainer will.
        model_path: the base model's directory or hub id; shape: its shape (None: transformers cannot read it).
        device, dtype: where the run trains and in what dtype.
        longest_prompt: the dataset's longest prompt in tokens (None: ``max_prompt_length``).
        memory: the device's memory on a GPU (:func:`read_device_memory`), for the memory plan.
    """
    serving = serving_of(config, dtype)
    lora = None
    if serving.lora and shape is not None:
        adapted = [(out, in_) for name, out, in_ in shape.linear_shapes if _adapted(config, name)]
        lora = _Lora(config.lora_r, lora_parameters(config.lora_r, adapted), sum(out * in_ for out, in_ in adapted))
    elif serving.lora:
        lora = _Lora(config.lora_r, 0, 0)
    prompt = config.max_prompt_length if longest_prompt is None else min(longest_prompt, config.max_prompt_length)
    derive = functools.partial(
        _derive,
        args,
        model_path=model_path,
        options=config.vllm,
        device=device,
        dtype=dtype,
        merge_aware=merge_aware_mode(config, dtype),
        shape=shape,
        lora=lora,
        sequence_tokens=prompt + args.max_completion_length,
        memory=memory,
        checkpointing=None if config.gradient_checkpointing == "auto" else config.gradient_checkpointing,
        smaller_micro_batches=True,
        asynchronous=AsyncMode(config.max_staleness) if config.async_generation else None,
        bitwise=bool(config.trl.get("vllm_bitwise_logprobs")),
    )
    if serving is not Serving.QUANTIZED_BASE:
        return derive(serving=serving)
    # A 4-bit base: its NF4 values in bf16 where they fit (on a CPU always: vLLM has no NF4 kernels there), else the
    # codes. The adapter is served either way, as QLoRA trains it. The values are kept where they fit only with
    # gradient checkpointing or smaller micro-batches than the codes': the codes generate 2.2x to 2.5x slower than
    # bf16 (vLLM's NF4 kernels at 7B) and the trainer dequantizes them at every matmul, while checkpointing costs
    # 1.32x to 1.34x of the training phase.
    values = derive(serving=Serving.ADAPTER, nf4_values=True)
    if device != "cuda":
        return values
    return values if values.memory is not None and values.memory.fits else derive(serving=serving)


def plan_for_model(
    model: Any,
    args: Any,
    *,
    vllm_options: VLLMConfig | None = None,
    serve_adapter: bool = False,
    sequence_tokens: int | None = None,
    asynchronous: AsyncMode | None = None,
    bitwise_logprobs: bool = False,
) -> RunPlan:
    """The plan of a run that trains ``model`` (a PEFT LoRA model or a full one) with ``args`` (a GRPOConfig).

    For direct use of :class:`~colocate_grpo.trainer.ColocateGRPOTrainer`. The model's shape is read off its
    config, the serving off its layers (merge-aware, 4-bit) and ``serve_adapter``.

    Args:
        vllm_options: the ``vllm:`` block (None: its defaults).
        serve_adapter: serve the LoRA adapter with vLLM's LoRA kernels instead of merged weights.
        sequence_tokens: the tokens a generated sequence takes at most (the longest prompt plus
            ``max_completion_length``); None: ``max_model_len``.
        asynchronous: generate the next batch while this one trains (needs ``serve_adapter``); None: sequentially.
        bitwise_logprobs: the trainer's log-probabilities bit for bit the engine's (``trl.vllm_bitwise_logprobs``;
            ``args.vllm_importance_sampling_correction`` as given).

    Raises:
        ValueError: for a model or settings the colocated engine cannot serve.
    """
    from peft.tuners.lora import LoraLayer

    from colocate_grpo.lora import MERGE_DTYPES, MergeAwareLoraLinear

    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(
            "vllm_tensor_parallel_size must be 1: each rank has its own colocated engine on its own GPU (data "
            "parallel). For generation on separate GPUs, use TRL's server mode."
        )
    merge_dtype = next((m.merge_dtype for m in model.modules() if isinstance(m, MergeAwareLoraLinear)), None)
    merge_aware = next((name for name, d in MERGE_DTYPES.items() if d == merge_dtype), None)
    is_lora = hasattr(model, "peft_config")
    if serve_adapter and (merge_aware or not is_lora):
        raise ValueError(
            "serve_adapter needs a PEFT LoRA model with ordinary LoRA layers: merge-aware LoRA trains the merged "
            "weights, which only a merged sync serves."
        )
    if asynchronous is not None and not serve_adapter:
        raise ValueError(
            "Asynchronous generation needs serve_adapter=True: a merged sync would change the base weights the "
            "trainer computes with while the engine generates."
        )
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if any(any(m.use_dora.values()) for m in layers):
        raise ValueError(
            "DoRA adapters cannot be served in colocate mode yet: vLLM has no DoRA kernels, and the merged sync "
            "writes W + s*B@A without DoRA's magnitude. Use plain LoRA."
        )
    if not is_lora:
        serving = Serving.FULL_WEIGHTS
    elif getattr(model, "is_loaded_in_4bit", False):
        serving = Serving.QUANTIZED_BASE
    elif serve_adapter:
        serving = Serving.ADAPTER
    else:
        serving = Serving.MERGE_AWARE if merge_aware else Serving.MERGED
    lora = None
    if is_lora:
        rank = max(max([c.r, *c.rank_pattern.values()]) for c in model.peft_config.values())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        adapted = sum(m.get_base_layer().out_features * m.get_base_layer().in_features for m in layers)
        lora = _Lora(rank, trainable, adapted)
    dtype = model.get_input_embeddings().weight.dtype
    device = "cpu" if args.use_cpu or not torch.cuda.is_available() else "cuda"
    return _derive(
        args,
        model_path=model.name_or_path,
        options=vllm_options or VLLMConfig(),
        device=device,
        dtype=dtype,
        serving=serving,
        merge_aware=merge_aware,
        shape=shape_of(model.config, args.trust_remote_code),
        lora=lora,
        sequence_tokens=sequence_tokens,
        memory=read_device_memory() if device == "cuda" else None,
        # A direct user's GRPOConfig is taken as written: the plan reports whether it fits.
        checkpointing=bool(args.gradient_checkpointing),
        smaller_micro_batches=False,
        asynchronous=asynchronous,
        bitwise=bitwise_logprobs,
    )


def _derive(
    args: Any,
    *,
    model_path: str,
    options: VLLMConfig,
    device: str,
    dtype: torch.dtype,
    serving: Serving,
    merge_aware: str | None,
    shape: ModelShape | None,
    lora: _Lora | None,
    sequence_tokens: int | None,
    memory: DeviceMemory | None,
    checkpointing: bool | None,
    smaller_micro_batches: bool,
    asynchronous: AsyncMode | None = None,
    bitwise: bool = False,
    nf4_values: bool = False,
) -> RunPlan:
    """The plan both constructors end in: every derived setting, from explicit inputs.

    ``checkpointing`` is the run's gradient checkpointing (None: the plan decides); with ``smaller_micro_batches``
    the plan may split ``args``'s micro-batch into smaller ones where training's activations would not fit.
    """
    four_bit = serving is Serving.QUANTIZED_BASE
    fp32_head = bool(args.cast_lm_head_to_fp32)
    size_engine = functools.partial(
        _size_engine,
        model_path=model_path,
        options=options,
        device=device,
        dtype=dtype if options.dtype == "auto" else getattr(torch, options.dtype),
        shape=shape,
        budget=args.vllm_max_model_length,
        # TRL's generation batch, as GRPOTrainer gives it to VLLMGeneration (one engine per rank: no tensor parallel).
        generation_batch=args.per_device_train_batch_size * args.steps_per_generation,
        sequence_tokens=sequence_tokens,
        max_lora_rank=engine_lora_rank(lora.rank) if serving.serves_adapter and lora else None,
        fp32_head=fp32_head,
        four_bit=four_bit,
        trust_remote_code=bool(args.trust_remote_code),
        # Each rank samples its own completions: with one seed, groups split over ranks would repeat.
        seed=args.seed + args.process_index,
        total=memory.total if memory else None,
        batch_invariant=bitwise,
        nf4_values=nf4_values,
    )
    spec, kv, engine_weights = size_engine()
    bitwise_mode = BitwiseMode(bool(args.vllm_importance_sampling_correction)) if bitwise else None
    sequence_tokens = spec.sequence_tokens
    requested = TrainingPlan(
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation,
        gradient_checkpointing=True if checkpointing is None else checkpointing,
        one_forward=scores_in_training_forward(args),
        old_logprobs_needed=trl_scores_old_logprobs(args),
    )

    def run_plan(training: TrainingPlan, needs: MemoryPlan | None) -> RunPlan:
        return RunPlan(
            device=device,
            dtype=dtype,
            serving=serving,
            shared_base=serving.lora,
            merge_aware=merge_aware,
            engine=spec,
            training=training,
            memory=needs,
            asynchronous=asynchronous,
            bitwise=bitwise_mode,
        )

    if device != "cuda" or memory is None or shape is None or engine_weights is None:
        return run_plan(requested, None)
    if lora is not None:  # the base is the engine's copy: the trainer adds only its adapter
        trainer_weights, states = training_bytes(lora.parameters, LORA_ITEMSIZE)
    else:
        trainer_weights, states = training_bytes(shape.parameters, dtype.itemsize)

    def memory_plan(training: TrainingPlan) -> MemoryPlan:
        return plan_memory(
            trainer_weights=trainer_weights,
            trainer_states=states,
            engine_weights=engine_weights,
            merged_weights=lora.adapted_weights if lora is not None and serving.merges else 0,
            kv_cache=kv or 0,
            cuda_graphs=not options.enforce_eager,
            activations=training_activation_bytes(
                shape,
                dtype,
                training.micro_batch_size,
                sequence_tokens or 0,
                args.max_completion_length,
                training.gradient_checkpointing,
                fp32_head,
                bitwise,
            ),
            free=memory.free,
            total=memory.total,
            # A LoRA run's base is the engine's weights: they stay while the engine sleeps.
            engine_weights_stay=lora is not None,
            host_free=memory.host_free,
            # The engine generates while the trainer trains: its KV cache stays awake beside training's activations.
            overlapped=asynchronous is not None,
        )

    whole_batch = memory_plan(requested)
    if options.kv_cache == "batch" and kv and whole_batch.generation_peak > whole_batch.free:
        # Long sequences: a KV cache for part of the batch at full length, where one sequence fits; vLLM queues the
        # rest (the generation takes longer, the run does not stop).
        room = whole_batch.free - (whole_batch.generation_peak - whole_batch.kv_cache)
        per_token = shape.kv_bytes_per_token(dtype if options.dtype == "auto" else getattr(torch, options.dtype))
        if room >= kv_cache_bytes(per_token, 1, 0, spec.options.max_model_len or 0):  # vLLM's least: one sequence
            spec, kv, _ = size_engine(kv_room=room)
    training = requested
    if checkpointing is None or smaller_micro_batches:
        values = (sequence_tokens or 0) * shape.hidden_size  # a sequence's hidden states
        training = fitting_training(requested, memory_plan, checkpointing, smaller_micro_batches, values)
    return run_plan(training, memory_plan(training))


def standalone_engine(
    model_path: str,
    options: VLLMConfig | None = None,
    *,
    generation_batch: int = MIN_NUM_SEQS,
    dtype: torch.dtype = torch.bfloat16,
    max_lora_rank: int | None = None,
    fp32_head: bool = False,
    seed: int = 0,
) -> EngineSpec:
    """An engine for generating from ``model_path`` outside a training run (tests, benchmarks), sized as a run's
    engine is: ``generation_batch`` sequences of ``max_model_len`` tokens (``vllm.max_model_len``, else the model's
    context), on this process's device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = options or VLLMConfig()
    spec, _, _ = _size_engine(
        model_path=model_path,
        options=options,
        device=device,
        dtype=dtype if options.dtype == "auto" else getattr(torch, options.dtype),
        shape=model_shape(model_path),
        budget=None,
        generation_batch=generation_batch,
        sequence_tokens=None,
        max_lora_rank=max_lora_rank,
        fp32_head=fp32_head,
        four_bit=False,
        trust_remote_code=False,
        seed=seed,
        total=torch.cuda.mem_get_info()[1] if device == "cuda" else None,
    )
    return spec


def _size_engine(
    *,
    model_path: str,
    options: VLLMConfig,
    device: str,
    dtype: torch.dtype,
    shape: ModelShape | None,
    budget: int | None,
    generation_batch: int,
    sequence_tokens: int | None,
    max_lora_rank: int | None,
    fp32_head: bool,
    four_bit: bool,
    trust_remote_code: bool,
    seed: int,
    total: int | None,
    batch_invariant: bool = False,
    nf4_values: bool = False,
    kv_room: int | None = None,
) -> tuple[EngineSpec, int | None, int | None]:
    """The engine's spec, its KV cache's bytes and its weights' bytes (None: unknown).

    ``dtype`` is the engine's; ``budget`` the run's prompt + completion tokens, where ``vllm.max_model_len`` is
    unset; ``total`` the device's bytes (None on CPU). The KV cache holds the batch at full length, or, with
    ``kv_room`` bytes less than that, what fits in them.
    """
    max_model_len = options.max_model_len or derived_max_model_len(budget, shape.context if shape else None)
    if max_model_len:
        sequence_tokens = min(max_model_len, sequence_tokens or max_model_len)
    kv_per_token = shape.kv_bytes_per_token(dtype) if shape is not None else None
    kv = full_length = None
    if kv_per_token and sequence_tokens:
        kv = kv_cache_bytes(kv_per_token, generation_batch, sequence_tokens, max_model_len or 0)
        if kv_room is not None and kv_room < kv:
            kv = kv_room
            full_length = kv_room // kv_cache_bytes(kv_per_token, 1, sequence_tokens)
    weights = weight_bytes(shape, dtype, four_bit) if shape is not None else None
    fraction, engine_kv = engine_memory(options, device, weights, kv, total)
    spec = EngineSpec(
        model_path=model_path,
        options=dataclasses.replace(options, max_model_len=max_model_len),
        dtype=str(dtype).removeprefix("torch."),
        max_lora_rank=max_lora_rank,
        fp32_head=fp32_head,
        quantization="bitsandbytes" if four_bit else None,
        trust_remote_code=trust_remote_code,
        generation_batch=generation_batch,
        sequence_tokens=sequence_tokens,
        memory_fraction=fraction,
        kv_cache_bytes=engine_kv,
        seed=seed,
        batch_invariant=batch_invariant,
        full_length_sequences=full_length,
        nf4_values=nf4_values,
    )
    return spec, kv, weights


def _adapted(config: Config, name: str) -> bool:
    """Whether ``config``'s LoRA adapts the linear layer ``name``."""
    if config.lora_target_modules is None:
        return config.lora_target_linear
    leaf = name.rpartition(".")[2]
    return any(leaf == target or fnmatch.fnmatch(name, target) for target in config.lora_target_modules)
