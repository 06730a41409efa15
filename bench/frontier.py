"""The memory frontier: the smallest simulated card each way of serving runs on, and colocate_grpo's plan of it.

For each shape and kind, runs are tried on simulated cards (all but N GiB of the device taken by one allocation
before the run). A run on one card implies a run on every larger one, and a failure failures on every smaller
one, so the search ends when no card is left between the largest that failed and the smallest that ran. Ours
is tried smallest first; a card the run's memory plan refuses (as colocate_grpo would, before the model loads)
counts as not running, with the plan's numbers, and starts no process. Stock TRL's row runs at the same
settings; the plan does not cover it, and it needs the larger cards, so it is tried largest first.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import Experiment
from kinds import USER_KEYS
from workload import COMPLETION_TOKENS, PROMPT_TOKENS, shape_config, user_config

GIB = 2**30


@functools.cache
def memory_plan(shape: str, kind: str, card_gib: float, micro_batch: int, models: Path) -> dict[str, Any]:
    """colocate_grpo's memory plan for the user's config of ``kind`` at ``shape`` on a card with ``card_gib``
    GiB free: whether it fits, the generation's peak on the device and the merge record kept in host memory
    (GiB), and the plan's one-line summary. Reads the shape's config alone: no weights, no GPU."""
    import psutil
    import torch

    from colocate_grpo.config import load_config
    from colocate_grpo.memory_plan import model_shape
    from colocate_grpo.plan import DeviceMemory, plan_run
    from colocate_grpo.train import grpo_args

    directory = models / f"{shape}-config-only"
    if not (directory / "config.json").exists():
        shape_config(shape).save_pretrained(directory)
    with tempfile.TemporaryDirectory() as scratch:
        raw = user_config(str(directory), Path(scratch), 1, micro_batch, COMPLETION_TOKENS, USER_KEYS[kind], ["t2"])
        config = load_config(raw)
        args = grpo_args(config, "cpu", torch.bfloat16)  # the GPU run's settings; the plan is told the device
    card = int(card_gib * GIB)
    # The benchmark's prompts are PROMPT_TOKENS words of the word-level tokenizer: that many tokens each.
    plan = plan_run(
        config,
        args,
        model_path=str(directory),
        device="cuda",
        dtype=torch.bfloat16,
        shape=model_shape(str(directory)),
        longest_prompt=PROMPT_TOKENS,
        memory=DeviceMemory(card, card, psutil.virtual_memory().available),
    ).memory
    return {
        "fits": plan.fits,
        "generation_peak_gib": plan.generation_peak / GIB,
        "merge_record_host_gib": plan.merge_record_host / GIB,
        "summary": plan.summary(),
    }


def open_cards(results: list[dict], shape: str, kind: str, cards: tuple[float, ...]) -> list[float]:
    """The ``cards`` (ascending) whose outcome for ``kind`` at ``shape`` the ``results`` do not imply: those
    larger than every card it failed on and smaller than every card it ran on."""
    tried = [r for r in results if r["shape"] == shape and r["kind"] == kind]
    smallest_ran = min((r["config"]["card_gib"] for r in tried if not r["failed"]), default=float("inf"))
    largest_failed = max((r["config"]["card_gib"] for r in tried if r["failed"]), default=float("-inf"))
    return [card for card in sorted(cards) if largest_failed < card < smallest_ran]


def search(
    experiment: Experiment,
    models: Path,
    results: list[dict],
    attempt: Callable[[str, str, float], dict],
    refused: Callable[[str, str, float, dict], dict],
    write: Callable[[dict], Path],
) -> list[dict]:
    """Complete the frontier that ``results`` begin: ``attempt(shape, kind, card)`` runs one (a result of the
    schema), ``refused(...)`` records a card the plan refuses, ``write`` keeps each as it comes."""
    results = list(results)
    for shape in experiment.shapes:
        for kind in experiment.kinds:
            while cards := open_cards(results, shape, kind, experiment.cards):
                card = cards[-1] if kind.startswith("stock") else cards[0]
                plan = (
                    None if kind.startswith("stock") else memory_plan(shape, kind, card, experiment.micro_batch, models)
                )
                if plan is None or plan["fits"]:
                    result = attempt(shape, kind, card)
                    if plan is not None:
                        result["metrics"]["plan"] = plan
                else:
                    result = refused(shape, kind, card, plan)
                write(result)
                results.append(result)
    return results


def table(results: list[dict], experiment: Experiment) -> str:
    """A Markdown table: each kind's smallest card that runs it, with the cards its search has not reached."""
    lines = [
        "| shape | kind | smallest card that runs it (GiB) | peak used of it (GiB) | plan's peak (GiB) | step s |",
        "|---|---|---|---|---|---|",
    ]
    for shape in experiment.shapes:
        for kind in dict.fromkeys(r["kind"] for r in results if r["shape"] == shape):
            tried = [r for r in results if r["shape"] == shape and r["kind"] == kind]
            left = open_cards(results, shape, kind, experiment.cards)
            unsearched = f" (not tried: {', '.join(f'{c:g}' for c in left)})" if left else ""
            ran = [r for r in tried if not r["failed"]]
            if not ran:
                failed = ", ".join(f"{c:g}" for c in sorted(r["config"]["card_gib"] for r in tried))
                lines.append(f"| {shape} | {kind} | none of {failed}{unsearched} | | | |")
                continue
            best = min(ran, key=lambda r: r["config"]["card_gib"])
            lines.append(
                f"| {shape} | {kind} | {best['config']['card_gib']:g}{unsearched} | "
                f"{best['memory']['card_used_gib']:.1f} | {planned(best)} | {best['summary']['step_s']:.2f} |"
            )
    return "\n".join(lines)


def planned(result: dict) -> str:
    """The plan's peak on the device for a run, with what it keeps in host memory; blank for stock TRL."""
    plan = result["metrics"].get("plan")
    if not plan:
        return ""
    host = plan["merge_record_host_gib"]
    return f"{plan['generation_peak_gib']:.1f}" + (f" (+{host:.1f} in host memory)" if host else "")


def print_plan_table(experiment: Experiment, models: Path) -> None:
    """The plan's side of the frontier, without a GPU: the smallest card each kind's plan fits."""
    print(f"Memory plan, micro-batch {experiment.micro_batch}: the smallest card (GiB free) each run's plan fits")
    print("| shape | kind | smallest card the plan fits (GiB) | generation peak there (GiB) |")
    print("|---|---|---|---|")
    for shape in experiment.shapes:
        for kind in experiment.kinds:
            plans = [
                (card, memory_plan(shape, kind, card, experiment.micro_batch, models)) for card in experiment.cards
            ]
            fits = [(card, plan) for card, plan in sorted(plans) if plan["fits"]]
            card, peak = (f"{fits[0][0]:g}", f"{fits[0][1]['generation_peak_gib']:.1f}") if fits else ("none", "")
            print(f"| {shape} | {kind} | {card} | {peak} |")
