"""Configs written for Axolotl, TRL, open-r1 and Unsloth, read as ours.

A flat TRL ``GRPOConfig`` YAML (TRL's CLI and open-r1's recipes), an Axolotl GRPO YAML and Unsloth's
notebook arguments (``FastLanguageModel.from_pretrained``, ``get_peft_model`` and ``GRPOConfig`` keyword
arguments as one mapping) share most settings with our schema under other names or places.
:func:`translate` moves each key whose meaning is exactly one of ours to that key, takes GRPOConfig fields
written at the top level as ``trl:`` keys, drops keys whose value asks for what a run does anyway, and
names every key that asks for something a run cannot do, with the reason and the nearest alternative.
``docs/migrating.md`` lists every key by source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colocate_grpo.config import OWN_TRL_KEYS, TRL_DEFAULTS, Config, DatasetConfig, VLLMConfig

# GRPOConfig fields that our top level or vllm: block holds; a trl: key of one of these names is moved there.
TRL_KEYS_WITH_A_PLACE: dict[str, str] = {
    "learning_rate": "learning_rate",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_steps": "max_steps",
    "output_dir": "output_dir",
    "seed": "seed",
    "logging_steps": "logging_steps",
    "save_steps": "save_steps",
    "gradient_checkpointing": "gradient_checkpointing",
    "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "vllm_max_model_length": "vllm.max_model_len",
    "use_cpu": "device",
}
# TRL's reward registry (trl/scripts/grpo.py): names its CLI takes without a dotted path.
TRL_REWARD_NAMES = {
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "think_format_reward": "trl.rewards.think_format_reward",
}


class _Refused(Exception):
    """A value that asks for what a run cannot do; the message says why and what to do instead."""


@dataclass(frozen=True)
class _Rule:
    """Where a foreign key goes: ``target`` (a dotted path of ours, None to drop it) and its value converted."""

    target: str | None
    convert: Callable[[Any], Any] = lambda value: value
    note: str = ""


def _to(target: str, convert: Callable[[Any], Any] = lambda value: value) -> _Rule:
    return _Rule(target, convert)


def _dropped_if(neutral: tuple[Any, ...], reason: str, note: str = "") -> _Rule:
    """A key whose ``neutral`` values ask for what a run does anyway (dropped); any other is refused for ``reason``."""

    def check(value: Any) -> Any:
        if value in neutral or (neutral == ("any",)):
            return None
        raise _Refused(reason)

    return _Rule(None, check, note)


def _refused(reason: str) -> _Rule:
    """A key a run cannot honour whatever its value, unless it is empty."""
    return _dropped_if((None, False, [], {}, ""), reason)


def _gradient_checkpointing(value: Any) -> Any:
    # Unsloth's "unsloth" mode is its own offloading checkpointing; TRL's is the nearest.
    return True if value == "unsloth" else value


def _adapter_for_use_peft(value: Any) -> Any:
    return "lora" if value else None


def _adapter_for_full_finetuning(value: Any) -> Any:
    return None if value else "lora"


def _placed(key: str, value: Any) -> Any:
    """A GRPOConfig field's value as its key of ours takes it (use_cpu: true is device: cpu)."""
    if key == "use_cpu" and isinstance(value, bool):
        return "cpu" if value else "auto"
    return value


def _warmup_ratio(value: Any) -> Any:
    # transformers 5 took warmup_ratio into warmup_steps: a float below 1 there is the share of the run.
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1:
        return float(value)
    raise _Refused("a warmup ratio is a share of the run, in [0, 1): give one, or trl.warmup_steps as a step count.")


