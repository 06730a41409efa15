"""Where vLLM's sleep and wake spend their time on the GPU, with and without training's memory in between.

python bench/profile_sleep_wake.py /tmp/sync_vs_trl_models/1.5B    # a model directory (sync_vs_trl.py builds them)

Each cycle: sleep at level 2, then (in the second round) allocate and free 20 GiB of device memory as
training would (left in torch's cache, which the engine keeps while the device has room), wake the
weights, wake the KV cache. Prints the median milliseconds of each step and of its parts: vLLM's
driver calls (map, unmap), its garbage collection and cache release (which the engine skips), then
the Python functions one more sleep and wake spend the most time in (cProfile), driver calls aside.
"""

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from collections import defaultdict

import torch
from sync_vs_trl import pool_layout, time_sleep_mode_parts

from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import Engine

times: defaultdict[str, list[float]] = defaultdict(list)  # per cycle: seconds of each step and part
cycle: defaultdict[str, float] = defaultdict(float)  # the cycle in progress
current: list[str] = []


def step(name: str, fn) -> None:  # noqa: ANN001
    torch.cuda.synchronize()
    current.append(name)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    cycle[f"{name}_s"] += time.perf_counter() - start
    current.pop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache", default="batch", choices=["batch", "memory_fraction"])
    args = parser.parse_args()
    time_sleep_mode_parts(current, cycle)
    engine = Engine(
        args.model,
        VLLMConfig(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=512, kv_cache=args.kv_cache),
        max_num_seqs=64,
    )
    print("vLLM pool [count, GiB] by tag:", pool_layout())
    for train_gib in (0, 20):
        times.clear()
        for _ in range(args.cycles):
            step("sleep", lambda: engine.sleep(2))
            if train_gib:
                step("train", lambda n=train_gib: torch.ones(n * 2**28, device="cuda").sum().item())
            step("wake_weights", lambda: engine.wake_up(["weights"]))
            step("wake_kv", lambda: engine.wake_up(["kv_cache"]))
            for key, seconds in cycle.items():
                times[key].append(seconds)
            cycle.clear()
        medians = {k.removesuffix("_s"): 1e3 * statistics.median(v[1:] or v) for k, v in sorted(times.items())}
        print(f"training allocates {train_gib} GiB between:", ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        engine.sleep(2)
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
    torch.cuda.synchronize()
    profile.disable()
    print("Three sleep and wake cycles, by cumulative time:")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    start = time.perf_counter()
    collected = gc.collect()
    print(f"gc.collect in this process: {1e3 * (time.perf_counter() - start):.1f} ms ({collected} collected)")
    engine.close()


if __name__ == "__main__":
    main()
