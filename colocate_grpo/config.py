"""The run configuration: one YAML schema, validated before anything heavy starts.

Key names follow Axolotl's GRPO documentation where it has them (``base_model``,
``adapter``, ``lora_*``, ``lora_merge_aware``, a ``trl:`` block and a ``vllm:``
block). Every problem is reported as a :class:`ConfigError` that names the key
and the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix.

    Several problems found in one pass are one error whose message lists each on its own line;
    ``problems`` holds them one by one.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        """One error for ``problems`` (at least one): the message itself, or a count and one problem a line."""
        unique = list(dict.fromkeys(problems))
        if len(unique) == 1:
            return cls(unique[0])
        lines = "\n".join(f"- {problem}" for problem in unique)
        return cls(f"{len(unique)} problems, each with its fix:\n{lines}", unique)


class Problems:
    """Collects every problem of one pass, so that a config's user fixes them all after one run."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, message: str) -> None:
        self.found.append(message)

    @contextlib.contextmanager
    def catch(self) -> Iterator[None]:
        """Record a ConfigError raised inside the block (its problems) and go on after the block."""
        try:
            yield
        except ConfigError as err:
            self.found.extend(err.problems)

    def raise_if_any(self) -> None:
        if self.found:
            raise ConfigError.of(self.found)


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
            "help": "KV cache size. batch: room for the generation batch at full length (TRL's generation batch "
            "of sequences of the dataset's longest prompt + max_completion_length tokens), within "
            "gpu_memory_utilization (cpu_kv_cache_gib on CPU); the rest stays with training, and sleep and "
            "wake move less memory. Where the device has no room for that, the room there is (vLLM queues the "
            "rest). memory_fraction: all that gpu_memory_utilization leaves after the weights (TRL's sizing)."
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
    prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "Column holding the prompt: text, or chat messages (TRL's conversational format, used as is)."
        },
    )
    answer_column: str | None = field(
        default=None,
        metadata={
            "help": "Column holding the reference answer, passed to rewards also as `answer` (every column reaches "
            "the rewards under its own name, with its own type)."
        },
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
        default=None,
        metadata={"help": "Module names to adapt (instead of lora_target_linear, which then defaults to false)."},
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
            "help": "bitsandbytes NF4 base (QLoRA), the adapter served by vLLM: where the device has room for the "
            "base in bf16 (and on a CPU), its NF4 values kept in bf16 on bf16 kernels; else vLLM quantizes the "
            "checkpoint as it loads and the trainer computes with the engine's 4-bit weights (one copy)."
        },
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "bitsandbytes 8-bit base (refused: vLLM cannot serve it colocated)."}
    )

    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    max_steps: int = field(
        default=100,
        metadata={"help": "Optimizer steps; -1 trains for trl.num_train_epochs of the dataset (TRL's way)."},
    )
    micro_batch_size: int = field(
        default=8,
        metadata={
            "help": "Completions per device per forward pass (TRL's per_device_train_batch_size). The most the "
            "trainer takes at once: where training's activations would not fit the device, the run plan halves "
            "it and doubles gradient_accumulation_steps until they do (the generation batch and the update stay "
            "the same), and says so at start."
        },
    )
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    max_prompt_length: int = field(default=512, metadata={"help": "Longest prompt in tokens (sizes the engine)."})
    gradient_checkpointing: bool | Literal["auto"] = field(
        default="auto",
        metadata={
            "help": "Recompute activations in the backward pass: less memory, about half again the training "
            "time with LoRA. auto: off where the run plan finds that training's activations fit the device "
            "without it (at micro_batch_size or a smaller micro-batch that keeps the GPU busy), else on; on "
            "where there is no device memory plan (CPU). TRL's default is true."
        },
    )
    group_by_length: bool | Literal["auto"] = field(
        default="auto",
        metadata={
            "help": "Compute no padding in training: each forward trimmed to its sequences' longest prompt and "
            "completion, the logprob pass in chunks of similar length, and each optimizer step's micro-batches "
            "regrouped by completion length (the loss is the same: docs/how-it-works.md). auto: all of it where "
            "regrouping keeps the loss (every trl.loss_type but bnpo, without trl.entropy_coef or "
            "trl.top_entropy_quantile), else the trimming alone, which keeps every loss. true: all of it, refused "
            "where the loss would change. false: TRL's padding to the generation batch's longest."
        },
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
    async_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate the next batch while the trainer trains on this one (docs/async.md); on one GPU not "
            "faster than the sequential mode, as the two slow each other down on the device. The engine stays "
            "awake and serves the adapter (as trl.vllm_lora_sync does); each batch is sampled with the adapter of "
            "the optimizer step before the one that trains on it, and TRL's importance-sampling correction "
            "reweights it. LoRA on a bf16 base, one process."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "With async_generation: how many optimizer steps a batch's adapter may lag behind the trainer's "
            "when training on it starts (TRL's AsyncGRPOConfig key, default 4 there; here one batch is in flight, "
            "so the lag is at most 1). An older batch is not trained on: it is counted in async/dropped and "
            "generated again. 0 drops every batch generated ahead."
        },
    )

    trl: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Any TRL GRPOConfig field (num_generations, max_completion_length, reward_funcs, ...)."},
    )
    vllm: VLLMConfig = field(default_factory=VLLMConfig, metadata={"help": "The colocated vLLM engine."})

    @property
    def trl_settings(self) -> dict[str, Any]:
        """The trl: block over our defaults (colocated vLLM that sleeps while training).

        With ``trl.vllm_bitwise_logprobs`` the importance-sampling correction defaults to off: the trainer's
        log-probabilities equal the engine's, so its ratio is exactly 1 (docs/bitwise.md). Set
        ``trl.vllm_importance_sampling_correction: true`` to compute it anyway.
        """
        bitwise = {"vllm_importance_sampling_correction": False} if self.trl.get("vllm_bitwise_logprobs") else {}
        return {**TRL_DEFAULTS, **bitwise, **self.trl}

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

