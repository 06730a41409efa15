"""Generation with vLLM's LoRA kernels under the options vLLM offers, against the same model without LoRA.

Adapter serving generates through vLLM's punica kernels: per LoRA layer and decode step a memset, a
shrink (x @ A, split over the input dimension) and an expand (+= . @ B), 28 layers x 4 layers each
at the Qwen2.5 shapes. Each variant runs in its own process on the same random-weight model and batch
as ``sync_vs_trl.py`` (8 prompts x 8 generations, 256 completion tokens, temperature 1, CUDA graphs),
with a rank-16 adapter on every linear (random factors):

- ``merged``: no LoRA (what merged serving generates with);
- ``lora``: vLLM's LoRA as colocate_grpo starts it (max rank 16, one adapter);
- ``lora-specialize``: ``specialize_active_lora=True`` (the kernels' grid sized to the active adapters);
- ``lora-dual-stream``: ``VLLM_LORA_ENABLE_DUAL_STREAM=1`` (the LoRA work on a second CUDA stream);
- ``lora-splitk-N``: the shrink kernel's split of the input dimension set to N for decode batches
  (vLLM's default for batches under 128 is 64) through ``VLLM_TUNED_CONFIG_FOLDER``;
- ``lora-tuned``: the tuned-config files that ``lora_kernel_configs.py`` wrote (``--tuned-configs DIR``).

A variant this vLLM does not have fails alone and is reported as such. ``--profile`` (CUDA) runs one
more batch under ``torch.profiler``: the device's kernel time against the batch's wall time (the rest is
the device waiting on the host) and the LoRA kernels' share, which say whether LoRA's extra time is
spent on the device or between its launches.

    python bench/lora_generate_variants.py --shape 1.5B --out lora_generate_variants_1.5B.json
    python bench/lora_generate_variants.py --shape 7B --variants merged lora --profile
    python bench/lora_generate_variants.py --shape 7B --variants merged lora lora-tuned --tuned-configs DIR
    python bench/lora_generate_variants.py --shape tiny --variants merged lora --batches 2   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from generate_speed import COMPLETION_TOKENS, GENERATIONS, PROMPTS, prompts

RANK = 16
VARIANTS = ["merged", "lora", "lora-specialize", "lora-dual-stream", "lora-splitk-16", "lora-splitk-8", "lora-splitk-4"]


def write_adapter(model_path: str, directory: Path) -> None:
    """A rank-16 PEFT adapter on every linear of the model at ``model_path``, random factors, built from its
    config alone (no weights loaded)."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file
    from shapes import layer_linears
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    linears = layer_linears(config.to_dict())
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (fan_out, fan_in) in linears.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, fan_in, generator=generator) / fan_in**0.5).to(
                torch.bfloat16
            )
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, RANK, generator=generator) * 1e-3).to(
                torch.bfloat16
            )
    targets = [name.split(".")[1] for name in linears]
    LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets, task_type="CAUSAL_LM").save_pretrained(directory)
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def write_shrink_config(directory: Path, split_k: int) -> None:
    """vLLM's tuned-config file for the shrink kernel on this GPU: ``split_k`` for batches under 128 tokens,
    vLLM's own default above (prefill). Keys: max_loras + 1, slices, batch, then input and rank dimensions
    (one key each: vLLM takes the nearest)."""
    import torch

    small = {"block_m": 32, "block_n": 16, "block_k": 256, "split_k": split_k}
    large = {"block_m": 32, "block_n": 16, "block_k": 32, "split_k": 8}
    common = {"num_warps": 4, "num_ctas": 1, "group_size_m": 8, "num_stages": 2, "max_nreg": None}
    by_batch = {str(2**i): {"1": {str(RANK): {**(small if 2**i < 128 else large), **common}}} for i in range(14)}
    table = {"2": {str(slices): by_batch for slices in (1, 2, 3)}}
    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
    (directory / f"{gpu}_SHRINK.json").write_text(json.dumps(table))


