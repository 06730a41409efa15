"""Which model fits which card with the defaults, for each way of serving the policy.

For each shape (random-weight Qwen2.5 models) and each ``user*`` kind of ``sync_vs_trl.py`` (the
plain config a user writes, plus the one key that picks how the policy is served), the run is tried
on simulated cards of increasing size (all but N GiB of the device taken by one allocation before
the run). A run on one card implies a run on every larger one, and a failure failures on every
smaller one, so the search ends when no card is left between the largest that failed and the
smallest that ran. Ours is tried smallest first; a card the run's memory plan refuses (as
``colocate_grpo`` would, before the model loads) counts as not running, with the plan's numbers,
and starts no process. Each attempt is one ``sync_vs_trl.py`` process of a few steps. Stock TRL's
row (``--stock``) runs at the same settings; the plan does not cover it, and it needs the larger
cards, so it is tried largest first.

``--plan-only`` prints the plan's side of the table without a GPU: the smallest card each plan
fits. ``--resume`` keeps the rows ``--out`` already holds and searches only what they leave open,
so the table can be completed over several calls.

    python bench/memory_frontier.py --shapes 1.5B 7B --cards 16 24 40 80 --out memory_frontier.json
    python bench/memory_frontier.py --shapes 7B --kinds user-adapter user-4bit --cards 12 16 24 --micro-batch 8
    python bench/memory_frontier.py --plan-only --micro-batch 8
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sync_vs_trl import PROMPT_TOKENS, USER_SERVING, shape_config, user_config

if TYPE_CHECKING:
    from colocate_grpo.config import Config
    from colocate_grpo.memory_plan import MemoryPlan, ModelShape

HERE = Path(__file__).parent


def attempt(shape: str, kind: str, card_gib: float, steps: int, models: str, micro_batch: int) -> dict:
    """One run of ``kind`` at ``shape`` on a simulated card: its step time and peak, or why it did not run.

    ``micro_batch`` sequences go through the trainer at a time, of the step's 64 (8 prompts x 8 generations)."""
    out = Path(models) / f"frontier-{shape}-{kind}-{card_gib:g}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / "sync_vs_trl.py"), "--shapes", shape, "--kinds", kind]
    command += ["--card-gib", str(card_gib), "--steps", str(steps), "--models", models, "--out", str(out)]
    command += ["--micro-batch", str(micro_batch)]
    run = subprocess.run(command, capture_output=True, text=True)
    results = json.loads(out.read_text()) if out.exists() else []
    result = results[0] if results else {"failed": run.stderr[-2000:]}
    row = {"shape": shape, "kind": kind, "card_gib": card_gib}
    if "failed" in result:
        lines = [line for line in result["failed"].splitlines() if line.strip()]
        # The error's own line, not what the process printed while it exited (NCCL's teardown warning).
        errors = [line for line in lines if "Error" in line and "Warning" not in line]
        reason = (errors or lines or [f"exit {run.returncode}"])[-1]
        return {**row, "runs": False, "reason": reason}
    return {
        **row,
        "runs": True,
        "step_s": result["step_s"],
        "card_used_gib": result["card_used_gib"],
        "logp_diff": result["logp_diff"],
    }


@functools.cache
def _plan_inputs(shape: str, kind: str, models: str, micro_batch: int) -> tuple[Config, ModelShape]:
    """The config a user writes for ``kind`` and the model's shape, from the shape's config alone (written
    beside the models, not in a model's folder): no weights, no GPU."""
    import torch

    from colocate_grpo.config import load_config
    from colocate_grpo.memory_plan import model_shape

    directory = Path(models) / f"{shape}-config-only"
    if not (directory / "config.json").exists():
        shape_config(shape).save_pretrained(directory)
    with tempfile.TemporaryDirectory() as scratch:
        raw = user_config(str(directory), ["t2"], 1, False, Path(scratch), kind=kind, micro_batch=micro_batch)
        config = load_config(raw)
    return config, model_shape(str(directory), torch.bfloat16)


def planned(shape: str, kind: str, card_gib: float, models: str, micro_batch: int) -> MemoryPlan:
    """``colocate_grpo``'s memory plan for ``kind`` at ``shape`` on a card with ``card_gib`` GiB free."""
    import psutil
    import torch

    from colocate_grpo.memory_plan import plan_memory

    config, model = _plan_inputs(shape, kind, models, micro_batch)
    card = int(card_gib * 2**30)
    # The benchmark's prompts are PROMPT_TOKENS words of the word-level tokenizer: that many tokens each.
    return plan_memory(
        config,
        model,
        torch.bfloat16,
        free=card,
        total=card,
        longest_prompt=PROMPT_TOKENS,
        host_free=psutil.virtual_memory().available,
    )


