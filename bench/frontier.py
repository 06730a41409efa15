"""The memory frontier: the smallest simulated card each way of serving runs on, or the longest completion it
trains on one card, and colocate_grpo's plan of it.

For each shape and kind, runs are tried on simulated cards (all but N GiB of the device taken by one allocation
before the run), or at completion lengths on one. A run on one card implies a run on every larger one (at one
length, on every shorter one), and a failure failures on every harder setting, so the search ends when no value
is left between the easiest that failed and the hardest that ran. Ours is tried hardest first; a value the
run's memory plan refuses (as colocate_grpo would, before the model loads) counts as not running, with the
plan's numbers, and starts no process. The other tools' rows (stock TRL, Unsloth) run at the same settings;
the plan does not cover them, so they are tried easiest first.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import Experiment
from kinds import USER_KEYS
from workload import COMPLETION_TOKENS, GENERATION_BATCH, PROMPT_TOKENS, shape_config, user_config

GIB = 2**30


def axis(experiment: Experiment) -> tuple[str, list[float]]:
    """The setting a frontier varies (a result's config key) and its values, hardest first: the cards from the
    smallest, or the completion lengths from the longest."""
    if experiment.completion_lengths:
        return "completion_tokens", sorted(experiment.completion_lengths, reverse=True)
    return "card_gib", sorted(experiment.cards)


def planned_by_us(kind: str) -> bool:
    """Whether colocate_grpo's memory plan covers ``kind`` (the user's config and its one-key variants)."""
    return kind in USER_KEYS


@functools.cache
def config_only(shape: str, models: Path) -> Path:
    """A folder with ``shape``'s config alone, written once a process (a folder of an older shape_config would
    otherwise stay)."""
    directory = models / f"{shape}-config-only"
    shape_config(shape).save_pretrained(directory)
    return directory


@functools.cache
def memory_plan(
    shape: str,
    kind: str,
    card_gib: float,
    micro_batch: int,
    models: Path,
    completion_tokens: int = COMPLETION_TOKENS,
    generation_batch: int = GENERATION_BATCH,
) -> dict[str, Any]:
    """colocate_grpo's memory plan for the user's config of ``kind`` at ``shape`` on a card with ``card_gib``
    GiB free: whether it fits, its peak on the device, the generation's peak and the merge record kept in host
    memory (GiB), the micro-batches and checkpointing it chose, and its one-line summary. Reads the shape's
    config alone: no weights, no GPU."""
    import psutil
    import torch

    from colocate_grpo.config import load_config
    from colocate_grpo.memory_plan import model_shape
    from colocate_grpo.plan import DeviceMemory, plan_run
    from colocate_grpo.train import grpo_args

    directory = config_only(shape, models)
    with tempfile.TemporaryDirectory() as scratch:
        raw = user_config(
            str(directory),
            Path(scratch),
            1,
            micro_batch,
            completion_tokens,
            USER_KEYS[kind],
            [" a"],
            generation_batch=generation_batch,
        )
        config = load_config(raw)
        args = grpo_args(config, "cpu", torch.bfloat16)  # the GPU run's settings; the plan is told the device
    card = int(card_gib * GIB)
    # The benchmark's prompts are PROMPT_TOKENS words, one token each.
    run = plan_run(
        config,
        args,
        model_path=str(directory),
        device="cuda",
        dtype=torch.bfloat16,
        shape=model_shape(str(directory)),
        longest_prompt=PROMPT_TOKENS,
        memory=DeviceMemory(card, card, psutil.virtual_memory().available),
    )
    plan = run.memory
    return {
        "fits": plan.fits,
        "peak_gib": plan.peak / GIB,
        "generation_peak_gib": plan.generation_peak / GIB,
        "merge_record_host_gib": plan.merge_record_host / GIB,
        "training": run.training.describe(),
        "summary": plan.summary(),
    }


def open_values(results: list[dict], shape: str, kind: str, experiment: Experiment) -> list[float]:
    """The values of the frontier's axis (hardest first) whose outcome for ``kind`` at ``shape`` the ``results``
    do not imply: those easier than every value it failed at and harder than every value it ran at."""
    key, values = axis(experiment)
    tried = [r for r in results if r["shape"] == shape and r["kind"] == kind]
    hardest_ran = min((values.index(r["config"][key]) for r in tried if not r["failed"]), default=len(values))
    easiest_failed = max((values.index(r["config"][key]) for r in tried if r["failed"]), default=-1)
    return values[easiest_failed + 1 : hardest_ran]


def search(
    experiment: Experiment,
    models: Path,
    results: list[dict],
    attempt: Callable[[str, str, float], dict],
    refused: Callable[[str, str, float, dict], dict],
    write: Callable[[dict], Path],
) -> list[dict]:
    """Complete the frontier that ``results`` begin: ``attempt(shape, kind, value)`` runs one at a value of the
    frontier's axis (a result of the schema), ``refused(...)`` records a value the plan refuses, ``write`` keeps
    each as it comes."""
    results = list(results)
    key, _ = axis(experiment)
    for shape in experiment.shapes:
        for kind in experiment.kinds:
            while values := open_values(results, shape, kind, experiment):
                ours = planned_by_us(kind)
                value = values[0] if ours else values[-1]
                plan = None
                if ours:
                    card = value if key == "card_gib" else experiment.card_gib
                    length = value if key == "completion_tokens" else experiment.completion_tokens
                    plan = memory_plan(
                        shape, kind, card, experiment.micro_batch, models, int(length), experiment.generation_batch
                    )
                if plan is None or plan["fits"]:
                    result = attempt(shape, kind, value)
                    if plan is not None:
                        result["metrics"]["plan"] = plan
                else:
                    result = refused(shape, kind, value, plan)
                write(result)
                results.append(result)
    return results


def table(results: list[dict], experiment: Experiment) -> str:
    """A Markdown table: each kind's hardest value that runs it (the smallest card, the longest completion), with
    the values its search has not reached."""
    key, _ = axis(experiment)
    what = "smallest card that runs it (GiB)" if key == "card_gib" else "longest completion it trains (tokens)"
    lines = [
        f"| shape | kind | {what} | peak used of the card (GiB) | plan's peak (GiB) | step s |",
        "|---|---|---|---|---|---|",
    ]
    for shape in experiment.shapes:
        for kind in dict.fromkeys(r["kind"] for r in results if r["shape"] == shape):
            tried = [r for r in results if r["shape"] == shape and r["kind"] == kind]
            left = open_values(results, shape, kind, experiment)
            unsearched = f" (not tried: {', '.join(f'{c:g}' for c in left)})" if left else ""
            ran = [r for r in tried if not r["failed"]]
            if not ran:
                failed = ", ".join(f"{c:g}" for c in sorted(r["config"][key] for r in tried))
                lines.append(f"| {shape} | {kind} | none of {failed}{unsearched} | | | |")
                continue
            _, values = axis(experiment)
            best = min(ran, key=lambda r: values.index(r["config"][key]))
            lines.append(
                f"| {shape} | {kind} | {best['config'][key]:g}{unsearched} | "
                f"{best['memory']['card_used_gib']:.1f} | {planned(best)} | {best['summary']['step_s']:.2f} |"
            )
    return "\n".join(lines)


def planned(result: dict) -> str:
    """The plan's peak on the device for a run, with what it keeps in host memory; blank for stock TRL."""
    plan = result["metrics"].get("plan")
    if not plan:
        return ""
    host = plan["merge_record_host_gib"]
    peak = plan.get("peak_gib", plan["generation_peak_gib"])  # results before the plan counted training's peak
    return f"{peak:.1f}" + (f" (+{host:.1f} in host memory)" if host else "")


def print_plan_table(experiment: Experiment, models: Path) -> None:
    """The plan's side of the frontier, without a GPU: the hardest value each kind's plan fits."""
    key, values = axis(experiment)
    where = f"micro-batch {experiment.micro_batch}"
    if key == "completion_tokens":
        where += f", a {experiment.card_gib:g} GiB card"
    what = "smallest card the plan fits (GiB)" if key == "card_gib" else "longest completion the plan fits"
    print(f"Memory plan, {where}: the hardest setting each run's plan fits")
    print(f"| shape | kind | {what} | peak there (GiB) | training there |")
    print("|---|---|---|---|---|")
    for shape in experiment.shapes:
        for kind in filter(planned_by_us, experiment.kinds):
            for value in values:
                card = value if key == "card_gib" else experiment.card_gib
                length = value if key == "completion_tokens" else experiment.completion_tokens
                plan = memory_plan(
                    shape, kind, card, experiment.micro_batch, models, int(length), experiment.generation_batch
                )
                if plan["fits"]:
                    print(f"| {shape} | {kind} | {value:g} | {plan['peak_gib']:.1f} | {plan['training']} |")
                    break
            else:
                print(f"| {shape} | {kind} | none | | |")
