"""From a validated config to the things TRL trains: model, tokenizer, dataset, rewards.

Every check that can fail on user input runs here, before the model loads or
anything is written, and raises :class:`~colocate_grpo.config.ConfigError`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from colocate_grpo.config import Config, ConfigError, DatasetConfig, Problems, did_you_mean
from colocate_grpo.plan import RunPlan
from colocate_grpo.prompts import drop_or_refuse_empty_prompts
from colocate_grpo.serving import Serving
from colocate_grpo.tasks import arithmetic_dataset
from colocate_grpo.tiny import TINY_MODEL_NAME, tiny_model_path

RewardFunc = Callable[..., list[float]]
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def resolve_device(config: Config) -> str:
    """``cuda`` or ``cpu``; ``auto`` picks cuda when a GPU is visible."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device: cuda' but no CUDA GPU is visible. Use 'device: auto' or 'device: cpu'.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
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
    """The base model's directory or hub id; builds the tiny model on first use.

    Raises:
        ConfigError: naming ``base_model`` when it is no model folder, no valid hub id, a model the hub does not
            have (a typo, or private), a gated one, one that is not in the local cache while the hub cannot be
            reached, or a checkpoint stored quantized.
    """
    if config.base_model == TINY_MODEL_NAME:
        return str(tiny_model_path())
    looks_local = config.base_model.startswith((".", "/", "~")) or Path(config.base_model).exists()
    if looks_local and not (Path(config.base_model).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"'base_model: {config.base_model}' is not a model directory (no config.json there). "
            "Give a Hugging Face model folder, a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or 'tiny'."
        )
    path = str(Path(config.base_model).expanduser()) if looks_local else config.base_model
    config_file = Path(path) / "config.json" if looks_local else _hub_config_file(config.base_model)
    _refuse_stored_quantization(config.base_model, config_file)
    return path


