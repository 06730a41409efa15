"""From a validated config to the things TRL trains: model, tokenizer, dataset, rewards.

Every check that can fail on user input runs here, before the model loads or
anything is written, and raises :class:`~colocate_grpo.config.ConfigError`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from colocate_grpo.config import Config, ConfigError
from colocate_grpo.plan import RunPlan, Serving
from colocate_grpo.prompts import drop_or_refuse_empty_prompts
from colocate_grpo.tasks import arithmetic_dataset
from colocate_grpo.tiny import TINY_MODEL_NAME, tiny_model_path

RewardFunc = Callable[..., list[float]]
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def resolve_device(config: Config) -> str:
    """``cuda`` or ``cpu``; ``auto`` picks cuda when a GPU is visible."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device: cuda' but no CUDA GPU is visible. Use 'device: auto' or 'device: cpu'.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    if config.load_in_4bit and device != "cuda":
        raise ConfigError(
            "'load_in_4bit: true' needs a CUDA GPU: vLLM quantizes with bitsandbytes on GPUs only. Remove it to train "
            "a bf16 base on the CPU."
        )
    if config.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "'load_in_4bit: true' needs bitsandbytes, which is not installed: pip install -e \".[quant]\" (or pip "
            "install bitsandbytes), or remove 'load_in_4bit'."
        )
    return device


def training_dtype(device: str) -> torch.dtype:
    """bf16 where the hardware has it (CPU, Ampere and newer), else fp16 (e.g. the T4)."""
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def model_path(config: Config) -> str:
    """The base model's directory or hub id; builds the tiny model on first use."""
    if config.base_model == TINY_MODEL_NAME:
        return str(tiny_model_path())
    looks_local = config.base_model.startswith((".", "/", "~")) or Path(config.base_model).exists()
    if looks_local and not (Path(config.base_model).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"'base_model: {config.base_model}' is not a model directory (no config.json there). "
            "Give a Hugging Face model folder, a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or 'tiny'."
        )
    return str(Path(config.base_model).expanduser()) if looks_local else config.base_model


def resolve_rewards(config: Config) -> list[RewardFunc]:
    """Import each ``trl.reward_funcs`` entry (``package.module.function``)."""
    rewards = []
    for dotted in config.reward_funcs:
        module_name, _, attr = dotted.rpartition(".")
        try:
            func = getattr(importlib.import_module(module_name), attr) if module_name else None
        except ImportError as err:
            raise ConfigError(
                f"'trl.reward_funcs' entry '{dotted}': cannot import module '{module_name}' ({err}). "
                "Give a dotted path importable from the working directory, e.g. my_rewards.correctness."
            ) from None
        except AttributeError:
            func = None
        if not callable(func):
            raise ConfigError(
                f"'trl.reward_funcs' entry '{dotted}' is not a function. "
                "Give module.function, e.g. colocate_grpo.tasks.accuracy_reward."
            )
        rewards.append(func)
    return rewards


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_dataset(config: Config, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """The prompt dataset TRL expects: a ``prompt`` column (text or chat messages) plus reward columns."""
    if config.task == "arithmetic":
        return arithmetic_dataset(size=config.num_prompts or 2000, seed=config.seed)
    spec = config.dataset
    assert spec is not None  # the validator guarantees task or dataset
    from datasets import load_dataset

    builder = _FILE_BUILDERS.get(Path(spec.path).suffix) if Path(spec.path).is_file() else None
    try:
        if builder is not None:  # a data file: datasets reads it with the builder of its format
            dataset = load_dataset(builder, data_files=spec.path, split=spec.split)
        else:
            dataset = load_dataset(spec.path, spec.name, split=spec.split)
    except Exception as err:  # datasets raises many types; all mean "cannot read this"
        raise ConfigError(f"'dataset.path: {spec.path}' could not be loaded: {err}") from None
    for key, column in [("prompt_column", spec.prompt_column), ("answer_column", spec.answer_column)]:
        if column is not None and column not in dataset.column_names:
            raise ConfigError(
                f"'dataset.{key}: {column}' is not a column of {spec.path}; its columns are "
                f"{', '.join(dataset.column_names)}."
            )
    if spec.chat and not tokenizer.chat_template:
        raise ConfigError(
            f"'dataset.chat: true' but the tokenizer of '{config.base_model}' has no chat template. "
            "Use an instruct model, or set 'dataset.chat: false' to send plain-text prompts."
        )
    if config.num_prompts is not None:
        dataset = dataset.select(range(min(config.num_prompts, len(dataset))))
    dataset = drop_or_refuse_empty_prompts(dataset, spec)

    def to_prompt(row: dict) -> dict:
        question = row[spec.prompt_column]
        if not spec.chat:
            prompt = f"{spec.system_prompt}\n\n{question}" if spec.system_prompt else question
        else:
            system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
            prompt = [*system, {"role": "user", "content": question}]
        out = {"prompt": prompt}
        if spec.answer_column is not None:
            out["answer"] = str(row[spec.answer_column])
        return out

    keep = {"prompt", "answer"}
    return dataset.map(to_prompt, remove_columns=[c for c in dataset.column_names if c not in keep])


def check_rewards_match_dataset(rewards: list[RewardFunc], dataset: Dataset) -> None:
    """A reward that needs a keyword the dataset lacks would fail mid-run; fail now instead."""
    # What TRL 1.16 passes besides the dataset columns (GRPOTrainer._calculate_rewards).
    trl_kwargs = {
        "prompts",
        "completions",
        "completion_ids",
        "trainer_state",
        "log_extra",
        "log_metric",
        "environments",
    }
    available = set(dataset.column_names) | trl_kwargs
    for func in rewards:
        for name, param in inspect.signature(func).parameters.items():
            needed = param.default is inspect.Parameter.empty and param.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            )
            if needed and name not in available:
                raise ConfigError(
                    f"Reward '{func.__module__}.{func.__qualname__}' needs a '{name}' column, but the dataset has "
                    f"{', '.join(sorted(dataset.column_names))}. Set 'dataset.answer_column' or change the reward."
                )