def _attention(implementation: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value is True:
            return implementation
        if value in (False, None):
            return _DROP
        return value

    return convert


_DROP = object()  # a converted value meaning "nothing to set"
_SERVER = (
    "is a vLLM server setting: the engine runs in the trainer's process here. Remove it (to generate on GPUs of "
    "their own, use TRL's or Axolotl's server mode)."
)
_NO_EVAL = "needs evaluation, which a run here does not have (no eval dataset). Remove it."
_WANDB = (
    "is Axolotl's / open-r1's wandb setting: set 'trl.report_to: wandb' and WANDB_PROJECT, WANDB_ENTITY or "
    "WANDB_MODE=offline in the environment (docs/migrating.md)."
)
_OPEN_R1_REWARD = (
    "parametrises open-r1's reward registry, which does not run here: rewards are dotted paths to functions "
    "(trl.reward_funcs). Remove it, and give your reward its parameters in its own module."
)

# Unsloth's from_pretrained and get_peft_model arguments: a config with one of them is an Unsloth notebook's.
UNSLOTH_ARGUMENTS: dict[str, _Rule] = {
    "model_name": _to("base_model"),
    "max_seq_length": _to("vllm.max_model_len"),
    "gpu_memory_utilization": _to("vllm.gpu_memory_utilization"),
    "fast_inference": _dropped_if(
        (None, True), "a run always generates with the colocated vLLM engine (Unsloth's fast_inference). Remove it."
    ),
    "max_lora_rank": _dropped_if(("any",), "", "the engine's LoRA rank follows lora_r"),
    "full_finetuning": _to("adapter", _adapter_for_full_finetuning),
    "r": _to("lora_r"),
    "target_modules": _to("lora_target_modules"),
    "use_gradient_checkpointing": _to("gradient_checkpointing", _gradient_checkpointing),
    "random_state": _to("seed"),
    "bias": _dropped_if((None, "none"), "LoRA biases are not served by the engine. Remove it."),
    "loftq_config": _refused("LoftQ initialisation is not supported: LoRA starts from zero. Remove it."),
}
# Top-level keys of the other tools' configs, by what they become here.
FOREIGN_KEYS: dict[str, _Rule] = {
    # TRL's ModelConfig and ScriptArguments (flat TRL CLI / open-r1 YAMLs).
    "model_name_or_path": _to("base_model"),
    "model_revision": _dropped_if(
        (None, "main"), "a revision other than main cannot be served: the engine loads the checkpoint as it is"
    ),
    "dtype": _dropped_if(
        (None, "auto", "bfloat16", "bf16"),
        "the run computes in bf16 (fp16 on GPUs without bf16), the dtype the engine serves. Remove it.",
        "the dtype follows the device",
    ),
    "torch_dtype": _dropped_if(
        (None, "auto", "bfloat16", "bf16"),
        "the run computes in bf16 (fp16 on GPUs without bf16), the dtype the engine serves. Remove it.",
        "the dtype follows the device",
    ),
    "attn_implementation": _to("trl.model_init_kwargs.attn_implementation"),
    "use_peft": _to("adapter", _adapter_for_use_peft),
    "use_dora": _to("peft_use_dora"),
    "use_rslora": _dropped_if((None, False), "rsLoRA's scaling is not served by the merged sync. Remove it."),
    "lora_modules_to_save": _refused("fully trained modules beside LoRA are not served by the engine. Remove it."),
    "lora_task_type": _dropped_if((None, "CAUSAL_LM"), "only causal language models are trained here."),
    "bnb_4bit_quant_type": _dropped_if((None, "nf4"), "the 4-bit base is vLLM's NF4 (load_in_4bit). Remove it."),
    "use_bnb_nested_quant": _dropped_if((None, False), "vLLM's NF4 base has no nested quantization. Remove it."),
    "dataset_name": _to("dataset.path"),
    "dataset_config": _to("dataset.name"),
    "dataset_train_split": _to("dataset.split"),
    "dataset_test_split": _dropped_if(("any",), "", "not read: a run has no evaluation"),
    "dataset_streaming": _dropped_if((None, False), "streamed datasets are not read here. Remove it."),
    "dataset_prompt_column": _to("dataset.prompt_column"),
    "system_prompt": _to("dataset.system_prompt"),
    "reward_model_name_or_path": _refused(
        "reward models are not loaded here: rewards are functions (trl.reward_funcs). Remove it."
    ),
    "ignore_bias_buffers": _dropped_if(("any",), ""),
    "gradient_checkpointing_use_reentrant": _dropped_if(("any",), ""),
    "chat_template": _dropped_if(
        (None, "tokenizer_default"),
        "the tokenizer's own chat template is used (the engine and the trainer must agree). Remove it, or give a "
        "base_model whose tokenizer has the template you want.",
    ),
    "callbacks": _refused("open-r1's callbacks do not run here. Remove it."),
    "benchmarks": _refused("open-r1's benchmarks " + _NO_EVAL),
    "wandb_entity": _refused(_WANDB),
    "wandb_project": _refused(_WANDB),
    "wandb_run_group": _refused(_WANDB),
    "wandb_name": _refused(_WANDB),
    "wandb_watch": _refused(_WANDB),
    "wandb_log_model": _refused(_WANDB),
    "wandb_mode": _refused(_WANDB),
    "wandb_run_id": _refused(_WANDB),
    **{
        key: _refused(_OPEN_R1_REWARD)
        for key in [
            "cosine_min_value_wrong",
            "cosine_max_value_wrong",
            "cosine_min_value_correct",
            "cosine_max_value_correct",
            "cosine_max_len",
            "repetition_n_grams",
            "repetition_max_penalty",
            "code_language",
            "code_eval_test_batch_size",
            "code_eval_scoring_mode",
            "parallel_code_exec_per_proc",
            "code_provider",
            "e2b_router_url",
            "morph_router_url",
            "max_completion_len",
            "soft_punish_cache",
        ]
    },
    "dataset_mixture": _refused("open-r1's dataset mixtures are not read: one dataset, in a dataset: block."),
    # transformers 4's TrainingArguments (TRL, open-r1, Unsloth and Axolotl write it).
    "warmup_ratio": _to("trl.warmup_steps", _warmup_ratio),
    # Axolotl.
    "rl": _dropped_if(("grpo",), "only GRPO is trained here."),
    "num_epochs": _to("trl.num_train_epochs"),
    "optimizer": _to("trl.optim"),
    "lr_scheduler": _to("trl.lr_scheduler_type"),
    "lr_scheduler_kwargs": _to("trl.lr_scheduler_kwargs"),
    "flash_attention": _to("trl.model_init_kwargs.attn_implementation", _attention("flash_attention_2")),
    "sdp_attention": _to("trl.model_init_kwargs.attn_implementation", _attention("sdpa")),
    "xformers_attention": _refused(
        "xformers attention is not used here: 'sdp_attention' (the default) or 'flash_attention'. Remove it."
    ),
    "sequence_len": _dropped_if(
        ("any",),
        "",
        "the engine's token budget is max_prompt_length + trl.max_completion_length (vllm.max_model_len caps it)",
    ),
    "strict": _dropped_if(("any",), ""),
    "sample_packing": _dropped_if((None, False), "GRPO batches are not packed. Remove it."),
    "pad_to_sequence_len": _dropped_if(("any",), "", "GRPO pads each batch to its longest sequence"),
    "val_set_size": _dropped_if((None, 0, 0.0), "a validation split " + _NO_EVAL),
    "evals_per_epoch": _dropped_if((None, 0), _NO_EVAL),
    "saves_per_epoch": _dropped_if((None, 0), "checkpoints are written every save_steps: set that instead."),
    "dataset_prepared_path": _dropped_if(("any",), "", "datasets are read, not prepared"),
    "skip_prepare_dataset": _dropped_if(("any",), "", "datasets are read, not prepared"),
    "special_tokens": _refused(
        "the tokenizer is used as it is (the engine and the trainer share it; a missing pad token becomes eos). "
        "Remove it."
    ),
    "tokens": _refused("new tokens cannot be added: the engine serves the checkpoint's vocabulary. Remove it."),
    "plugins": _refused(
        "Axolotl's plugins (Liger, Cut Cross Entropy, ...) do not run here; TRL's GRPO loss and the run's own "
        "fused head (trl.cast_lm_head_to_fp32) are what there is. Remove it."
    ),
    "deepspeed": _refused(
        "DeepSpeed is not used: one process per GPU, each with its own engine (accelerate launch or torchrun for "
        "data parallel). Remove it."
    ),
    "fsdp": _refused("FSDP is not used: one process per GPU, each with its own engine (data parallel). Remove it."),
    "fsdp_config": _refused("FSDP is not used: one process per GPU (data parallel). Remove it."),
    "early_stopping_patience": _refused(_NO_EVAL),
    "lora_model_dir": _refused("to go on from an earlier run, set resume_from_checkpoint to its checkpoint-N folder."),
    "lora_fan_in_fan_out": _dropped_if((None, False), "fan-in/fan-out LoRA layers are not served. Remove it."),
    "base_model_config": _dropped_if(("any",), ""),
    "model_type": _dropped_if(("any",), "", "the model loads as a causal language model"),
    "tokenizer_type": _dropped_if(("any",), ""),
    "local_rank": _dropped_if(("any",), ""),
    "debug": _dropped_if((None, False), "Remove it."),
    **UNSLOTH_ARGUMENTS,
}
# Keys of Axolotl's vllm: block that start a server; the rest are ours by the same name.
_AXOLOTL_SERVER_KEYS = ("host", "port", "tensor_parallel_size", "data_parallel_size", "served_model_name")
# Keys of Axolotl's trl: block that are not GRPOConfig fields.
_AXOLOTL_TRL_KEYS = {
    "async_prefetch": (
        "asks for generation in the background while training, which one GPU shared by the engine and the trainer "
        "cannot do: the engine generates between steps. Remove it; trl.steps_per_generation reuses one generation "
        "for several optimizer steps."
    ),
    "vllm_server_host": _SERVER,
    "vllm_server_port": _SERVER,
    "vllm_server_timeout": _SERVER,
}


@dataclass
class Translation:
    """A config mapping in our schema, what was moved (``"old -> new"``), and what cannot be honoured."""

    raw: dict[str, Any]
    moved: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """What was read how, in one line (empty when nothing was)."""
        parts = []
        if self.moved:
            parts.append("moved " + ", ".join(self.moved))
        if self.dropped:
            parts.append("dropped as what a run does anyway " + ", ".join(self.dropped))
        return "; ".join(parts)


def _grpo_fields() -> dict[str, Any]:
    from trl import GRPOConfig  # deferred: importing TRL takes seconds

    return {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


def suggestions() -> dict[str, str]:
    """Names a misspelt top-level key may have meant, spelled where they go (``trl.num_generations``; another
    tool's ``model_name`` as ``base_model``). Another tool's keys that a run drops or refuses are left out: writing
    one would change nothing."""
    spelled = {name: f"trl.{name}" for name in _grpo_fields()}
    spelled.update({name: rule.target for name, rule in FOREIGN_KEYS.items() if rule.target is not None})
    spelled.update({name: f"dataset.{name}" for name in _field_names(DatasetConfig) if name != "path"})
    spelled.update({name: f"vllm.{name}" for name in _field_names(VLLMConfig)})
    return spelled


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def translate(raw: dict[str, Any]) -> Translation:
    """``raw`` (any source's config) in our schema; keys of ours stay as written.

    A key of another tool whose value asks for something a run cannot do is a problem (with the reason and the fix),
    never dropped silently; a key and its translation both given, with different values, is a problem too.
    """
    ours = set(_field_names(Config))
    grpo = _grpo_fields()
    out: dict[str, Any] = {key: value for key, value in raw.items() if key in ours}
    out["trl"] = dict(raw["trl"]) if isinstance(raw.get("trl"), dict) else raw.get("trl")
    if out["trl"] is None:
        del out["trl"]
    if isinstance(raw.get("vllm"), dict):
        out["vllm"] = dict(raw["vllm"])
    if isinstance(raw.get("dataset"), dict):
        out["dataset"] = dict(raw["dataset"])
    result = Translation(out)
    dataset_mapped = False

    for key, value in raw.items():
        if key in ours:
            continue
        if key == "datasets":
            dataset_mapped |= _datasets(value, result)
        elif key == "vllm_sampling_params":
            _sampling_params(value, result)
        elif key in FOREIGN_KEYS:
            dataset_mapped |= _apply(key, value, FOREIGN_KEYS[key], result)
        elif key in ("bf16", "fp16", "tf32") and value in ("auto", None):
            result.dropped.append(f"{key}: {value} (the precision follows the device)")
        elif key in TRL_KEYS_WITH_A_PLACE:
            _put(result, TRL_KEYS_WITH_A_PLACE[key], value, key, converted=_placed(key, value))
        elif key in OWN_TRL_KEYS:  # reward_funcs at the top level, as TRL's CLI takes it
            _put(result, f"trl.{key}", value, key)
        elif key in grpo:
            if value is None and grpo[key] is not None:
                result.problems.append(
                    f"'{key}' is empty (the key has no value): give a value, or remove the line for TRL's default "
                    f"({grpo[key]!r})."
                )
            else:
                _put(result, f"trl.{key}", value, key)
        else:
            out[key] = value  # unknown: the schema reports it with a did-you-mean
    if isinstance(out.get("trl"), dict):
        _trl_block(out["trl"], result, grpo, ours)
    if isinstance(out.get("vllm"), dict):
        for key in _AXOLOTL_SERVER_KEYS:
            if out["vllm"].pop(key, None) is not None:
                result.problems.append(f"'vllm.{key}' {_SERVER}")
    _implied(raw, result, dataset_mapped)
    return result


def _apply(key: str, value: Any, rule: _Rule, result: Translation) -> bool:
    """Apply ``rule`` to ``key: value``; True when it set a dataset key."""
    try:
        converted = rule.convert(value)
    except _Refused as refused:
        result.problems.append(f"'{key}: {value}' is not supported: {refused}")
        return False
    if rule.target is None or converted is _DROP:
        result.dropped.append(key + (f" ({rule.note})" if rule.note else ""))
        return False
    _put(result, rule.target, value, key, converted=converted)
    return rule.target.startswith("dataset.")


def _put(result: Translation, path: str, value: Any, written_as: str, converted: Any = _DROP) -> None:
    """Set our key ``path`` (dotted) to ``converted`` (``value`` by default), unless it holds another value."""
    new = value if converted is _DROP else converted
    *parents, leaf = path.split(".")
    node = result.raw
    for parent in parents:
        if not isinstance(node.get(parent), dict):
            node[parent] = {}
        node = node[parent]
    if leaf in node and node[leaf] != new:
        result.problems.append(
            f"'{written_as}' and '{path}' are one setting, given twice with different values ({value!r} and "
            f"{node[leaf]!r}): keep one."
        )
        return
    node[leaf] = new
    result.moved.append(f"{written_as} -> {path}")


def _trl_block(trl: dict[str, Any], result: Translation, grpo: dict[str, Any], ours: set[str]) -> None:
    """Move trl: keys that have a place of ours there; refuse Axolotl's trl: keys that cannot run here."""
    for key in list(trl):
        if key in TRL_KEYS_WITH_A_PLACE:
            value = trl.pop(key)
            _put(result, TRL_KEYS_WITH_A_PLACE[key], value, f"trl.{key}", converted=_placed(key, value))
        elif key in ours and key not in grpo and key not in OWN_TRL_KEYS:
            _put(result, key, trl.pop(key), f"trl.{key}")  # a top-level key of ours written in trl:
        elif key in _AXOLOTL_TRL_KEYS and key not in grpo:
            trl.pop(key)
            result.problems.append(f"'trl.{key}' {_AXOLOTL_TRL_KEYS[key]}")
    rewards = trl.get("reward_funcs")
    if isinstance(rewards, str):
        rewards = [rewards]
    if isinstance(rewards, list):
        translated = []
        for entry in rewards:
            if isinstance(entry, str) and entry in TRL_REWARD_NAMES:
                result.moved.append(f"reward {entry} -> {TRL_REWARD_NAMES[entry]}")
                translated.append(TRL_REWARD_NAMES[entry])
            elif isinstance(entry, str) and "." not in entry:
                result.problems.append(
                    f"'trl.reward_funcs' entry '{entry}' is a name in a reward registry (open-r1's or TRL's), not a "
                    "function here: give a dotted path to it, e.g. my_rewards.accuracy_reward for a function in "
                    f"my_rewards.py, or one of {', '.join(TRL_REWARD_NAMES.values())}."
                )
            else:
                translated.append(entry)
        trl["reward_funcs"] = translated


def _sampling_params(value: Any, result: Translation) -> None:
    """Unsloth's ``GRPOConfig(vllm_sampling_params=SamplingParams(...))``, its arguments as a mapping: TRL's
    ``generation_kwargs``, which TRL hands to vLLM's ``SamplingParams`` as Unsloth does, but its ``seed``."""
    if not isinstance(value, dict):
        result.problems.append(
            "'vllm_sampling_params' is read as a mapping of vLLM SamplingParams arguments (min_p: 0.1, stop: [...]): "
            "write it so, or give them as 'trl.generation_kwargs'."
        )
        return
    arguments = dict(value)
    if arguments.pop("seed", None) is not None:
        result.dropped.append(
            "vllm_sampling_params.seed (TRL asks vLLM for each completion on its own: one seed would make a "
            "prompt's completions the same; the run's seed seeds the engine)"
        )
    _put(result, "trl.generation_kwargs", value, "vllm_sampling_params", converted=arguments)


def _datasets(value: Any, result: Translation) -> bool:
    """Axolotl's / TRL's ``datasets:`` list of one entry as our ``dataset:`` block."""
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        count = len(value) if isinstance(value, list) else "no"
        result.problems.append(
            f"'datasets' lists {count} datasets as mappings; a run trains on one: keep one entry (path, name, split) "
            "or write a 'dataset:' block."
        )
        return False
    entry = dict(value[0])
    path, data_files = entry.pop("path", None), entry.pop("data_files", None)
    if data_files is not None:
        if isinstance(data_files, str) and path in (None, "json", "csv", "parquet", "text"):
            path = data_files  # a local data file: its format is read from its suffix
        else:
            result.problems.append(
                "'datasets[0].data_files' is read only as one local file with 'path' its format (json, csv, "
                "parquet): give the file as 'dataset.path'."
            )
    if path is not None:
        _put(result, "dataset.path", path, "datasets[0].path")
    for key in ("name", "split"):
        if entry.get(key) is not None:
            _put(result, f"dataset.{key}", entry.pop(key), f"datasets[0].{key}")
        entry.pop(key, None)
    if entry.pop("type", None) is not None:
        result.problems.append(
            "'datasets[0].type' is not supported: Axolotl's dataset transforms do not run here. Rewards get every "
            "column under its own name, and a prompt column already in chat messages is used as it is: set "
            "'dataset.prompt_column' (and 'dataset.system_prompt'), or prepare the column once with datasets' map."
        )
    for key, extra in entry.items():
        if extra not in (None, [], {}):
            result.problems.append(f"'datasets[0].{key}' is not supported: a dataset here has path, name and split.")
    return path is not None


def _implied(raw: dict[str, Any], result: Translation, dataset_mapped: bool) -> None:
    """Our keys whose value another key written implies (so that configs from elsewhere need not say them)."""
    out = result.raw
    # A dataset named the other tools' way replaces the built-in task (ours asks for 'task: null').
    if dataset_mapped and "task" not in raw:
        out["task"] = None
        result.moved.append("dataset given -> task: null")
    # Axolotl's and TRL's lora_target_modules alone mean those modules (our lora_target_linear defaults to true).
    modules = out.get("lora_target_modules")
    if modules == "all-linear":
        del out["lora_target_modules"]
        _put(result, "lora_target_linear", True, "lora_target_modules: all-linear")
    elif modules is not None and "lora_target_linear" not in out:
        out["lora_target_linear"] = False
    if any(key in raw for key in UNSLOTH_ARGUMENTS):
        _unsloth_generation_batch(result)
    # TRL trains for num_train_epochs when max_steps is not set; ours counts steps unless max_steps is -1.
    trl = out.get("trl")
    if isinstance(trl, dict) and "num_train_epochs" in trl and "max_steps" not in out:
        out["max_steps"] = -1
        result.moved.append("num_train_epochs without max_steps -> max_steps: -1")


def _unsloth_generation_batch(result: Translation) -> None:
    """Unsloth's GRPOConfig raises ``per_device_train_batch_size`` to ``num_generations`` where the generation batch
    (it times ``gradient_accumulation_steps``) is not a multiple of it: its notebooks write 1 with 6 generations.
    TRL refuses such a batch (each prompt's completions are scored as one group), and so does a TRL config here."""
    out = result.raw
    trl = out.get("trl") if isinstance(out.get("trl"), dict) else {}
    if "steps_per_generation" in trl or "generation_batch_size" in trl:
        return  # Unsloth leaves the batch alone then, and so does TRL's check
    micro = out.get("micro_batch_size", Config.micro_batch_size)
    accumulation = out.get("gradient_accumulation_steps", Config.gradient_accumulation_steps)
    generations = trl.get("num_generations", TRL_DEFAULTS["num_generations"])
    counts = (micro, accumulation, generations)
    if not all(type(n) is int and n > 0 for n in counts) or micro * accumulation % generations == 0:
        return  # the schema reports a bad value; a batch of whole groups stays as written
    out["micro_batch_size"] = generations
    result.moved.append(
        f"micro_batch_size {micro} -> {generations} (as Unsloth runs it: a generation batch of whole groups of "
        "num_generations)"
    )
