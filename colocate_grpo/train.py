"""Train from a YAML file or a dict: ``python -m colocate_grpo.train [cfg.yaml]``, or ``train(config)``.

With no argument the packaged tiny job runs: a 0.3M-parameter model learns
addition with GRPO through a colocated vLLM engine, on CPU, in a few minutes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from transformers.trainer_callback import ProgressCallback

from colocate_grpo.config import OWN_TRL_KEYS, Config, ConfigError, Problems, load_config, packaged_configs
from colocate_grpo.dashboard import LiveDashboard, PngWriter, summary
from colocate_grpo.engine_state import GenerationWorkerError
from colocate_grpo.memory_plan import (
    DeviceMemoryError,
    MemoryPlanError,
    device_memory_errors,
    model_shape,
    refusal,
)
from colocate_grpo.metrics import REWARD_KEY, MetricsLog, first_and_last_tenth
from colocate_grpo.output_dir import METRICS, OutputDir, check_output_dir
from colocate_grpo.plan import RunPlan, plan_run, read_device_memory
from colocate_grpo.rewards import RewardError
from colocate_grpo.sync import save_merged
from colocate_grpo.training_plan import TrainingPlan
from colocate_grpo.validation import bitwise_problems, liger_problems, precision_problems

if TYPE_CHECKING:  # importing the trainer imports vLLM: deferred until the input is known good
    from colocate_grpo.trainer import ColocateGRPOTrainer

DEFAULT_CONFIG = "tiny"


def default_config_path() -> Path:
    """The packaged tiny job's YAML."""
    return packaged_configs()[DEFAULT_CONFIG]


@dataclass
class TrainResult:
    """What a run produced. Times in seconds."""

    output_dir: Path
    metrics: MetricsLog
    reward_start: float
    reward_end: float
    seconds: float

    def summary(self) -> str:
        steps = self.metrics.history[-1]["step"] if self.metrics.history else 0
        weights = "Adapter" if (self.output_dir / "adapter_config.json").exists() else "Model"
        return (
            f"Trained {steps} steps in {self.seconds:.0f} s. "
            f"Mean reward: first tenth {self.reward_start:.3f} -> last tenth {self.reward_end:.3f}. "
            f"{weights}, config and metrics.jsonl in {self.output_dir}."
        )


# GRPOConfig arguments the run sets that a trl: block may set too: the user's value is taken (bf16 and fp16 where they
# agree with the training dtype, which precision_problems checks before this runs).
USER_SETTABLE_ARGS = ("bf16", "fp16", "report_to", "save_strategy", "ddp_find_unused_parameters")


def grpo_args(config: Config, device: str, dtype: Any, training: TrainingPlan | None = None) -> Any:
    """The TRL GRPOConfig for a run: our top-level keys, the vllm: block, then the trl: block.

    ``training`` is the run plan's micro-batches and gradient checkpointing; None (before the run is planned):
    as the config asks, gradient checkpointing on where it says ``auto``.

    Raises:
        ConfigError: when TRL's GRPOConfig refuses the settings (its own checks), with TRL's message.
    """
    import torch
    from trl import GRPOConfig

    trl_settings = {k: v for k, v in config.trl_settings.items() if k not in OWN_TRL_KEYS}
    ours: dict[str, Any] = dict(
        output_dir=config.output_dir,
        learning_rate=config.learning_rate,
        max_steps=config.max_steps,  # -1: TRL trains for trl.num_train_epochs
        per_device_train_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_checkpointing=config.gradient_checkpointing is not False,
        logging_steps=config.logging_steps,
        save_strategy="steps" if config.save_steps else "no",
        save_steps=config.save_steps or 500,
        seed=config.seed,
        use_cpu=device == "cpu",
        # Mixed precision on the GPU; on the CPU the model itself is in the training dtype.
        bf16=device == "cuda" and dtype == torch.bfloat16,
        fp16=device == "cuda" and dtype == torch.float16,
        report_to="none",  # metrics.jsonl and the dashboard are ours; trl.report_to adds trackers
        # Several ranks: every trainable parameter gets a gradient every step (no extra pass to look for others).
        ddp_find_unused_parameters=False,
        # The engine's token budget per sequence as the user set it; the plan caps it at the model's context.
        vllm_max_model_length=config.vllm.max_model_len or config.max_prompt_length + config.max_completion_length,
    )
    if training is not None:
        ours |= training.grpo_arguments()
        trl_settings.pop("steps_per_generation", None)  # the plan's, derived from it
        trl_settings.pop("generation_batch_size", None)
    for key in USER_SETTABLE_ARGS:
        if key in trl_settings:
            value = trl_settings.pop(key)
            if key not in ("bf16", "fp16"):  # those agree with ours (precision_problems); ours is the device's
                ours[key] = value
    try:
        return GRPOConfig(**ours, **trl_settings)
    except (ValueError, TypeError) as err:  # TRL's and transformers' own checks of the values
        raise ConfigError(f"TRL's GRPOConfig refuses the trl: settings: {err}") from None