def load_model(config: Config, plan: RunPlan, path: str) -> PreTrainedModel:
    """The base model on the plan's device in its dtype, with a fresh LoRA adapter when ``adapter: lora``
    (merge-aware where the plan says).

    A base the engine will share (``plan.shared_base``) is left in host memory; the trainer moves the
    model once its base weights are the engine's. A 4-bit base is not loaded at all: its layers hold
    nothing until they become views of the engine's NF4 weights (:mod:`colocate_grpo.quantized`).
    """
    if plan.serving is Serving.QUANTIZED_BASE:
        from colocate_grpo.quantized import empty_4bit_model

        model = empty_4bit_model(path, plan.dtype, plan.device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=plan.dtype)
        # A base the engine will share stays in host memory: the trainer then takes the engine's copy and
        # moves the rest, so the device never holds the base twice (colocate_grpo.shared_base).
        if not plan.shared_base:
            model.to(plan.device)
    if not plan.serving.lora:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules="all-linear" if config.lora_target_linear else config.lora_target_modules,
        use_dora=config.peft_use_dora,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    if plan.merge_aware:
        from colocate_grpo.lora import install_merge_aware

        install_merge_aware(model, plan.merge_aware)
    return model


def check_rewards_run(rewards: list[RewardFunc], dataset: Dataset, samples: int = 2) -> None:
    """Call each reward on the first prompts with empty completions, as TRL will, and check its answer.

    A reward that raises, or answers with NaN, a non-number or the wrong number of scores, would otherwise
    stop the run after the model and the engine have loaded. None is a score TRL allows (a reward that does
    not apply to a sample); :mod:`colocate_grpo.rewards` counts them during the run.
    """
    rows = dataset.select(range(min(samples, len(dataset))))
    prompts = rows["prompt"]
    chat = bool(prompts) and isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": ""}] if chat else "" for _ in prompts]
    columns = {name: rows[name] for name in rows.column_names if name != "prompt"}
    for func in rewards:
        name = f"{func.__module__}.{func.__qualname__}"
        try:
            scores = func(prompts=prompts, completions=completions, completion_ids=[[] for _ in prompts], **columns)
        except Exception as err:  # the user's code: any exception means it cannot score
            raise ConfigError(
                f"Reward '{name}' raised {type(err).__name__}: {err} when scoring empty completions of the first "
                f"{len(prompts)} prompts. Make it return a score (e.g. 0.0) for any completion."
            ) from None
        if not isinstance(scores, list | tuple) or len(scores) != len(prompts):
            count = len(scores) if hasattr(scores, "__len__") else type(scores).__name__
            raise ConfigError(
                f"Reward '{name}' returned {count} scores for {len(prompts)} completions: it must return a list "
                "with one float per completion."
            )
        bad = [s for s in scores if s is not None and (not isinstance(s, int | float) or math.isnan(s))]
        if bad:
            raise ConfigError(
                f"Reward '{name}' returned {bad[0]!r} for an empty completion: every score must be a number (not "
                "NaN), or None for a sample the reward does not apply to; give 0.0 to completions that earn nothing."
            )


def check_prompt_lengths(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_prompt_length: int) -> int:
    """Refuse prompts longer than ``max_prompt_length`` tokens before anything loads; returns the longest
    prompt's length in tokens (0 for no prompts), which sizes the KV cache.

    The engine's ``max_model_len`` is prompt + completion, so vLLM would reject a longer prompt in
    the middle of the run; cutting it would silently change the question. Chat prompts are counted
    with the chat template and the generation prompt, as TRL sends them.
    """
    prompts = list(dataset["prompt"])
    if prompts and isinstance(prompts[0], list):
        prompts = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
        lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    else:
        lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    too_long = [n for n in lengths if n > max_prompt_length]
    if too_long:
        raise ConfigError(
            f"{len(too_long)} of {len(lengths)} prompts are longer than 'max_prompt_length' ({max_prompt_length} "
            f"tokens); the longest has {max(too_long)}. Raise max_prompt_length to {max(too_long)} (the engine's "
            "max_model_len grows with it), or leave the long prompts out of the dataset."
        )
    return max(lengths, default=0)