def profile_generate(generate: Callable[[], object]) -> dict:
    """One batch under ``torch.profiler``: its wall time, the device's kernel time (seconds), the LoRA
    kernels' (vLLM's punica shrink and expand, by name), the number of kernels and the top kernels by time."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        torch.cuda.synchronize()
        began = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - began
    kernels = [event for event in profile.key_averages() if event.device_time_total > 0]
    top = sorted(kernels, key=lambda event: event.device_time_total, reverse=True)[:12]
    return {
        "profiled_wall_s": wall_s,
        "kernel_s": sum(event.device_time_total for event in kernels) / 1e6,
        "lora_kernel_s": sum(event.device_time_total for event in kernels if "lora" in event.key.lower()) / 1e6,
        "kernel_count": sum(event.count for event in kernels),
        "top_kernels": [[event.key[:120], event.device_time_total / 1e6, event.count] for event in top],
    }


def run_one(variant: str, model_path: str, adapter: str, batches: int, profile: bool) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from colocate_grpo.engine import lora_engine_arguments

    lora = variant != "merged"
    tiny = "tiny" in model_path
    completion_tokens = 4 if tiny else COMPLETION_TOKENS
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    started = time.perf_counter()
    llm = LLM(
        model=model_path,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=None if tiny else 512 + COMPLETION_TOKENS,
        max_num_seqs=PROMPTS * GENERATIONS,
        seed=0,
        **(lora_engine_arguments(RANK) if lora else {}),  # as colocate_grpo's engine starts it
        **({"specialize_active_lora": True} if variant == "lora-specialize" else {}),
    )
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=1.0, max_tokens=completion_tokens, ignore_eos=True, logprobs=0, seed=0)
    request = LoRARequest("policy", 1, adapter) if lora else None
    batch = prompts(model_path)
    times = []
    for _ in range(batches + 1):  # the first batch warms up (and loads the adapter)
        synchronize()
        began = time.perf_counter()
        llm.generate(batch, params, lora_request=request, use_tqdm=False)
        synchronize()
        times.append(time.perf_counter() - began)
    result = {"variant": variant, "start_s": start_s, "generate_s": statistics.median(times[1:]), "all_s": times}
    if profile:
        result |= profile_generate(lambda: llm.generate(batch, params, lora_request=request, use_tqdm=False))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5B")
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--out", default="lora_generate_variants.json")
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    parser.add_argument("--profile", action="store_true", help="one more batch under torch.profiler (CUDA)")
    parser.add_argument("--tuned-configs", help="lora-tuned's folder of vLLM tuned-config files")
    parser.add_argument("--child", nargs=4, metavar=("VARIANT", "MODEL", "ADAPTER", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.child:
        variant, model_path, adapter, out = args.child
        Path(out).write_text(json.dumps(run_one(variant, model_path, adapter, args.batches, args.profile)))
        return
    if "lora-tuned" in args.variants and not args.tuned_configs:
        parser.error("lora-tuned generates with the configs of --tuned-configs DIR (see lora_kernel_configs.py)")
    if args.profile:
        import torch

        if not torch.cuda.is_available():
            parser.error("--profile reads the CUDA kernels' time: it needs a CUDA GPU")

    from sync_vs_trl import build_model

    model_path = build_model(args.shape, Path(args.models) / args.shape)
    scratch = Path(tempfile.mkdtemp())
    adapter = scratch / "adapter"
    write_adapter(model_path, adapter)
    results = []
    for variant in args.variants:
        env = dict(os.environ)
        if variant == "lora-dual-stream":
            env["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1"
        if variant.startswith("lora-splitk-"):
            folder = scratch / variant
            folder.mkdir()
            write_shrink_config(folder, int(variant.removeprefix("lora-splitk-")))
            env["VLLM_TUNED_CONFIG_FOLDER"] = str(folder)
        if variant == "lora-tuned":
            env["VLLM_TUNED_CONFIG_FOLDER"] = str(Path(args.tuned_configs).resolve())
        out = scratch / f"{variant}.json"
        command = [sys.executable, __file__, "--batches", str(args.batches), *["--profile"] * args.profile]
        command += ["--child", variant, model_path]
        run = subprocess.run([*command, str(adapter), str(out)], env=env, capture_output=True, text=True)
        if run.returncode != 0 or not out.exists():
            tail = [line for line in run.stderr.splitlines() if line.strip()][-3:]
            print(f"{args.shape} {variant}: failed (exit {run.returncode}): {' / '.join(tail)}", flush=True)
            results.append({"shape": args.shape, "variant": variant, "failed": run.stderr[-3000:]})
        else:
            results.append({"shape": args.shape, **json.loads(out.read_text())})
            print(f"{args.shape} {variant:18s} generate {results[-1]['generate_s']:.3f} s", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    merged = next((r for r in results if r["variant"] == "merged" and "failed" not in r), None)
    print()
    print("| shape | variant | generate s | against merged | profiled: wall s | kernels s | LoRA kernels s | kernels |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "failed" in r:
            print(f"| {r['shape']} | {r['variant']} | failed | | | | | |")
            continue
        ratio = f"{r['generate_s'] / merged['generate_s']:.3f}x" if merged else ""
        profiled = [f"{r[key]:.3f}" if key in r else "" for key in ("profiled_wall_s", "kernel_s", "lora_kernel_s")]
        cells = [r["shape"], r["variant"], f"{r['generate_s']:.3f}", ratio, *profiled, str(r.get("kernel_count", ""))]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