# Keys of the trl: block that are ours (or Axolotl's), not GRPOConfig fields. vllm_bitwise_logprobs (docs/bitwise.md):
# the trainer's log-probabilities bit for bit the engine's, through the same batch-invariant kernels; it sits beside
# TRL's vllm_importance_sampling_* keys, whose correction it makes the identity.
OWN_TRL_KEYS: dict[str, type | types.UnionType] = {
    "reward_funcs": list[str],
    "vllm_merge_check_interval": int,
    "vllm_lora_sync": bool,
    "vllm_bitwise_logprobs": bool,
}


def load_config(source: str | Path | dict[str, Any] | None = None) -> Config:
    """Read and validate a config from a YAML path, the name of a packaged config (``packaged_configs``), a YAML
    string, a dict, or nothing (the defaults).

    A config written for Axolotl, TRL, open-r1 or Unsloth is read as one of ours where the keys map exactly
    (:mod:`colocate_grpo.migrate`; what was moved is logged as a warning).

    Raises:
        ConfigError: on any problem, with a message that names the key and the fix; every problem at once.
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
    # The migration and the checks read Config's fields and this module's coercion: imported here, where both are
    # defined.
    from colocate_grpo.migrate import suggestions, translate
    from colocate_grpo.validation import config_problems

    problems = Problems()
    translation = translate(raw)
    problems.found.extend(translation.problems)
    if translation.summary():
        logging.getLogger("colocate_grpo").warning(
            "Read as colocate_grpo's keys (docs/migrating.md): %s.", translation.summary()
        )
    config = _build(Config, translation.raw, "", problems, suggestions())
    problems.found.extend(config_problems(config))
    problems.raise_if_any()
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


def did_you_mean(key: str, known: typing.Iterable[str] | dict[str, str]) -> str:
    """A "Did you mean ...?" sentence for the known name closest to ``key``, or nothing.

    ``known`` may map each name to how the sentence should spell it (e.g. a TRL field as ``trl.<name>``).
    """
    spelled = known if isinstance(known, dict) else {name: name for name in known}
    close = difflib.get_close_matches(key, list(spelled), n=1, cutoff=0.6)
    return f" Did you mean '{spelled[close[0]]}'?" if close else ""


def _build(
    cls: type, raw: dict[str, Any], prefix: str, problems: Problems, elsewhere: dict[str, str] | None = None
) -> Any:
    """``cls`` from ``raw``; each unknown key, bad value and missing key is added to ``problems``, and the field
    keeps its default so that the other checks still run. ``elsewhere`` spells names known outside ``cls``
    (did-you-means for keys that belong in another block)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    spelled = {**(elsewhere or {}), **{name: prefix + name for name in fields}}
    for key in raw:
        if key not in fields:
            problems.add(
                f"Unknown key '{prefix}{key}'.{did_you_mean(str(key), spelled)} "
                f"Known keys here: {', '.join(sorted(fields))}."
            )
    values = {}
    for name, f in fields.items():
        if name in raw:
            with problems.catch():
                values[name] = coerce_value(raw[name], hints[name], f"{prefix}{name}", problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.add(f"Missing required key '{prefix}{name}': {f.metadata.get('help', '')}")
            values[name] = ""  # a placeholder: the error above is raised before anything reads it
    return cls(**values)


def _allows_none(tp: Any) -> bool:
    if tp is Any or tp is type(None):
        return True
    origin = typing.get_origin(tp)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a block of key: value lines"
    if isinstance(tp, type):
        return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(
            tp.__name__, tp.__name__
        )
    return str(tp)


def coerce_value(value: Any, tp: Any, key: str, problems: Problems | None = None) -> Any:
    """``value`` as type ``tp`` (a YAML scalar, list, mapping or config block), or a ConfigError naming ``key``.

    A config block's own problems go to ``problems`` where given (all of them), else the first is raised.
    """
    origin = typing.get_origin(tp)
    if value is None and not _allows_none(tp):
        raise ConfigError(
            f"'{key}' is empty (the key has no value): give {_type_name(tp)}, or remove the line to keep the default."
        )
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        real_options = [o for o in options if o is not type(None)]
        if len(real_options) == 1:
            return coerce_value(value, real_options[0], key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce_value(value, option, key)
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
            f"{did_you_mean(str(value), [str(a) for a in allowed])}"
        )
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r}.")
        return [coerce_value(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a mapping (a block of key: value lines), got {value!r}.")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' must be a block of key: value lines, got {value!r}.")
        own = Problems() if problems is None else problems
        built = _build(tp, value, f"{key}.", own)
        if problems is None:
            own.raise_if_any()
        return built
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