def _refuse_stored_quantization(base_model: str, config_file: Path) -> None:
    """Refuse a checkpoint stored quantized (its config's ``quantization_config``: Unsloth's ``-bnb-4bit`` uploads,
    GPTQ, AWQ, FP8). The engine and the trainer compute with the same weights: a merge-aware LoRA merges into the
    checkpoint's bf16 values, and a 4-bit base is quantized from them as the run loads (``load_in_4bit``), the
    trainer and the engine alike."""
    try:
        quantization = json.loads(config_file.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return  # a config no one can read: the tokenizer's and the model's loaders say what is wrong with it
    if not quantization:
        return
    method = quantization.get("quant_method", "a quantization") if isinstance(quantization, dict) else "a quantization"
    raise ConfigError(
        f"'base_model: {base_model}' is stored quantized ({method}, its config.json's quantization_config): a run "
        "trains and serves the checkpoint's bf16 weights. Give the unquantized checkpoint (for Unsloth's uploads, "
        "the name without '-bnb-4bit' or '-unsloth-bnb-4bit'), with 'load_in_4bit: true' for a 4-bit base: the "
        "run quantizes it as it loads, as QLoRA and vLLM do."
    )


def _hub_config_file(repo_id: str) -> Path:
    """The config file of a hub id (from the cache, or the hub where it can be reached); refuses a hub id whose
    config cannot be had."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    key = f"'base_model: {repo_id}'"
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except HFValidationError:
        raise ConfigError(
            f"{key} is neither a model folder here nor a valid hub id (owner/name). Give a model folder, a hub id "
            "such as Qwen/Qwen2.5-0.5B-Instruct, or 'tiny'."
        ) from None
    except GatedRepoError:
        raise ConfigError(
            f"{key} is a gated model: accept its licence on its hub page, then log in (hf auth login) or set HF_TOKEN."
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: the hub has no such model (a typo, or a private model: log in with hf auth login)."
            f"{did_you_mean(repo_id, cached_models())}"
        ) from None
    except Exception as err:  # not cached, and the hub cannot be reached (offline, no network, a hub error)
        cached = cached_models()
        raise ConfigError(
            f"{key} is not in the local Hugging Face cache and the hub cannot be reached ({type(err).__name__}). "
            f"Download it where there is network (hf download {repo_id}) or give a local model folder."
            + (did_you_mean(repo_id, cached) or (f" Models in the cache: {', '.join(cached)}." if cached else ""))
        ) from None


def cached_models() -> list[str]:
    """Hub ids of the models in the local Hugging Face cache (empty when there is none)."""
    from huggingface_hub import scan_cache_dir

    try:
        return sorted(repo.repo_id for repo in scan_cache_dir().repos if repo.repo_type == "model")
    except Exception:  # no cache folder yet, or one being written: nothing to suggest
        return []


def resolve_rewards(config: Config) -> list[RewardFunc]:
    """Import each ``trl.reward_funcs`` entry (``package.module.function``).

    Raises:
        ConfigError: listing every entry that cannot be imported, with the error and where it was raised.
    """
    rewards, problems = [], Problems()
    for dotted in config.reward_funcs:
        with problems.catch():
            rewards.append(_import_reward(dotted))
    problems.raise_if_any()
    return rewards


def _import_reward(dotted: str) -> RewardFunc:
    module_name, _, attr = dotted.rpartition(".")
    key = f"'trl.reward_funcs' entry '{dotted}'"
    try:
        func = getattr(importlib.import_module(module_name), attr) if module_name else None
    except ModuleNotFoundError as err:
        if err.name and not module_name.startswith(err.name) and not err.name.startswith(module_name):
            raise ConfigError(
                f"{key}: importing '{module_name}' needs '{err.name}', which is not installed"
                f"{_where(err)}. Install it (pip install {err.name.split('.')[0]})."
            ) from None
        raise ConfigError(
            f"{key}: cannot import module '{module_name}' ({err}). "
            "Give a dotted path importable from the working directory, e.g. my_rewards.correctness."
        ) from None
    except SyntaxError as err:
        raise ConfigError(
            f"{key}: '{module_name}' has a syntax error at {Path(err.filename or '?').name}, line {err.lineno}: "
            f"{err.msg}. Fix the module."
        ) from None
    except AttributeError:
        func = None
    except Exception as err:  # the user's module raised while importing: any exception means it cannot load
        raise ConfigError(
            f"{key}: importing '{module_name}' raised {type(err).__name__}: {err}{_where(err)}. Fix the module."
        ) from None
    if not callable(func):
        raise ConfigError(f"{key} is not a function. Give module.function, e.g. colocate_grpo.tasks.accuracy_reward.")
    return func


def _where(err: BaseException) -> str:
    """`` (file.py, line N)`` for the innermost frame of ``err``'s traceback, or nothing."""
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename]
    if not user:
        return ""
    return f" ({Path(user[-1].filename).name}, line {user[-1].lineno})"


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with eos as its pad token when it has none.

    Raises:
        ConfigError: naming ``base_model`` when the folder or hub snapshot has no loadable tokenizer.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"'base_model: {path}': its tokenizer could not be loaded ({type(err).__name__}: {_first_line(err)}). "
            "Give a model folder with its tokenizer files, or a hub id in the local cache."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else ""


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
    conversational = _prompts_are_messages(dataset[spec.prompt_column], spec)
    answer_alias = spec.answer_column not in (None, "answer")
    if answer_alias and "answer" in dataset.column_names:
        raise ConfigError(
            f"'dataset.answer_column: {spec.answer_column}' would be passed to rewards as 'answer', but {spec.path} "
            "has an 'answer' column already. Rewards get every column under its own name: remove "
            "'dataset.answer_column' and read the column you need by its name."
        )

    def to_prompt(row: dict) -> dict:
        question = row[spec.prompt_column]
        system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
        if conversational:  # TRL's conversational format: the messages are the prompt
            prompt = [*system, *question]
        elif not spec.chat:
            prompt = f"{spec.system_prompt}\n\n{question}" if spec.system_prompt else question
        else:
            prompt = [*system, {"role": "user", "content": question}]
        out = {"prompt": prompt}
        if answer_alias:  # also under its own name, with its own type, as TRL passes every column
            out["answer"] = row[spec.answer_column]
        return out

    # Every column stays: TRL passes each (but the prompt) to the rewards as a keyword argument.
    return dataset.map(to_prompt)


