"""What the live views cost a run: the tiny default job with no view, the CLI's PNG, and the notebook widget.

Runs each kind ``--rounds`` times, alternating, in one process (the engine is reused), and prints
each run's training time, the time spent drawing, and the drawing's share of the run. The share is
the direct measure; the time ratio against the run without a view also holds the machine's noise.

    python bench/dashboard_overhead.py --steps 100 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colocate_grpo.config import load_config
from colocate_grpo.dashboard import LiveDashboard, PngWriter
from colocate_grpo.train import build_trainer, default_config_path

KINDS = ("none", "png", "widget")


def run(kind: str, steps: int, output_dir: str) -> dict:
    raw = load_config(default_config_path()).to_dict()
    raw.update(max_steps=steps, output_dir=output_dir)
    trainer = build_trainer(load_config(raw))
    view = None
    if kind == "png":
        view = PngWriter(trainer.metrics.history, Path(output_dir) / "dashboard.png")
    elif kind == "widget":
        view = LiveDashboard(trainer.metrics.history)
    in_view = [0.0]
    if view is not None:
        for hook in ("on_train_begin", "on_log", "on_train_end"):  # everything the view does, drawing or not
            setattr(view, hook, timed(getattr(view, hook), in_view))
        trainer.add_callback(view)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    drawing = view.clock.drawing_seconds if view is not None else 0.0
    return {
        "kind": kind,
        "train_s": seconds,
        "drawing_s": drawing,
        "drawing_share": drawing / seconds,
        "in_view_share": in_view[0] / seconds,
    }


def timed(hook: Callable[..., None], total: list[float]) -> Callable[..., None]:
    def wrapper(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            hook(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="dashboard_overhead.json")
    args = parser.parse_args()
    os.environ.setdefault("TRL_TELEMETRY", "0")
    runs = []
    with tempfile.TemporaryDirectory() as root:
        run("none", 5, f"{root}/warm-up")  # the engine's start and first compiles, outside the measurements
        for round_ in range(args.rounds):
            for kind in KINDS if round_ % 2 == 0 else reversed(KINDS):  # alternate the order
                runs.append({"round": round_, **run(kind, args.steps, f"{root}/{kind}-{round_}")})
                print(json.dumps(runs[-1]), flush=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))
    baseline = statistics.median(r["train_s"] for r in runs if r["kind"] == "none")
    for kind in KINDS:
        mine = [r for r in runs if r["kind"] == kind]
        seconds = statistics.median(r["train_s"] for r in mine)
        drawing = max(r["drawing_share"] for r in mine)
        in_view = max(r.get("in_view_share", 0.0) for r in mine)
        ratio = seconds / baseline
        print(f"{kind:7} train {seconds:6.1f} s ({ratio:.3f}x no view); largest share drawing {drawing:.2%}, ", end="")
        print(f"in the view's callbacks {in_view:.2%}")


if __name__ == "__main__":
    main()
