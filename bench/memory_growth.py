"""Memory over a long run of the default job: does anything grow from step to step?

Runs the tiny default job for ``--steps`` optimizer steps in this process and samples, after
every step, the process's resident memory (RSS) and, on a GPU, the device's used memory and the
trainer's allocated and reserved memory. Prints the samples at a few steps and the growth from
``--settle`` (once allocator pools and caches are warm) to the end, and writes all of it as JSON.

    python bench/memory_growth.py --steps 200 --out bench/results/memory_growth_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import TrainerCallback

from colocate_grpo.config import load_config
from colocate_grpo.train import default_config_path, train

GIB = 2**30


def sample() -> dict[str, float]:
    """Memory now, in GiB."""
    memory = {"rss_gib": psutil.Process().memory_info().rss / GIB}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        memory.update(
            device_used_gib=(total - free) / GIB,
            allocated_gib=torch.cuda.memory_allocated() / GIB,
            reserved_gib=torch.cuda.memory_reserved() / GIB,
        )
    return memory


class Sampler(TrainerCallback):
    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.samples.append({"step": state.global_step, **sample()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--settle", type=int, default=20, help="step from which growth is measured")
    parser.add_argument("--out", default="memory_growth.json")
    args = parser.parse_args()
    if not 1 <= args.settle < args.steps:
        parser.error(
            f"--settle {args.settle} must be at least 1 and below --steps {args.steps}: growth is measured between them"
        )
    os.environ.setdefault("TRL_TELEMETRY", "0")
    sampler = Sampler()
    raw = load_config(default_config_path()).to_dict()
    with tempfile.TemporaryDirectory() as output_dir:
        raw.update(max_steps=args.steps, output_dir=output_dir)
        result = train(load_config(raw), callbacks=[sampler])
    samples = sampler.samples
    settled = next(s for s in samples if s["step"] >= args.settle)
    last = samples[-1]
    growth = {k: last[k] - settled[k] for k in last if k != "step"}
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": args.steps,
        "settle_step": settled["step"],
        "growth_gib": growth,
        "growth_fraction": {k: growth[k] / settled[k] if settled[k] else 0.0 for k in growth},
        "summary": result.summary(),
        "samples": samples,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    keys = [k for k in last if k != "step"]
    print(f"{'step':>6} " + " ".join(f"{k:>15}" for k in keys))
    for s in samples:
        if s["step"] in {1, args.settle, args.steps // 4, args.steps // 2, args.steps} or s is last:
            print(f"{s['step']:>6} " + " ".join(f"{s[k]:>15.4f}" for k in keys))
    print(
        f"growth from step {settled['step']} to {last['step']} (GiB): "
        + ", ".join(f"{k} {v:+.4f}" for k, v in growth.items())
    )
    print(result.summary())


if __name__ == "__main__":
    main()
