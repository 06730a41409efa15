"""Where a sync's time goes on the GPU: waking the weights, the eager writes, the CUDA-graph replay, the kernels.

python bench/profile_push.py /tmp/sync_vs_trl_models/1.5B     # a model directory (bench/sync_vs_trl.py builds them)
"""

import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from sync_vs_trl import copy_floor_s
from transformers import AutoModelForCausalLM

from colocate_grpo import sync
from colocate_grpo.config import VLLMConfig
from colocate_grpo.engine import Engine
from colocate_grpo.lora import RetainedUpdate, install_merge_aware


def median_ms(fn, repeats: int = 10) -> float:
    """Median wall time of ``fn`` in milliseconds, the device synchronized around each call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    path = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    install_merge_aware(model, "bf16")
    engine = Engine(path, VLLMConfig(gpu_memory_utilization=0.3, max_model_len=512), max_num_seqs=64)
    sources = sync._sources(model)
    nbytes = sum(s.param.numel() * s.param.element_size() for s in sources)

    def wake() -> None:
        engine.sleep(2)
        torch.cuda.synchronize()
        engine.wake_up(["weights"])

    def asleep_then(push, settle_s: float = 0.0) -> float:  # noqa: ANN001
        times = []
        for _ in range(10):
            engine.sleep(2)
            engine.wake_up(["weights"])
            torch.cuda.synchronize()
            time.sleep(settle_s)
            times.append(median_ms(push, repeats=1))
        return statistics.median(times)

    sleep_wake = median_ms(wake)
    eager = asleep_then(lambda: sync.push_weights(model, engine, RetainedUpdate()))
    graph = asleep_then(lambda: sync.push_weights(model, engine))
    # Whether the driver still works on freshly mapped memory (scrubbing it) when the wake returns.
    settled = asleep_then(lambda: sync.push_weights(model, engine), settle_s=0.2)
    views = median_ms(lambda: engine.parameter_views({s.name: tuple(s.param.shape) for s in sources}))
    floor = 1e3 * copy_floor_s(model)
    print(f"{len(sources)} tensors, {nbytes / 2**30:.2f} GiB; copy floor (read + write once) {floor:.2f} ms")
    print(f"level-2 sleep + wake of the weights {sleep_wake:.2f} ms")
    print(f"push, eager with retained-update statistics {eager:.2f} ms; push, CUDA graph {graph:.2f} ms")
    print(f"push, CUDA graph, 0.2 s after the wake returned {settled:.2f} ms")
    print(f"parameter_views (once per model and engine) {views:.2f} ms")
    writes = sync._in_place_writes(model, engine)
    engine.wake_up(["weights"])
    replay = median_ms(writes.capture.graph.replay)
    addresses = median_ms(lambda: writes.capture.reads_same_memory(True))
    key = median_ms(writes._adapters_key)
    kernels = median_ms(lambda: writes._write(True, None))
    print(f"graph replay alone {replay:.2f} ms; the same writes launched eagerly {kernels:.2f} ms")
    print(f"before a replay, the check of its reads' addresses {addresses:.2f} ms")
    print(f"the graph's key (Python, every sync, read during the replay) {key:.2f} ms")

    # Whether the KV cache's wake (driver calls on the CPU) can run while the push's graph replays.
    def push_then_wake_kv(wait_for_push: bool) -> None:
        sync.push_weights(model, engine)
        if wait_for_push:
            torch.cuda.synchronize()
        engine.wake_up(["kv_cache"])

    serial = asleep_then(lambda: push_then_wake_kv(True))
    overlapped = asleep_then(lambda: push_then_wake_kv(False))
    print(f"push, then the KV cache's wake: in turn {serial:.2f} ms, the wake during the replay {overlapped:.2f} ms")
    engine.wake_up()
    boundary = {
        "torch.cuda.memory_stats": torch.cuda.memory_stats,
        "torch.cuda.mem_get_info": torch.cuda.mem_get_info,
        "torch.cuda.reset_peak_memory_stats": torch.cuda.reset_peak_memory_stats,
        "Engine.pool_bytes": engine.pool_bytes,
        "Engine.reset_prefix_cache": engine.reset_prefix_cache,
    }
    print("per call, ms:", ", ".join(f"{name} {median_ms(fn, repeats=20):.3f}" for name, fn in boundary.items()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        writes._write(True, None)
        torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
