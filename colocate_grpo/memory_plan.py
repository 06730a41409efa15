"""The memory plan's byte arithmetic: what a run needs on the device, by part.

A colocated run peaks while the engine generates: the trainer's weights, gradients and
optimizer states stay on the device, and the engine's weights, KV cache, CUDA graphs and
forward activations join them. Training then needs its own activations while the engine
sleeps. :func:`plan_memory` adds up the parts that :mod:`colocate_grpo.plan` sized from
the model's shape and the run's settings, so that a run that cannot fit is refused with the
numbers and the fixes before anything heavy starts. Nothing here reads a config: every
number comes in as an argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from colocate_grpo.config import Config, ConfigError, VLLMConfig

if TYPE_CHECKING:
    from colocate_grpo.training_plan import TrainingPlan

GIB = 2**30
# gpu_memory_utilization where the engine cannot be sized (a model whose config transformers cannot read).
FALLBACK_FRACTION = 0.3
# Room that vLLM's forward needs besides weights and KV cache (its profile run at 4096 batched tokens).
ACTIVATION_MARGIN_BYTES = 2 * GIB
# vLLM's CUDA graphs for batches up to the engine's max_num_seqs: 0.19 GiB at 1.5B with 64 sequences on the H200
# (bench/FINDINGS.md); larger models and batches take more, hence the round margin.
CUDA_GRAPH_BYTES = GIB
# vLLM's KV cache blocks hold 16 to 128 tokens (by attention backend; 128 on CPU) and a sequence's last block
# is partly empty: its length rounded up to 64 tokens, plus 64, covers every block size up to 128.
_KV_BLOCK_TOKENS = 64
# A trainable parameter's gradient and AdamW's two moments: three more copies of it. LoRA weights are fp32 (PEFT
# upcasts adapters), and so are their gradients and moments; full fine-tuning keeps all in the model's dtype.
_TRAINING_COPIES = 3
LORA_ITEMSIZE = 4
# A 4-bit base's linear weights: two NF4 codes a byte, and vLLM's fp32 scale per block of 64 weights (the trainer
# computes with the same). Embeddings, head and norms stay in the model's dtype.
_NF4_BYTES_PER_WEIGHT = 0.5 + 4 / 64
# The allocator's room beside training's activations, as a share of them. On an H100 a 7B run whose plan left
# none ran out of memory in its first backward pass with 1.3 GiB of its estimate unused; at 1.5B the device held
# 9% more than torch allocated (bench/results/2026-12-06-h100-d521acd).
ALLOCATOR_SLACK = 0.25
# The backward of a decoder layer holds its activations' gradients beside what the layer kept: 0.2 to 0.25 of a
# layer's activations more at the 1.5B and 7B shapes with checkpointing (the benchmark's training-step experiment).
_BACKWARD_WORKING = 0.3
# TRL's fused head scores a micro-batch's completion tokens in tiles of this many tokens and vocabulary entries
# (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
_HEAD_TILE_TOKENS, _HEAD_TILE_VOCAB = 4096, 32768
# The bitwise mode's head (colocate_grpo.bitwise) scores its chunk of tokens over the whole vocabulary as vLLM's
# sampler does: the logits in bf16 and fp32, their log-softmax and its exp in fp32 (and in the backward the fp32
# gradient with its bf16 cast), about 16 bytes a logit at its peak.
_BITWISE_HEAD_BYTES_PER_LOGIT = 16
# Merged serving on a shared base records what each merge overwrote (colocate_grpo.lora.merge_in_place): a byte per
# merged weight, and 10 for each weight whose change needs more. Room for 2% of them, where a long run's are far fewer;
# the merge kernels allocate this room for each weight (lora.outlier_capacity).
_MERGE_RECORD_OUTLIER_BYTES_PER_WEIGHT = 0.02 * 10
_MERGE_RECORD_BYTES_PER_WEIGHT = 1 + _MERGE_RECORD_OUTLIER_BYTES_PER_WEIGHT


class MemoryPlanError(ConfigError):
    """The run cannot fit on the device; the message gives the plan's numbers and the fixes."""


