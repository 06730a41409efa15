"""The run configuration: one YAML schema, validated before anything heavy starts.

Key names follow Axolotl's GRPO documentation where it has them (``base_model``,
``adapter``, ``lora_*``, ``lora_merge_aware``, a ``trl:`` block and a ``vllm:``
block). Every problem is reported as a :class:`ConfigError` that names the key
and the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix."""


@dataclass
class VLLMConfig:
    """The ``vllm:`` block: the colocated engine."""

    gpu_memory_utilization: float | Literal["auto"] = field(
        default="auto",
        metadata={
            "help": "auto: the engine takes what its weights, the batch's KV cache, its forward and its CUDA "
            "graphs need (the memory plan printed at start). A number in (0, 1]: at most that fraction of the "
            "GPU (with kv_cache: batch it takes less when the batch needs less). On CPU see cpu_kv_cache_gib."
        },
    )
    kv_cache: Literal["batch", "memory_fraction"] = field(
        default="batch",
        metadata={
            "help": "KV cache size. batch: room for the generation batch at full length (max_num_seqs "
            "sequences of the dataset's longest prompt + max_completion_length tokens), within "
            "gpu_memory_utilization (cpu_kv_cache_gib on CPU); the rest stays with training, and sleep and "
            "wake move less memory. memory_fraction: all that gpu_memory_utilization leaves after the "
            "weights (TRL's sizing)."
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "Prompt + completion budget in tokens. Defaults to max_prompt_length + max_completion_length."
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "Skip CUDA graph capture: saves about 1 GiB and some start-up time, but decodes several "
            "times slower (4.6x at 1.5B on the H200). For debugging, or when memory is that tight."
        },
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "Reuse KV cache across shared prompt prefixes."}
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(
        default="auto", metadata={"help": "Engine dtype; auto follows the training dtype."}
    )
    cpu_kv_cache_gib: float = field(
        default=1.0,
        metadata={
            "help": "Largest KV cache on CPU, in GiB. vLLM on CPU otherwise sizes it from the process's own "
            "memory, which fails in long-lived processes (notebooks)."
        },
    )
    sleep_level: Literal[1, 2] = field(
        default=2,
        metadata={
            "help": "How deep vLLM sleeps while the trainer trains: 1 keeps a CPU copy of the weights, "
            "2 keeps nothing (the next sync pushes the weights anyway). With LoRA the weights are the trainer's "
            "base (one shared copy) and stay: only the KV cache sleeps."
        },
    )


