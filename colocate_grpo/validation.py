"""The checks a config passes before anything heavy starts: ranges, combinations and the ``trl:`` block.

Each problem is a :class:`~colocate_grpo.config.ConfigError` whose message names the key and the fix.
"""

from __future__ import annotations

import typing
from typing import Any

from colocate_grpo.config import OWN_TRL_KEYS, Config, ConfigError, coerce_value, did_you_mean


def check_config(config: Config) -> None:
    """Raise a :class:`ConfigError` for the first problem ``config`` has."""
    _check_ranges(config)
    _check_combinations(config)


# GRPOConfig fields that the top level or the vllm: block sets; one place for each setting.
_TRL_KEYS_SET_ELSEWHERE = {
    "learning_rate": "learning_rate",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_steps": "max_steps",
    "output_dir": "output_dir",
    "seed": "seed",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_max_model_length": "vllm.max_model_len",
}
# Server-mode settings: there is no server here.
_SERVER_KEYS = {
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
}


def _check_ranges(c: Config) -> None:
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'{key}' {message}")

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
    require(c.max_steps >= 1, "max_steps", f"must be at least 1, got {c.max_steps}.")
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
        c.max_completion_length >= 1, "trl.max_completion_length", f"must be at least 1, got {c.max_completion_length}."
    )
    interval = c.trl_settings["vllm_merge_check_interval"]
    require(interval >= 0, "trl.vllm_merge_check_interval", f"must be 0 (off) or positive, got {interval}.")
    num_generations = c.trl_settings["num_generations"]
    require(
        num_generations >= 2,
        "trl.num_generations",
        f"must be at least 2 (GRPO compares completions of one prompt), got {num_generations}.",
    )
    batch = c.micro_batch_size * c.gradient_accumulation_steps
    require(
        batch % num_generations == 0,
        "micro_batch_size",
        f"x gradient_accumulation_steps ({batch}) must be a multiple of trl.num_generations "
        f"({num_generations}): each prompt's completions are scored as a group.",
    )
    if c.vllm.max_model_len is not None:
        require(
            c.vllm.max_model_len >= c.max_prompt_length + c.max_completion_length,
            "vllm.max_model_len",
            f"({c.vllm.max_model_len}) is below max_prompt_length + trl.max_completion_length "
            f"({c.max_prompt_length} + {c.max_completion_length}); raise it or shorten those.",
        )