class DeviceMemoryError(RuntimeError):
    """The device ran out of memory during a run; the message names the phase, the numbers and the fixes."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a model, read from its config alone (no weights).

    Attributes:
        parameters: all parameters (a tied head counted once).
        linear_shapes: (name, out_features, in_features) of every linear layer but the head.
        layers, hidden_size, intermediate_size, vocab_size: the architecture's dimensions.
        kv_values_per_token: keys and values one token keeps in the KV cache, all layers (None: unknown).
        context: the longest sequence the model was built for (``max_position_embeddings``; None: unknown).
    """

    parameters: int
    linear_shapes: list[tuple[str, int, int]]
    layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    kv_values_per_token: int | None
    context: int | None = None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int | None:
        """Bytes one token takes in a KV cache of ``dtype``; None when the config does not say."""
        return None if self.kv_values_per_token is None else self.kv_values_per_token * dtype.itemsize


def model_shape(model_path: str, trust_remote_code: bool = False) -> ModelShape | None:
    """The shape of the model at ``model_path`` from its config file; None if transformers cannot read it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):  # an architecture only vLLM knows, or no config to read
        return None
    return shape_of(config, trust_remote_code)


def shape_of(config: object, trust_remote_code: bool = False) -> ModelShape | None:
    """The shape of a model with this transformers ``config``, built on the meta device; None if it cannot be."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None
    head = model.get_output_embeddings()
    linears = [
        (name, module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]
    text = config.get_text_config()
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        linear_shapes=linears,
        layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        vocab_size=text.vocab_size,
        kv_values_per_token=_kv_values_per_token(text),
        context=getattr(text, "max_position_embeddings", None),
    )