@dataclass
class DatasetConfig:
    """The ``dataset:`` block: a Hugging Face dataset (hub id or local path) with a prompt column."""

    path: str = field(metadata={"help": "Hub id (e.g. openai/gsm8k) or a local directory / data file."})
    name: str | None = field(default=None, metadata={"help": "Dataset configuration name (e.g. main)."})
    split: str = field(default="train", metadata={"help": "Split to train on."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the question text."})
    answer_column: str | None = field(
        default=None, metadata={"help": "Column holding the reference answer, passed to rewards as `answer`."}
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "If set, prompts become chat messages with this system message."}
    )
    chat: bool = field(default=True, metadata={"help": "Send prompts as chat messages (needs a chat template)."})
    skip_empty_prompts: bool = field(
        default=False,
        metadata={
            "help": "Leave out empty or blank prompts, with a warning that counts them; without it they are "
            "refused before the model loads, by row number (vLLM cannot generate from an empty prompt)."
        },
    )


@dataclass
class Config:
    """A whole run. Field docs are the config reference (``colocate_grpo.config.describe()``)."""

    base_model: str = field(
        default="tiny",
        metadata={"help": "Model directory or hub id; `tiny` builds a 0.3M-parameter model locally (CPU demo)."},
    )
    output_dir: str = field(default="outputs/run", metadata={"help": "Where adapter, config and metrics go."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir that holds an earlier run: its checkpoint-N folders and "
            "metrics.jsonl are deleted first (without it such a run is refused; see docs/output-folder.md)."
        },
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto", metadata={"help": "auto picks cuda when available, else cpu."}
    )
    seed: int = field(default=0, metadata={"help": "Seed for data order, sampling and initialisation."})

    task: Literal["arithmetic"] | None = field(
        default="arithmetic", metadata={"help": "A built-in synthetic task; set to null when `dataset` is given."}
    )
    dataset: DatasetConfig | None = field(default=None, metadata={"help": "A dataset instead of a built-in task."})
    num_prompts: int | None = field(
        default=None, metadata={"help": "Use at most this many prompts of the dataset (all when null)."}
    )

    adapter: Literal["lora"] | None = field(default="lora", metadata={"help": "lora, or null for full fine-tuning."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha; the update is scaled by alpha / r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input, in [0, 1)."})
    lora_target_linear: bool = field(default=True, metadata={"help": "Put LoRA on every linear layer but the head."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Module names to adapt (instead of lora_target_linear)."}
    )
    lora_merge_aware: Literal["auto", "bf16", "fp16"] | None = field(
        default="auto",
        metadata={
            "help": "Train x @ cast(W + s*B@A)^T so vLLM serves exactly what is optimised, and train faster than "
            "PEFT's LoRA at GRPO's batch sizes. auto: in the training dtype (bf16; fp16 on GPUs without bf16 such "
            "as the T4) wherever it applies (LoRA on an unquantized base, no DoRA, merged weights served: not with "
            "trl.vllm_lora_sync). null: PEFT's LoRA, whose merge into bf16 keeps only part of the update "
            "(lora_merge/retained)."
        },
    )
    peft_use_dora: bool = field(
        default=False,
        metadata={
            "help": "DoRA adapters: refused for now, as the engine cannot serve DoRA's magnitude (Axolotl's key)."
        },
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "bitsandbytes NF4 base (QLoRA, GPUs): vLLM quantizes the checkpoint as it loads, the trainer "
            "computes with the engine's 4-bit weights (one copy), and vLLM serves the adapter on them."
        },
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "bitsandbytes 8-bit base (refused: vLLM cannot serve it colocated)."}
    )

    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps."})
    micro_batch_size: int = field(
        default=8, metadata={"help": "Completions per device per forward pass (TRL's per_device_train_batch_size)."}
    )
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    max_prompt_length: int = field(default=512, metadata={"help": "Longest prompt in tokens (sizes the engine)."})
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in the backward pass: less memory, some more time (TRL's default)."},
    )
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every N optimizer steps."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "A checkpoint-N folder to continue from (adapter, optimizer, scheduler), or 'latest'."},
    )
    save_merged: bool = field(
        default=False,
        metadata={"help": "Also write output_dir/merged: a bf16 model whose weights equal what vLLM served."},
    )
    save_steps: int = field(default=0, metadata={"help": "Checkpoint every N steps; 0 saves only at the end."})

    trl: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Any TRL GRPOConfig field (num_generations, max_completion_length, reward_funcs, ...)."},
    )
    vllm: VLLMConfig = field(default_factory=VLLMConfig, metadata={"help": "The colocated vLLM engine."})

    @property
    def trl_settings(self) -> dict[str, Any]:
        """The trl: block over our defaults (colocated vLLM that sleeps while training)."""
        return {**TRL_DEFAULTS, **self.trl}

    @property
    def reward_funcs(self) -> list[str]:
        """Dotted paths of the reward functions: trl.reward_funcs, else the task's own."""
        given = self.trl.get("reward_funcs")
        if given:
            return list(given)
        return [TASK_REWARDS[self.task]] if self.task else []

    @property
    def max_completion_length(self) -> int:
        return int(self.trl_settings["max_completion_length"])

    @property
    def serves_adapter(self) -> bool:
        """Whether vLLM serves the LoRA adapter on the base (trl.vllm_lora_sync, or a 4-bit base) rather than merged
        weights. The base then never changes, and the trainer and the engine hold one copy of it."""
        return self.adapter == "lora" and bool(self.trl.get("vllm_lora_sync") or self.load_in_4bit)

    @property
    def shares_base_weights(self) -> bool:
        """Whether the trainer's base weights are the engine's (one copy on the device): LoRA, served either way.
        Merged serving merges into them in place for each generation and restores them bitwise."""
        return self.adapter == "lora"

    @property
    def engine_max_model_len(self) -> int:
        """The engine's token budget per sequence: vllm.max_model_len, else prompt + completion."""
        return self.vllm.max_model_len or self.max_prompt_length + self.max_completion_length

    def sequence_tokens(self, longest_prompt: int | None = None) -> int:
        """Tokens one generated sequence takes at most: the dataset's ``longest_prompt`` (None:
        max_prompt_length) plus the completion, within the engine's max_model_len. The KV cache and
        the training activations are sized by it."""
        prompt = self.max_prompt_length if longest_prompt is None else min(longest_prompt, self.max_prompt_length)
        return min(self.engine_max_model_len, prompt + self.max_completion_length)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TRL_DEFAULTS: dict[str, Any] = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_enable_sleep_mode": True,
    "num_generations": 8,
    "max_completion_length": 256,
    "vllm_merge_check_interval": 50,
}
TASK_REWARDS = {"arithmetic": "colocate_grpo.tasks.arithmetic_reward"}

# Keys of the trl: block that are ours (or Axolotl's), not GRPOConfig fields.
OWN_TRL_KEYS: dict[str, type | types.UnionType] = {
    "reward_funcs": list[str],
    "vllm_merge_check_interval": int,
    "vllm_lora_sync": bool,
}
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