def open_cards(rows: list[dict], shape: str, kind: str, cards: list[float]) -> list[float]:
    """The ``cards`` (ascending) whose outcome for ``kind`` at ``shape`` the ``rows`` do not imply: those larger
    than every card it failed on and smaller than every card it ran on."""
    tried = [r for r in rows if r["shape"] == shape and r["kind"] == kind]
    smallest_ran = min((r["card_gib"] for r in tried if r["runs"]), default=float("inf"))
    largest_failed = max((r["card_gib"] for r in tried if not r["runs"]), default=float("-inf"))
    return [card for card in sorted(cards) if largest_failed < card < smallest_ran]


def print_plan_table(args: argparse.Namespace) -> None:
    print(f"Memory plan, micro-batch {args.micro_batch}: the smallest card (GiB free) each run's plan fits")
    print()
    print("| shape | kind | smallest card the plan fits (GiB) | generation peak there (GiB) |")
    print("|---|---|---|---|")
    for shape in args.shapes:
        for kind in args.kinds:
            fits = [(card, planned(shape, kind, card, args.models, args.micro_batch)) for card in sorted(args.cards)]
            fits = [(card, plan) for card, plan in fits if plan.fits]
            card, peak = (f"{fits[0][0]:g}", f"{fits[0][1].generation_peak / 2**30:.1f}") if fits else ("none", "")
            print(f"| {shape} | {kind} | {card} | {peak} |")


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    """Each kind's smallest card that runs it, with the cards its search has not reached."""
    print("| shape | kind | smallest card that runs it (GiB) | peak used of it (GiB) | plan's peak (GiB) | step s |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        for kind in dict.fromkeys(r["kind"] for r in rows if r["shape"] == shape):
            tried = [r for r in rows if r["shape"] == shape and r["kind"] == kind]
            left = open_cards(rows, shape, kind, args.cards)
            unsearched = f" (not tried: {', '.join(f'{c:g}' for c in left)})" if left else ""
            ran = [r for r in tried if r["runs"]]
            if ran:
                row = min(ran, key=lambda r: r["card_gib"])
                print(
                    f"| {shape} | {kind} | {row['card_gib']:g}{unsearched} | {row['card_used_gib']:.1f} "
                    f"| {_planned(row)} | {row['step_s']:.2f} |"
                )
            else:
                failed = ", ".join(f"{c:g}" for c in sorted(r["card_gib"] for r in tried))
                print(f"| {shape} | {kind} | none of {failed}{unsearched} | | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "3B", "7B", "14B"])
    # The ways of serving a user picks by config (user-own, two copies of the base, is a measurement's, not a user's).
    ways = [k for k in USER_SERVING if k not in ("user-fp32-head", "user-own")]
    parser.add_argument("--kinds", nargs="+", default=ways)
    parser.add_argument("--cards", nargs="+", type=float, default=[12, 16, 24, 40, 80])
    parser.add_argument("--stock", action="store_true", help="also stock TRL at the same settings")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--micro-batch", type=int, default=64, help="sequences per trainer forward (8 fits a 7B shape's on 24 GiB)"
    )
    parser.add_argument("--plan-only", action="store_true", help="the memory plan's table alone (no GPU)")
    parser.add_argument("--resume", action="store_true", help="keep the rows --out holds; search the rest")
    parser.add_argument("--out", default="memory_frontier.json")
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    args = parser.parse_args()

    if args.plan_only:
        print_plan_table(args)
        return
    rows = json.loads(Path(args.out).read_text()) if args.resume and Path(args.out).exists() else []
    for shape in args.shapes:
        for kind in [*args.kinds, *(["stock"] if args.stock else [])]:
            while left := open_cards(rows, shape, kind, args.cards):
                card = left[-1] if kind == "stock" else left[0]
                plan = None if kind == "stock" else planned(shape, kind, card, args.models, args.micro_batch)
                if plan is None or plan.fits:
                    row = attempt(shape, kind, card, args.steps, args.models, args.micro_batch)
                    if plan is not None:
                        row["planned_gib"] = plan.generation_peak / 2**30
                        row["planned_host_gib"] = plan.merge_record_host / 2**30
                else:
                    reason = f"refused by the memory plan: {plan.summary()}"
                    row = {"shape": shape, "kind": kind, "card_gib": card, "runs": False, "reason": reason}
                rows.append(row)
                Path(args.out).write_text(json.dumps(rows, indent=1))
                shown = f"step {row['step_s']:.2f} s" if row["runs"] else f"does not run: {row['reason'][:160]}"
                print(f"{shape} {kind} on {card:g} GiB: {shown}", flush=True)
    print()
    print_table(rows, args)


def _planned(row: dict) -> str:
    """The plan's peak on the device for a row that ran, with what it keeps in host memory; blank for stock
    TRL's rows (the plan does not cover them) and rows recorded before the plan's peak was."""
    if "planned_gib" not in row:
        return ""
    host = row.get("planned_host_gib", 0)
    return f"{row['planned_gib']:.1f}" + (f" (+{host:.1f} in host memory)" if host else "")


if __name__ == "__main__":
    main()
