"""Generation speed of the colocated engine: stock TRL's vLLM settings against colocate_grpo's defaults.

Each engine runs in its own process (vLLM allows one sleep-mode engine per process) on the same
random-weight model and the same batch as ``sync_vs_trl.py`` (8 prompts x 8 generations, 256
completion tokens, TRL's sampling: temperature 1, the sampled token's logprob). Engines:

- ``stock``: ``vllm.LLM`` built with the arguments TRL's colocate mode passes (memory fraction 0.3,
  max model length 512, its KV cache all the fraction leaves).
- ``ours``: ``colocate_grpo.engine.Engine`` with every ``vllm:`` key at its default and the engine
  length a user's config gives (512 prompt + 256 completion tokens).
- ``ours-512``, ``ours-0.3``, ``ours-fraction``: ``ours`` with one setting as stock's (max model length
  512; memory fraction 0.3; the KV cache all the fraction leaves).

Each engine sleeps and wakes (level 1: the weights stay valid) before every timed batch, as in training.

    python bench/generate_speed.py --shape 1.5B --out generate_speed_1.5B.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = 8
GENERATIONS = 8
COMPLETION_TOKENS = 256
ENGINES = ["stock", "ours", "ours-512", "ours-0.3", "ours-fraction"]


def prompts(model_path: str) -> list[str]:
    """The batch: ``sync_vs_trl.py``'s prompts, each ``GENERATIONS`` times."""
    from sync_vs_trl import benchmark_prompts

    return [p for p in benchmark_prompts(model_path, PROMPTS) for _ in range(GENERATIONS)]


def start(kind: str, model_path: str):  # noqa: ANN201 (an LLM or an Engine)
    """The engine of ``kind`` and the object whose generate/sleep/wake_up the timing calls."""
    batch = PROMPTS * GENERATIONS
    if kind == "stock":
        from vllm import LLM

        return LLM(
            model=model_path,
            gpu_memory_utilization=0.3,
            max_model_len=512,
            max_num_seqs=batch,
            enable_sleep_mode=True,
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",
            seed=0,
        )
    from colocate_grpo.config import VLLMConfig
    from colocate_grpo.engine import Engine

    options = VLLMConfig(max_model_len=512 if kind in ("ours-512", "ours-fraction") else 512 + COMPLETION_TOKENS)
    if kind.startswith("ours-0"):
        options.gpu_memory_utilization = float(kind.removeprefix("ours-"))
    if kind == "ours-fraction":
        options.gpu_memory_utilization = 0.3
    if kind == "ours-fraction":
        options.kv_cache = "memory_fraction"
    return Engine(model_path, options, dtype="bfloat16", max_num_seqs=batch)


def run_one(kind: str, model_path: str, batches: int) -> dict:
    import torch
    from vllm import SamplingParams

    free_before = torch.cuda.mem_get_info()[0]
    started = time.perf_counter()
    engine = start(kind, model_path)
    start_s = time.perf_counter() - started
    engine_gib = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
    params = SamplingParams(temperature=1.0, max_tokens=COMPLETION_TOKENS, logprobs=0, seed=0)
    batch = prompts(model_path)
    times, tokens = [], []
    for _ in range(batches + 1):  # the first batch warms up
        engine.sleep(level=1)
        engine.wake_up()
        torch.cuda.synchronize()
        began = time.perf_counter()
        outputs = engine.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
    return {
        "kind": kind,
        "start_s": start_s,
        "engine_gib": engine_gib,
        "generate_s": statistics.median(times[1:]),
        "generate_all_s": times,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5B")
    parser.add_argument("--engines", nargs="+", default=ENGINES)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--out", default="generate_speed.json")
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "MODEL_PATH", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.child:
        kind, model_path, out = args.child
        Path(out).write_text(json.dumps(run_one(kind, model_path, args.batches)))
        return

    sys.path.insert(0, str(Path(__file__).parent))
    from sync_vs_trl import build_model

    model_path = build_model(args.shape, Path(args.models) / args.shape)
    results = []
    for kind in args.engines:
        out = Path(args.models) / f"{args.shape}-generate-{kind}.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--batches", str(args.batches), "--child", kind, model_path, str(out)]
        run = subprocess.run(command, capture_output=True, text=True)
        graphs = [line for line in run.stderr.splitlines() + run.stdout.splitlines() if "raph capturing" in line]
        if run.returncode != 0 or not out.exists():
            print(f"{kind}: failed (exit {run.returncode})\n{run.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append({"shape": args.shape, **json.loads(out.read_text()), "graph_log": graphs})
        r = results[-1]
        print(
            f"{args.shape} {kind:14s} generate {r['generate_s']:.3f} s  tokens {r['tokens'][-1]}  "
            f"start {r['start_s']:.1f} s  engine {r['engine_gib']:.2f} GiB  {' | '.join(graphs)}",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(results, indent=1))
    stock = next((r for r in results if r["kind"] == "stock"), None)
    if stock:
        for r in results:
            print(f"{r['kind']:14s} generate / stock {r['generate_s'] / stock['generate_s']:.3f}x")


if __name__ == "__main__":
    main()