class _RewardProgress(ProgressCallback):
    """transformers' progress bar, with the reward in its postfix instead of a printed dict per log."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **_: Any) -> None:
        if self.training_bar is not None and logs and REWARD_KEY in logs:
            self.training_bar.set_postfix(reward=f"{logs[REWARD_KEY]:.3f}", refresh=False)


def is_main_process() -> bool:
    """Whether this process speaks for the run: the only one, or rank 0 of a torchrun / accelerate launch."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass(frozen=True)
class RunInputs:
    """What a run reads before any model loads, each part checked, and its plan (:func:`check_inputs`).

    Attributes:
        rewards: the reward functions; path: the base model's directory; tokenizer, dataset: TRL's.
        args: TRL's GRPOConfig for the run; plan: the run plan (:mod:`colocate_grpo.plan`).
    """

    rewards: list
    path: str
    tokenizer: Any
    dataset: Any
    args: Any
    plan: RunPlan


def check_inputs(config: Config) -> RunInputs:
    """Resolve and check everything a run reads before its model loads, and plan the run (printed).

    Raises:
        ConfigError: on bad input; its MemoryPlanError when the plan cannot fit the device.
    """
    from colocate_grpo import models

    device = models.resolve_device(config)
    # Every problem of the independent parts in one pass: the rewards, the model and its dataset, TRL's arguments.
    problems = Problems()
    rewards = path = tokenizer = dataset = args = None
    longest_prompt = 0
    with problems.catch():
        rewards = models.resolve_rewards(config)
    with problems.catch():
        path = models.model_path(config)
        tokenizer = models.load_tokenizer(path)
        dataset = models.build_dataset(config, tokenizer)
        longest_prompt = models.check_prompt_lengths(dataset, tokenizer, config.max_prompt_length)
    dtype = models.training_dtype(device)
    problems.found.extend(precision_problems(config, dtype))
    problems.found.extend(bitwise_problems(config, device, path, bool(config.trl.get("trust_remote_code"))))
    problems.found.extend(liger_problems(config, device))
    with problems.catch():
        args = grpo_args(config, device, dtype)
    problems.raise_if_any()
    models.check_rewards_match_dataset(rewards, dataset)
    models.check_rewards_run(rewards, dataset)
    shape = model_shape(path, args.trust_remote_code)
    if shape is not None and shape.context and (config.vllm.max_model_len or 0) > shape.context:
        # vLLM refuses a budget beyond the model's positions, once the engine starts; the derived one is capped.
        raise ConfigError(
            f"'vllm.max_model_len: {config.vllm.max_model_len}' is above the context of {config.base_model} "
            f"({shape.context} tokens, its max_position_embeddings), which vLLM refuses: lower it to at most "
            f"{shape.context}, or remove it (the run's budget is then max_prompt_length + max_completion_length, "
            "capped at the context)."
        )
    if config.async_generation and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "'async_generation: true' runs in one process; this launch has several. Remove 'async_generation' to "
            "train data-parallel, or launch one process."
        )
    plan = plan_run(
        config,
        args,
        model_path=path,
        device=device,
        dtype=dtype,
        shape=shape,
        longest_prompt=longest_prompt,
        memory=read_device_memory() if device == "cuda" else None,
    )
    if plan.memory is not None and not plan.memory.fits:
        raise MemoryPlanError(refusal(plan.memory, config, plan.serving.serves_adapter))
    if is_main_process():
        print(plan.summary())
    return RunInputs(rewards, path, tokenizer, dataset, grpo_args(config, device, dtype, plan.training), plan)