def load_config(source: str | Path | dict[str, Any] | None = None) -> Config:
    """Read and validate a config from a YAML path, the name of a packaged config (``packaged_configs``), a YAML
    string, a dict, or nothing (the defaults).

    Raises:
        ConfigError: on any problem, with a message that names the key and the fix.
    """
    if source is None:
        raw: Any = {}
    elif isinstance(source, str | Path):
        raw = _read_yaml(source)
    else:
        raw = source
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"The config must be a mapping of keys to values, got a {type(raw).__name__}.")
    config = _build(Config, raw, prefix="")
    _check_ranges(config)
    _check_combinations(config)
    return config


def packaged_configs() -> dict[str, Path]:
    """The example configs that come with the package, by name (``tiny``, ``qwen2.5-0.5b-gsm8k``, ...)."""
    directory = Path(str(resources.files("colocate_grpo") / "configs"))
    return {path.stem: path for path in sorted(directory.glob("*.yaml"))}


def _read_yaml(source: str | Path) -> Any:
    text_given = isinstance(source, str) and ("\n" in source or ":" in source) and not Path(source).exists()
    if text_given:
        text, where = str(source), "the config text"
    else:
        path = Path(source)
        if not path.is_file():
            # A packaged config's name (or file name) works from any directory: notebooks, Colab.
            packaged = packaged_configs()
            path = packaged.get(path.name.removesuffix(".yaml")) if path.parent == Path() else None
            if path is None:
                raise ConfigError(
                    f"Config file not found: {source}. Pass the path of a YAML file, or the name of a config that "
                    f"comes with colocate_grpo: {', '.join(packaged)}."
                )
        text, where = path.read_text(), str(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(
            f"{where} is not valid YAML{at}: {problem}. Check the indentation and quoting there."
        ) from None


def _did_you_mean(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(
                f"Unknown key '{prefix}{key}'.{_did_you_mean(str(key), fields)} "
                f"Known keys here: {', '.join(sorted(fields))}."
            )
    values = {}
    for name, f in fields.items():
        if name in raw:
            values[name] = _coerce(raw[name], hints[name], f"{prefix}{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"Missing required key '{prefix}{name}': {f.metadata.get('help', '')}")
    return cls(**values)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(
            tp.__name__, tp.__name__
        )
    return str(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        real_options = [o for o in options if o is not type(None)]
        if len(real_options) == 1:
            return _coerce(value, real_options[0], key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err)
        expected = " or ".join(_type_name(o) for o in options if o is not type(None))
        nullable = " (or null)" if type(None) in options else ""
        raise ConfigError(f"'{key}' must be {expected}{nullable}, got {value!r}.")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[allowed.index(value)]):
            return value
        raise ConfigError(
            f"'{key}' must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}."
            f"{_did_you_mean(str(value), [str(a) for a in allowed])}"
        )
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r}.")
        return [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a mapping (a block of key: value lines), got {value!r}.")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a block of key: value lines, got {value!r}.")
        return _build(tp, value, prefix=f"{key}.")
    return _coerce_scalar(value, tp, key)


def _coerce_scalar(value: Any, tp: type, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-5 (no dot) as a string; accept it as the number it obviously is.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(f"'{key}' must be {_type_name(tp)}, got {value!r}.")


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
                f"Unknown key 'trl.{key}'.{_did_you_mean(key, known)} The trl: block takes TRL GRPOConfig fields."
            )
        _coerce(value, OWN_TRL_KEYS.get(key) or hints[key], f"trl.{key}")
    if trl.get("use_vllm") is False:
        raise ConfigError("'trl.use_vllm: false' is not supported: colocate_grpo generates with vLLM. Remove it.")
    if trl.get("vllm_mode", "colocate") != "colocate":
        raise ConfigError(
            f"'trl.vllm_mode: {trl['vllm_mode']}' is not supported: colocate_grpo runs vLLM inside the trainer "
            "process. Use 'vllm_mode: colocate' (or leave it out)."
        )


def _type_text(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return "null" if tp is type(None) else tp.__name__
    return str(tp).replace("typing.", "")


def describe() -> str:
    """The config reference as Markdown tables, generated from the field docs."""
    lines = []
    for title, cls in [("Top level", Config), ("vllm:", VLLMConfig), ("dataset:", DatasetConfig)]:
        lines += [f"### {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = "see below" if dataclasses.is_dataclass(hints[f.name]) else f.default_factory()
            else:
                default = "required"
            type_text = _type_text(hints[f.name])
            lines.append(f"| `{f.name}` | `{type_text}` | `{default}` | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)
