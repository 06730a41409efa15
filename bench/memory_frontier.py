"""Which model fits which card with the defaults, for each way of serving the policy.

For each shape (random-weight Qwen2.5 models) and each ``user*`` kind of ``sync_vs_trl.py`` (the
plain config a user writes, plus the one key that picks how the policy is served), the run is tried
on simulated cards of increasing size (all but N GiB of the device taken by one allocation before
the run), smallest first; the first card it runs on ends the search, as every larger card runs it
too. A refusal before the model loads (the memory plan) counts as not running, with its reason.
Each attempt is one ``sync_vs_trl.py`` process of a few steps. Stock TRL's row (``--stock``) runs
at the same settings, where it runs.

    python bench/memory_frontier.py --shapes 1.5B 7B --cards 16 24 40 80 --out memory_frontier.json
    python bench/memory_frontier.py --shapes 7B --kinds user-adapter user-4bit --cards 12 16 24 --micro-batch 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from sync_vs_trl import USER_SERVING

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
        reason = [line for line in result["failed"].splitlines() if line.strip()]
        return {**row, "runs": False, "reason": reason[-1] if reason else f"exit {run.returncode}"}
    return {
        **row,
        "runs": True,
        "step_s": result["step_s"],
        # On a simulated card the device's used memory includes the allocation that simulates it.
        "peak_device_gib": max(result["peak_device_gib"].values()),
        "logp_diff": result["logp_diff"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "3B", "7B", "14B"])
    parser.add_argument("--kinds", nargs="+", default=[k for k in USER_SERVING if k != "user-fp32-head"])
    parser.add_argument("--cards", nargs="+", type=float, default=[16, 24, 40, 80])
    parser.add_argument("--stock", action="store_true", help="also stock TRL at the same settings")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--micro-batch", type=int, default=64, help="sequences per trainer forward (8 fits a 7B shape's on 24 GiB)"
    )
    parser.add_argument("--out", default="memory_frontier.json")
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    args = parser.parse_args()

    rows = []
    for shape in args.shapes:
        for kind in [*args.kinds, *(["stock"] if args.stock else [])]:
            for card in sorted(args.cards):
                row = attempt(shape, kind, card, args.steps, args.models, args.micro_batch)
                rows.append(row)
                Path(args.out).write_text(json.dumps(rows, indent=1))
                shown = f"step {row['step_s']:.2f} s" if row["runs"] else f"does not run: {row['reason'][:160]}"
                print(f"{shape} {kind} on {card:g} GiB: {shown}", flush=True)
                if row["runs"]:
                    break
    print()
    print("| shape | kind | smallest card that runs it (GiB) | step s there |")
    print("|---|---|---|---|")
    for shape in args.shapes:
        for kind in dict.fromkeys(r["kind"] for r in rows if r["shape"] == shape):
            ran = [r for r in rows if r["shape"] == shape and r["kind"] == kind and r["runs"]]
            card, step = (f"{ran[0]['card_gib']:g}", f"{ran[0]['step_s']:.2f}") if ran else ("none tried", "")
            print(f"| {shape} | {kind} | {card} | {step} |")


if __name__ == "__main__":
    main()