def build_trainer(
    config: Config | str | Path | dict | None = None, callbacks: list | None = None
) -> ColocateGRPOTrainer:
    """A ready :class:`~colocate_grpo.trainer.ColocateGRPOTrainer` for ``config``; nothing written yet.

    The trainer carries ``metrics`` (a :class:`MetricsLog`), ``run_config``, ``run_folder`` and ``plan``. Its
    engine is the process's live one when that was built for the plan's engine (see ``shared_engine``).
    ``trainer.train()`` takes the output folder's lock while it trains, resumes from ``resume_from_checkpoint``
    and clears or repairs the folder as ``train()`` does. ``trainer.close()`` (or ``with``) shuts the engine down
    for good.

    Raises:
        ConfigError: on bad input, before any model is loaded or any file is written; the output folder is
            checked as ``train()`` checks it (an earlier run there is refused unless resumed or overwritten).
    """
    if not isinstance(config, Config):
        config = load_config(default_config_path() if config is None else config)
    return _build_trainer(config, callbacks, check_output_dir(config, claim=False))


def _build_trainer(config: Config, callbacks: list | None, run_folder: OutputDir) -> ColocateGRPOTrainer:
    """:func:`build_trainer` for a config whose output folder ``run_folder`` is checked."""
    from colocate_grpo import models
    from colocate_grpo.engine_registry import refuse_unservable_run

    inputs = check_inputs(config)
    plan = inputs.plan
    refuse_unservable_run(plan.engine)
    with device_memory_errors("load the model and start the engine", plan.memory, config, plan.training):
        if plan.bitwise is not None:  # vLLM's batch-invariant mode before this process's first CUDA matmul
            from colocate_grpo.bitwise import prepare_process

            prepare_process()
        model = models.load_model(config, plan, inputs.path)
        from colocate_grpo.trainer import ColocateGRPOTrainer  # imports vLLM: only once the input is known good

        trainer_class = ColocateGRPOTrainer
        if plan.asynchronous is not None:
            from colocate_grpo.async_generation import AsyncColocateGRPOTrainer

            trainer_class = AsyncColocateGRPOTrainer
        metrics = MetricsLog(Path(config.output_dir) / METRICS)
        trainer = trainer_class(
            model=model,
            reward_funcs=inputs.rewards,
            args=inputs.args,
            plan=plan,
            train_dataset=inputs.dataset,
            processing_class=inputs.tokenizer,
            callbacks=[metrics, *(callbacks or [])],
            merge_check_interval=config.trl_settings["vllm_merge_check_interval"],
            group_by_length=config.group_by_length,
        )
    metrics.context["served_as"] = trainer.served_as
    # transformers prints every metric per log (a table in notebooks); show a bar with the reward instead.
    # Only a notebook has transformers' notebook module loaded (it imports IPython, which the CLI may lack).
    notebook_progress = getattr(sys.modules.get("transformers.utils.notebook"), "NotebookProgressCallback", None)
    progress_types = tuple(t for t in (ProgressCallback, notebook_progress) if t is not None)
    progress = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, progress_types)]
    if progress:
        for callback in progress:
            trainer.remove_callback(callback)
        trainer.add_callback(_RewardProgress())
    trainer.metrics = metrics
    trainer.run_config = config
    trainer.run_folder = run_folder
    return trainer