def head_size(text_config: object) -> int | None:
    """An attention head's size in a model of this (text) config: its ``head_dim``, which a config may leave out or
    set to None, else the hidden size over the heads; None where the config has neither."""
    heads = getattr(text_config, "num_attention_heads", None)
    hidden = getattr(text_config, "hidden_size", None)
    return getattr(text_config, "head_dim", None) or (hidden // heads if heads and hidden else None)


def _kv_values_per_token(text_config: object) -> int | None:
    layers = getattr(text_config, "num_hidden_layers", None)
    heads = getattr(text_config, "num_attention_heads", None)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = head_size(text_config)
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim


def kv_cache_bytes(kv_bytes_per_token: int, sequences: int, sequence_tokens: int, max_model_len: int = 0) -> int:
    """Bytes of KV cache that hold ``sequences`` sequences of ``sequence_tokens`` tokens at once, and never
    less than one sequence of ``max_model_len`` tokens (vLLM does not start with less).

    Counts keys and values of every layer at full attention (an upper bound for sliding-window or hybrid models).
    """

    def whole_blocks(tokens: int) -> int:  # and a block to spare: a sequence's last block is partly empty
        return (-(-tokens // _KV_BLOCK_TOKENS) + 1) * _KV_BLOCK_TOKENS

    return kv_bytes_per_token * max(whole_blocks(sequence_tokens) * sequences, whole_blocks(max_model_len))


def weight_bytes(shape: ModelShape, dtype: torch.dtype, four_bit: bool = False) -> int:
    """Bytes of the model's weights in ``dtype``; with ``four_bit``, its linear weights in NF4 (embeddings, head and
    norms stay in ``dtype``)."""
    weights = shape.parameters * dtype.itemsize
    if four_bit:
        linear = sum(out * in_ for _, out, in_ in shape.linear_shapes)
        weights += int(linear * (_NF4_BYTES_PER_WEIGHT - dtype.itemsize))
    return weights


def engine_bytes(weights: int, kv_cache: int, cuda_graphs: bool) -> int:
    """Device bytes the engine takes while it generates: weights, KV cache, forward and (if on) CUDA graphs."""
    return weights + kv_cache + ACTIVATION_MARGIN_BYTES + (CUDA_GRAPH_BYTES if cuda_graphs else 0)


def engine_memory(
    options: VLLMConfig, device: str, weights: int | None, kv_cache: int | None, total: int | None
) -> tuple[float, int | None]:
    """vLLM's ``gpu_memory_utilization`` and KV cache bytes for the engine (None: vLLM sizes the cache).

    ``weights`` and ``kv_cache`` are the engine's bytes (None: unknown); ``total`` the device's bytes.
    """
    fraction = options.gpu_memory_utilization
    needed = kv_cache if options.kv_cache == "batch" else None
    if device != "cuda":
        # vLLM on CPU sizes the KV cache as (fraction of RAM) minus this process's RSS, which goes negative once a
        # long-lived process (a notebook, a test session) has loaded models; given a size, it ignores the fraction.
        largest = int(options.cpu_kv_cache_gib * GIB)
        return (FALLBACK_FRACTION if fraction == "auto" else fraction), min(needed or largest, largest)
    if needed is None or weights is None or total is None:
        return (FALLBACK_FRACTION if fraction == "auto" else fraction), None
    engine = engine_bytes(weights, needed, cuda_graphs=not options.enforce_eager)
    if fraction == "auto":
        return engine / total, needed
    if engine > fraction * total:  # the batch's cache does not fit the fraction: vLLM sizes it from the fraction
        return fraction, None
    return fraction, needed


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes a run needs, by part, against what the device has free before the model loads.

    Attributes:
        trainer_weights: the trainer's model (base weights and adapters; the adapters alone where the
            base weights are the engine's, ``RunPlan.shared_base``).
        trainer_states: gradients and AdamW moments of the trainable parameters.
        engine_weights: the engine's weights (the LoRA merged into them at every sync, unless the
            engine serves the adapter).
        merge_record: with merged serving on a shared base, what restores the base after each
            generation (about a byte per merged weight), on the device.
        merge_record_host: the record's byte per merged weight where it is kept in host memory
            instead (the device would not hold it beside the rest); ``merge_record`` then counts only
            the values whose change needs more than a byte, which stay on the device.
        kv_cache: the engine's KV cache, sized to the generation batch at full length.
        engine_runtime: vLLM's forward activations and, with CUDA graphs, the graphs' memory.
        activations: training's activations for one micro-batch, its head and loss included
            (:func:`training_activation_bytes`, checked against measured peaks by the benchmark's
            ``training-step`` experiment).
        asleep: the engine's bytes that stay on the device while it sleeps and the trainer trains: the
            weights where they are the trainer's base (one shared copy), and its CUDA graphs.
        free, total: the device's free and total bytes.
        overlapped: whether the engine generates while the trainer trains (``async_generation``): then
            training's activations live beside the KV cache, and count towards the peak.
    """

    trainer_weights: int
    trainer_states: int
    engine_weights: int
    merge_record: int
    merge_record_host: int
    kv_cache: int
    engine_runtime: int
    activations: int
    free: int
    total: int
    asleep: int = 0
    overlapped: bool = False

    @property
    def generation_peak(self) -> int:
        """Bytes on the device while the engine generates: everything but training's activations."""
        trainer = self.trainer_weights + self.trainer_states
        return trainer + self.engine_weights + self.merge_record + self.kv_cache + self.engine_runtime

    @property
    def allocator_slack(self) -> int:
        """Room for torch's allocator beside training's activations: blocks it caches from one phase to the next
        cannot always hold the next phase's tensors (``ALLOCATOR_SLACK`` of the activations)."""
        return int(ALLOCATOR_SLACK * self.activations)

    @property
    def training_peak(self) -> int:
        """Bytes on the device while the trainer trains and the engine sleeps (its KV cache freed), with the
        allocator's slack."""
        return self.trainer_weights + self.trainer_states + self.asleep + self.activations + self.allocator_slack

    @property
    def peak(self) -> int:
        """Bytes on the device at the run's peak: the larger of generation's and training's, or, where the engine
        generates while the trainer trains, both at once, with the allocator's slack beside the activations (two
        streams allocate then: at 1.5B on an H100 torch reserved 2.6 GiB more than it allocated, the device's peak
        15% over a plan without it; bench/results/2026-12-07-h100-aa92df6)."""
        if self.overlapped:
            return self.generation_peak + self.activations + self.allocator_slack
        return max(self.generation_peak, self.training_peak)

    @property
    def fits(self) -> bool:
        """Whether the peak fits in the free memory."""
        return self.peak <= self.free

    def summary(self) -> str:
        """One line: the parts in GiB, their sum, the free memory, and the activations estimate."""
        g = _gib
        record = f" + {g(self.merge_record)} merge record" if self.merge_record else ""
        if self.merge_record_host:
            record += f" ({g(self.merge_record_host)} more in host memory)"
        if self.overlapped:
            return (
                f"Memory plan: trainer {g(self.trainer_weights)} weights + {g(self.trainer_states)} gradients and "
                f"optimizer, engine {g(self.engine_weights)} weights{record} + {g(self.kv_cache)} KV cache + "
                f"{g(self.engine_runtime)} runtime + training activations about {g(self.activations)} + "
                f"{g(self.allocator_slack)} allocator slack = "
                f"{g(self.peak)} GiB while generating and training at once, of {g(self.free)} GiB free "
                f"({g(self.total)} GiB device)."
            )
        return (
            f"Memory plan: trainer {g(self.trainer_weights)} weights + {g(self.trainer_states)} gradients and "
            f"optimizer, engine {g(self.engine_weights)} weights{record} + {g(self.kv_cache)} KV cache + "
            f"{g(self.engine_runtime)} runtime = {g(self.generation_peak)} GiB while generating; "
            f"{g(self.training_peak)} GiB while training (activations {g(self.activations)} + "
            f"{g(self.allocator_slack)} allocator slack, the engine's {g(self.asleep)} kept asleep); of "
            f"{g(self.free)} GiB free ({g(self.total)} GiB device)."
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def size_text(n: int) -> str:
    """``n`` bytes with their unit: GiB to two decimals, or MiB below a tenth of a GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def plan_memory(
    *,
    trainer_weights: int,
    trainer_states: int,
    engine_weights: int,
    merged_weights: int,
    kv_cache: int,
    cuda_graphs: bool,
    activations: int,
    free: int,
    total: int,
    engine_weights_stay: bool = True,
    host_free: int | None = None,
    overlapped: bool = False,
) -> MemoryPlan:
    """The run's memory plan on a device with ``free`` of ``total`` bytes, from its parts in bytes.

    Args:
        merged_weights: how many base weights a merged sync overwrites in place (0 where nothing is merged
            into a shared base); the record that restores them takes about a byte each.
        cuda_graphs: whether the engine captures CUDA graphs (their memory is counted; they stay while it sleeps).
        engine_weights_stay: whether the engine's weights stay on the device while it sleeps (they are the
            trainer's base), rather than being freed.
        host_free: host memory available, in bytes. Where the merge record would not fit on the device and
            its byte per merged weight fits in the host memory that loading the model leaves, the plan keeps
            it there (``MemoryPlan.merge_record_host``), also when the device is short even so. None: the
            device alone.
        overlapped: the engine generates while the trainer trains (``MemoryPlan.overlapped``).
    """
    plan = MemoryPlan(
        trainer_weights=trainer_weights,
        trainer_states=trainer_states,
        engine_weights=engine_weights,
        merge_record=int(merged_weights * _MERGE_RECORD_BYTES_PER_WEIGHT),
        merge_record_host=0,
        kv_cache=kv_cache,
        engine_runtime=engine_bytes(0, 0, cuda_graphs),
        activations=activations,
        free=free,
        total=total,
        asleep=(engine_weights if engine_weights_stay else 0) + (CUDA_GRAPH_BYTES if cuda_graphs else 0),
        overlapped=overlapped,
    )
    if plan.fits or not merged_weights or host_free is None:
        return plan
    on_host = _record_on_host(plan)
    # Where neither fits, the refusal states the smaller need: the one that a larger card would meet.
    return on_host if _host_bytes_for_record(on_host) <= host_free else plan


def training_bytes(trainable_parameters: int, itemsize: int) -> tuple[int, int]:
    """The trainable parameters' bytes and those of their gradients and AdamW's two moments, in ``itemsize``."""
    weights = trainable_parameters * itemsize
    return weights, _TRAINING_COPIES * weights


def lora_parameters(rank: int, adapted: list[tuple[int, int]]) -> int:
    """Parameters of LoRA factors of ``rank`` on linears of these (out_features, in_features)."""
    return sum(rank * (out + in_) for out, in_ in adapted)


def _record_on_host(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` with its merge record's byte per merged weight in host memory, the outliers on the device."""
    merged_weights = round(plan.merge_record / _MERGE_RECORD_BYTES_PER_WEIGHT)
    return dataclasses.replace(
        plan,
        merge_record=int(merged_weights * _MERGE_RECORD_OUTLIER_BYTES_PER_WEIGHT),
        merge_record_host=merged_weights,
    )


def _host_bytes_for_record(on_host: MemoryPlan) -> int:
    """Host memory that a plan keeping its merge record there (``on_host``) needs: the model passes through
    host memory as it loads (models.load_model), and the record must fit beside it."""
    return on_host.merge_record_host + on_host.engine_weights


def training_activation_bytes(
    shape: ModelShape,
    dtype: torch.dtype,
    micro_batch: int,
    sequence_tokens: int,
    completion_tokens: int,
    gradient_checkpointing: bool,
    fp32_head: bool,
    bitwise: bool = False,
) -> int:
    """Training's activations for one micro-batch at their peak, in the backward pass, in bytes.

    What a decoder layer keeps for its backward, per token (:func:`layer_activation_bytes`), for every layer,
    or with gradient checkpointing each layer's input and one layer's worth recomputed; the backward of the
    layer it is in adds its gradients' working memory (``_BACKWARD_WORKING``). The head adds its own
    (:func:`head_bytes`; ``bitwise``: the bitwise log-probabilities mode's head).
    """
    tokens = micro_batch * sequence_tokens
    layer = tokens * layer_activation_bytes(shape, dtype)
    if gradient_checkpointing:
        kept = tokens * shape.layers * shape.hidden_size * dtype.itemsize + layer
    else:
        kept = shape.layers * layer
    return int(kept + _BACKWARD_WORKING * layer) + head_bytes(
        shape, dtype, micro_batch * completion_tokens, fp32_head, bitwise
    )


def layer_activation_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """Bytes a decoder layer keeps for its backward, per token: the inputs of its projections and of attention
    (queries, keys, values, output) and of the gated MLP's products, about 7 hidden-sized and 4
    intermediate-sized tensors in ``dtype``, and a hidden-sized fp32 value of its RMSNorms.

    Measured on an H100 (the benchmark's training-step experiment, Qwen2.5 1.5B and 7B shapes, merge-aware
    LoRA): within 2% of what 28 layers kept at micro-batches of 32 and 64 without checkpointing."""
    return (7 * shape.hidden_size + 4 * shape.intermediate_size) * dtype.itemsize + 4 * shape.hidden_size


def head_bytes(
    shape: ModelShape, dtype: torch.dtype, completion_tokens: int, fp32_head: bool, bitwise: bool = False
) -> int:
    """The trainer's head's working memory for a micro-batch of ``completion_tokens`` tokens, in bytes.

    TRL's fused head never holds the completion's logits: it scores them a tile at a time
    (``_HEAD_TILE_TOKENS`` x ``_HEAD_TILE_VOCAB``), in the model's dtype. The fp32 head
    (``trl.cast_lm_head_to_fp32``, :mod:`colocate_grpo.head`) computes its tile in fp32 from an
    fp32 copy of one vocabulary tile of the head's weights, and keeps the completion's hidden
    states and their gradient in fp32. The bitwise mode's head scores ``bitwise.HEAD_CHUNK`` tokens at a time over
    the whole vocabulary (``_BITWISE_HEAD_BYTES_PER_LOGIT``).
    """
    if bitwise:
        from colocate_grpo.bitwise import HEAD_CHUNK

        return min(completion_tokens, HEAD_CHUNK) * shape.vocab_size * _BITWISE_HEAD_BYTES_PER_LOGIT
    vocab_tile = min(shape.vocab_size, _HEAD_TILE_VOCAB)
    if not fp32_head:
        return min(completion_tokens, _HEAD_TILE_TOKENS) * vocab_tile * dtype.itemsize
    tile = min(completion_tokens, _HEAD_TILE_TOKENS) * vocab_tile * 4
    return tile + vocab_tile * shape.hidden_size * 4 + 2 * completion_tokens * shape.hidden_size * 4


def refusal(plan: MemoryPlan, config: Config, serves_adapter: bool) -> str:
    """Why the run cannot fit, with its numbers and the fixes that exist (``serves_adapter``: the run serves its
    LoRA adapter rather than merged weights)."""
    fixes = [
        f"a smaller generation batch (micro_batch_size x gradient_accumulation_steps, now "
        f"{config.micro_batch_size} x {config.gradient_accumulation_steps}; the KV cache scales with it)",
        f"a shorter trl.max_completion_length (now {config.max_completion_length} tokens) or shorter prompts",
        "a smaller base_model",
    ]
    if config.adapter is None:
        fixes.insert(0, "'adapter: lora' instead of full fine-tuning (no gradients or optimizer states for the base)")
    elif not serves_adapter:
        fixes[:0] = [
            f"'trl.vllm_lora_sync: true' (vLLM serves the adapter: no merge, and no merge record, "
            f"{_gib(plan.merge_record)} GiB less)",
            "'load_in_4bit: true' (QLoRA: one copy of the base, its linear weights in 4 bits, about 0.28x their bf16 "
            "size)",
        ]
    if not config.vllm.enforce_eager:
        fixes.append(f"'vllm.enforce_eager: true' (saves the graphs' {_gib(CUDA_GRAPH_BYTES)} GiB, decodes slower)")
    if plan.overlapped:
        fixes[:0] = [
            f"a smaller KV cache: a smaller generation batch or shorter sequences (the KV cache, "
            f"{_gib(plan.kv_cache)} GiB, stays awake while the trainer trains)",
            f"a smaller micro_batch_size with more gradient_accumulation_steps (training's activations, about "
            f"{_gib(plan.activations)} GiB, live beside the KV cache)",
            "the sequential mode: remove 'async_generation' (the KV cache sleeps while the trainer trains)",
        ]
    on_host = _record_on_host(plan)
    if plan.merge_record and not plan.merge_record_host and on_host.fits:
        # The plan kept the record on the device because the host had no room for it.
        fixes.insert(
            0,
            f"{_gib(_host_bytes_for_record(on_host))} GiB of available host memory (the merge record's "
            f"{_gib(on_host.merge_record_host)} GiB would wait there, beside the model's weights as they load, and "
            f"the device would need {_gib(on_host.generation_peak)} GiB)",
        )
    short = plan.peak - plan.free
    while_ = "while the engine generates and the trainer trains" if plan.overlapped else "while the engine generates"
    return (
        f"This run needs {_gib(plan.peak)} GiB on the device {while_}, "
        f"{_gib(short)} GiB more than the {_gib(plan.free)} GiB free. {plan.summary()} "
        f"Fixes: {'; '.join(fixes)}."
    )


def out_of_memory_message(
    phase: str, plan: MemoryPlan | None, config: Config, training: TrainingPlan | None = None
) -> str:
    """What to tell a user whose run ran out of device memory in ``phase``, with the device's numbers now
    (``training``: the run plan's micro-batches and checkpointing, where the run was planned)."""
    lines = [f"The device ran out of memory during '{phase}'."]
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        lines.append(f"Now {_gib(free)} of {_gib(total)} GiB free; torch's peak allocation {_gib(peak)} GiB.")
    if plan is not None:
        lines.append(plan.summary())
    batch = f"{config.micro_batch_size} x {config.gradient_accumulation_steps}"
    checkpointing = config.gradient_checkpointing is True
    if training is not None:
        batch = f"{training.micro_batch_size} x {training.gradient_accumulation_steps}"
        checkpointing = training.gradient_checkpointing
    if phase == "train":
        fixes = [] if checkpointing else ["'gradient_checkpointing: true'"]
        fixes.append(f"a smaller micro_batch_size with more gradient_accumulation_steps (now {batch})")
    else:
        fixes = [f"a smaller generation batch (micro_batch_size x gradient_accumulation_steps, now {batch})"]
    fixes += [f"a shorter trl.max_completion_length (now {config.max_completion_length})", "a smaller base_model"]
    lines.append("Fixes: " + "; ".join(fixes) + ".")
    return " ".join(lines)


@contextlib.contextmanager
def device_memory_errors(
    phase: str | Callable[[], str],
    plan: MemoryPlan | None,
    config: Config,
    training: TrainingPlan | None = None,
) -> Iterator[None]:
    """Turn torch's out-of-memory error into one :class:`DeviceMemoryError` naming the phase and the fixes
    (``phase``: a name, or what returns it once the error happened; ``training``: the run plan's)."""
    try:
        yield
    except torch.OutOfMemoryError:
        name = phase if isinstance(phase, str) else phase()
        raise DeviceMemoryError(out_of_memory_message(name, plan, config, training)) from None