def _prompts_are_messages(prompts: list, spec: DatasetConfig) -> bool:
    """Whether the prompt column holds chat messages (TRL's conversational format) rather than text.

    Raises:
        ConfigError: for any other value (a number, a mapping, a list that is not role/content messages, nothing),
            for messages with ``dataset.chat: false``, and for messages that carry a system message of their own
            beside ``dataset.system_prompt``.
    """
    key = f"'dataset.prompt_column: {spec.prompt_column}'"
    kinds = [_prompt_kind(prompt) for prompt in prompts]
    for index, (prompt, kind) in enumerate(zip(prompts, kinds, strict=True)):
        if kind is None:
            raise ConfigError(
                f"{key}: row {index} holds {type(prompt).__name__} {str(prompt)[:80]!r}; a prompt must be text, or "
                "a list of chat messages ({role, content}) as TRL's conversational format has. Point prompt_column "
                "at such a column."
            )
    if len(set(kinds)) > 1:
        raise ConfigError(f"{key} mixes text and chat messages: make every row one kind.")
    messages = bool(kinds) and kinds[0] == "messages"
    if messages and not spec.chat:
        raise ConfigError(
            f"{key} holds chat messages but 'dataset.chat: false' asks for plain text: remove 'dataset.chat: false'."
        )
    if messages and spec.system_prompt and any(p and p[0]["role"] == "system" for p in prompts):
        raise ConfigError(
            f"{key}: the prompts carry their own system message, and 'dataset.system_prompt' would add another. "
            "Remove 'dataset.system_prompt'."
        )
    return messages


def _prompt_kind(prompt: object) -> str | None:
    """``text``, ``messages`` (a non-empty list of role/content mappings), or None for anything else."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        return "messages"
    return None


def _is_message(item: object) -> bool:
    return isinstance(item, dict) and isinstance(item.get("role"), str) and "content" in item


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
                fix = (
                    "Set 'dataset.answer_column' to the column that holds the answers"
                    if name == "answer"
                    else f"Rewards get every column under its own name: use a dataset with a '{name}' column"
                )
                raise ConfigError(
                    f"Reward '{func.__module__}.{func.__qualname__}' needs a '{name}' column, but the dataset has "
                    f"{', '.join(sorted(dataset.column_names))}. {fix}, or change the reward's parameter."
                )


def load_model(config: Config, plan: RunPlan, path: str) -> PreTrainedModel:
    """The base model on the plan's device in its dtype, with a fresh LoRA adapter when ``adapter: lora``
    (merge-aware where the plan says).

    A base the engine will share (``plan.shared_base``) is left in host memory; the trainer moves the
    model once its base weights are the engine's. A 4-bit base is not loaded at all: its layers hold
    nothing until they become views of the engine's NF4 weights (:mod:`colocate_grpo.quantized`); or, where the
    plan keeps its NF4 values in bf16, the checkpoint is loaded and its linear weights rounded to them
    (:mod:`colocate_grpo.nf4`).
    """
    if plan.serving is Serving.QUANTIZED_BASE:
        from colocate_grpo.quantized import empty_4bit_model

        model = empty_4bit_model(path, plan.dtype, plan.device)
    else:
        # trl.model_init_kwargs: the attention implementation applies (the dtype is the plan's; validation refuses
        # the other keys rather than ignore them).
        attention = (config.trl.get("model_init_kwargs") or {}).get("attn_implementation")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=plan.dtype, **({"attn_implementation": attention} if attention else {})
            )
        except OSError as err:
            raise ConfigError(
                f"'base_model: {config.base_model}' could not be loaded ({_first_line(err)}). Give a model folder "
                "with its weights, or a hub id in the local cache."
            ) from None
        # A base the engine will share stays in host memory: the trainer then takes the engine's copy and
        # moves the rest, so the device never holds the base twice (colocate_grpo.shared_base).
        if plan.nf4_values:
            from colocate_grpo.nf4 import round_linears_to_nf4

            round_linears_to_nf4(model)
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