def train(
    config: Config | str | Path | dict | None = None,
    callbacks: list | None = None,
    plots: bool = False,
    dashboard: bool = False,
) -> TrainResult:
    """Run GRPO as ``config`` says and save the adapter, the config and ``metrics.jsonl`` to output_dir.

    The engine is left asleep (its device memory freed on GPUs) for the next run in this process.

    Args:
        config: a :class:`Config`, a YAML path or text, a dict, or None for the tiny default job.
        callbacks: extra ``transformers.TrainerCallback`` objects (e.g. the notebook dashboard).
        plots: also write ``output_dir/dashboard.png`` during and after training (the CLI does).
        dashboard: show the live dashboard in the notebook cell that runs this (needs ipywidgets).

    Raises:
        ConfigError: on bad input, before any model is loaded or any file is written (but the output folder's lock,
            removed again).
        RewardError: when a reward fails during training (:mod:`colocate_grpo.rewards`).
    """
    started = time.perf_counter()
    if not isinstance(config, Config):
        config = load_config(default_config_path() if config is None else config)
    run_folder = check_output_dir(config)  # refusals before anything loads; holds the folder's lock to the end
    live = LiveDashboard() if dashboard else None  # on screen at once, while the model and the engine load
    try:
        trainer = _build_trainer(config, callbacks, run_folder)
    except BaseException:
        run_folder.release()
        raise
    metrics = trainer.metrics
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        (output_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        (output_dir / "plan.yaml").write_text(yaml.safe_dump(trainer.plan.to_dict(), sort_keys=False))
    if plots:
        trainer.add_callback(PngWriter(metrics.history, output_dir / "dashboard.png"))
    if live is not None:
        live.history = metrics.history
        trainer.add_callback(live)
    try:
        trainer.train()  # from the checkpoint run_folder names; out of memory: a DeviceMemoryError naming the phase
        trainer.save_model(str(output_dir))
        if config.save_merged and is_main_process():
            save_merged(trainer.model, output_dir / "merged", trainer.processing_class)
    finally:
        # Asleep, not closed: the next train() in this process reuses the engine (see shared_engine).
        trainer.engine.sleep()
        run_folder.release()
    start, end = first_and_last_tenth([v for _, v in metrics.series(REWARD_KEY)])
    return TrainResult(output_dir, metrics, start, end, time.perf_counter() - started)


# The errors the CLI reports in one line, without a traceback: what it prints before the message, and its exit code.
_STOPS: dict[type[Exception], tuple[str, int]] = {
    ConfigError: ("config error", 2),
    DeviceMemoryError: ("out of memory", 1),
    RewardError: ("reward error", 1),
    GenerationWorkerError: ("generation error", 1),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colocate_grpo.train", description=__doc__.splitlines()[0])
    parser.add_argument(
        "config",
        nargs="?",
        help=f"a YAML file, or a packaged config's name: {', '.join(packaged_configs())} (default: {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, the dataset's prompts and the rewards, print the run plan (with its memory on a GPU)",
    )
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TRL_TELEMETRY", "0")
    try:
        config = load_config(options.config or default_config_path())
        if options.check:
            check_inputs(config)
            check_output_dir(config, claim=False)
            print(f"{options.config or DEFAULT_CONFIG}: OK")
            return 0
        result = train(config, plots=True)
    except tuple(_STOPS) as err:
        what, code = next(stop for kind, stop in _STOPS.items() if isinstance(err, kind))
        print(f"colocate_grpo: {what}: {err}", file=sys.stderr)
        return code
    if is_main_process():  # the other ranks trained the same run; rank 0 logged it
        print(summary(result.metrics.history))
        print(result.summary() + f" Figure: {result.output_dir / 'dashboard.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
