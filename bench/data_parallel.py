"""Data-parallel scaling: the user's plain config on 1, 2, 4, ... GPUs of one host, one engine per GPU.

Each run launches ``python -m colocate_grpo.train`` with torchrun on N ranks (the same per-GPU batch:
8 prompts x 8 generations of 256 tokens a rank, micro-batch 64, everything else a default), and
reads rank 0's ``metrics.jsonl``: the median step time over the steps after the first two, the
samples (completions) per second of all ranks, and whether every rank's engine served the trained
weights bitwise at every check (``served_equals_trained`` is the worst over the ranks). The table
gives each N's samples per second against one GPU's.

    python bench/data_parallel.py --shape 1.5B --ranks 1 2 4 --out data_parallel_1.5B.json   # GPUs
    python bench/data_parallel.py --shape tiny --ranks 1 2 --steps 4                        # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from sync_vs_trl import GENERATION_BATCH, benchmark_prompts, build_model, user_config

HERE = Path(__file__).parent
WARMUP_STEPS = 2  # not timed: the first steps compile and fill caches


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(ranks: int, model_path: str, steps: int, directory: Path) -> dict:
    """One launch on ``ranks`` ranks; its step times and checks from rank 0's metrics."""
    tiny = "tiny" in model_path
    config = user_config(model_path, benchmark_prompts(model_path, 256), steps, tiny, directory)
    if tiny:  # the default job's CPU settings: no compile, the task's reward
        config.update(task="arithmetic", dataset=None, vllm={"enforce_eager": True})
        config["trl"].pop("reward_funcs")
    path = directory / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    command = [*launcher, "--master_port", str(free_port()), "-m", "colocate_grpo.train", str(path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    if tiny:
        env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True)
    (directory / "launch.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"ranks": ranks, "failed": done.stderr[-3000:]}
    events = [json.loads(line) for line in (directory / "run" / "metrics.jsonl").read_text().splitlines()]
    step_s = [e["time/step"] for e in events if "time/step" in e][WARMUP_STEPS:]
    checks = [e[k] for e in events for k in e if k.endswith("served_equals_trained")]
    step = statistics.median(step_s)
    peaks = [v for e in events for k, v in e.items() if k.endswith("device_used_gib")]
    return {
        "ranks": ranks,
        "step_s": step,
        "samples_per_s": ranks * GENERATION_BATCH / step,
        "served_equals_trained": min(checks) if checks else None,
        "checks": len(checks),
        "peak_device_gib": max(peaks, default=None),
    }


def table(results: list[dict]) -> str:
    one = next((r for r in results if r["ranks"] == 1 and "failed" not in r), None)
    lines = ["| ranks | step s | samples/s | vs 1 rank | served == trained | peak device GiB (max over ranks) |"]
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['ranks']} | failed | | | | |")
            continue
        scale = f"{r['samples_per_s'] / one['samples_per_s']:.2f}x" if one else ""
        served = f"{r['served_equals_trained']} ({r['checks']} checks)"
        peak = f"{r['peak_device_gib']:.1f}" if r["peak_device_gib"] is not None else ""
        lines.append(f"| {r['ranks']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | {scale} | {served} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5B", help="1.5B, 7B, ... (bench/shapes.py), or tiny (CPU check)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    parser.add_argument("--out", default="data_parallel.json")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps {args.steps} leaves no step to time: the first {WARMUP_STEPS} are warm-up")
    os.environ.setdefault("TRL_TELEMETRY", "0")
    model_path = build_model(args.shape, Path(args.models) / args.shape)
    results = []
    for ranks in args.ranks:
        results.append(run(ranks, model_path, args.steps, Path(args.models) / f"data_parallel-{args.shape}-{ranks}"))
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