def _check_combinations(c: Config) -> None:
    _check_trl_block(c.trl)
    if c.task is not None and c.dataset is not None:
        raise ConfigError("Set either 'task' or 'dataset', not both: put 'task: null' next to your 'dataset' block.")
    if c.task is None and c.dataset is None:
        raise ConfigError("Nothing to train on: set 'task: arithmetic' or a 'dataset' block with a 'path'.")
    if not c.reward_funcs:
        raise ConfigError(
            "'trl.reward_funcs' is empty: list at least one reward function as a dotted path, e.g. "
            "colocate_grpo.tasks.accuracy_reward or my_rewards.correctness."
        )
    if c.lora_target_modules is not None and c.lora_target_linear:
        raise ConfigError("Set either 'lora_target_linear: true' or 'lora_target_modules', not both.")
    if c.load_in_4bit and c.load_in_8bit:
        raise ConfigError("Set at most one of 'load_in_4bit' and 'load_in_8bit'.")
    if c.load_in_8bit:
        raise ConfigError(
            "'load_in_8bit: true' cannot be served in colocate mode: vLLM has no in-flight 8-bit quantization of a "
            "base (TRL's colocated engine refuses it too), so the engine could not hold what the trainer trains. "
            "Remove it and train a bf16 base with LoRA (the memory plan printed at start says whether it fits), or "
            "pick a smaller base_model."
        )
    if c.load_in_4bit and c.trl.get("vllm_lora_sync") is False:
        raise ConfigError(
            "'load_in_4bit: true' is served as the 4-bit base with the adapter ('trl.vllm_lora_sync: false' asks for "
            "merged weights, which a 4-bit base cannot take exactly): remove 'trl.vllm_lora_sync: false'."
        )
    merge_aware = c.lora_merge_aware not in (None, "auto")
    if c.adapter is None and (merge_aware or c.load_in_4bit or c.load_in_8bit or c.peft_use_dora):
        raise ConfigError(
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
                raise ConfigError(
                    f"'lora_merge_aware: {c.lora_merge_aware}' cannot be combined with '{key}: true': merge-aware "
                    "LoRA needs plain LoRA on an unquantized base whose merged weights are what vLLM serves. "
                    f"Remove '{key}' or 'lora_merge_aware'."
                )
    if c.trl.get("vllm_tensor_parallel_size", 1) != 1:
        raise ConfigError(
            f"'trl.vllm_tensor_parallel_size: {c.trl['vllm_tensor_parallel_size']}': each process has its own "
            "colocated engine on its own GPU (launch several with accelerate or torchrun for data parallel training). "
            "Remove it, or use TRL's server mode to generate on separate GPUs."
        )
    if c.trl.get("cast_lm_head_to_fp32"):
        if c.adapter is None:
            raise ConfigError(
                "'trl.cast_lm_head_to_fp32: true' with full fine-tuning would train an fp32 head, and vLLM holds the "
                "head in the model's dtype (it computes the logits in fp32 from it): use 'adapter: lora', or remove "
                "'trl.cast_lm_head_to_fp32'."
            )
        if "lm_head" in (c.lora_target_modules or []):
            raise ConfigError(
                "'trl.cast_lm_head_to_fp32: true' needs a head without LoRA: remove lm_head from "
                "'lora_target_modules', or remove 'trl.cast_lm_head_to_fp32'."
            )
    key = "load_in_4bit" if c.load_in_4bit else "trl.vllm_lora_sync"
    if c.trl.get("vllm_lora_sync") or c.load_in_4bit:
        if c.adapter is None:
            raise ConfigError(
                f"'{key}: true' serves a LoRA adapter on the base, and full fine-tuning has none: set 'adapter: "
                f"lora' or remove '{key}'."
            )
        if c.peft_use_dora:
            raise ConfigError(
                f"'{key}: true' serves the adapter with vLLM's LoRA kernels, which have no DoRA: remove "
                f"'peft_use_dora' or '{key}'."
            )
        outside = sorted(set(c.lora_target_modules or []) & {"embed_tokens", "lm_head"})
        if outside:
            raise ConfigError(
                f"'lora_target_modules' lists {', '.join(outside)}, which vLLM does not serve LoRA on with "
                f"'{key}: true' (it serves the decoder's linear layers): remove them"
                + ("." if c.load_in_4bit else ", or remove 'trl.vllm_lora_sync' to serve merged weights.")
            )
    if c.peft_use_dora:
        raise ConfigError(
            "'peft_use_dora: true' cannot be served in colocate mode yet: vLLM has no DoRA kernels, and the merged "
            "sync writes W + s*B@A without DoRA's magnitude, so the engine would sample from another policy than the "
            "one trained. Remove 'peft_use_dora' (plain LoRA, merge-aware by default)."
        )


def _check_trl_block(trl: dict[str, Any]) -> None:
    from trl import GRPOConfig  # deferred: importing TRL takes seconds, the rest of this module doesn't

    hints = typing.get_type_hints(GRPOConfig)
    known = set(hints) | set(OWN_TRL_KEYS)
    for key, value in trl.items():
        if key in _TRL_KEYS_SET_ELSEWHERE:
            raise ConfigError(f"Set '{_TRL_KEYS_SET_ELSEWHERE[key]}' instead of 'trl.{key}' (one place per setting).")
        if key == "vllm_sync_interval":
            raise ConfigError(
                "'trl.vllm_sync_interval' is not supported: the colocated engine gets the new weights before every "
                "generation (syncing is cheap in-process, and stale weights would make sampling off-policy). Remove it."
            )
        if key in _SERVER_KEYS:
            raise ConfigError(f"'trl.{key}' is a server-mode setting; colocate_grpo runs vLLM in-process. Remove it.")
        if key not in known:
            raise ConfigError(
                f"Unknown key 'trl.{key}'.{did_you_mean(key, known)} The trl: block takes TRL GRPOConfig fields."
            )
        coerce_value(value, OWN_TRL_KEYS.get(key) or hints[key], f"trl.{key}")
    if trl.get("use_vllm") is False:
        raise ConfigError("'trl.use_vllm: false' is not supported: colocate_grpo generates with vLLM. Remove it.")
    if trl.get("vllm_mode", "colocate") != "colocate":
        raise ConfigError(
            f"'trl.vllm_mode: {trl['vllm_mode']}' is not supported: colocate_grpo runs vLLM inside the trainer "
            "process. Use 'vllm_mode: colocate' (or leave it out)."
        )
