"""Forward + backward time of merge-aware LoRA against PEFT's ordinary LoRA, side by side in one run.

Per layer (Qwen2.5-1.5B and -7B linear shapes) and for a whole random-weight 1.5B-shaped Qwen2,
bf16 autocast as in training, LoRA r=16, at 1k and 4k tokens per micro-batch. Prints a table and
writes JSON. Needs a CUDA GPU:

    python bench/lora_speed.py --out bench/results/lora_speed_h200.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from shapes import QWEN25
from timing import cuda_time
from transformers import Qwen2Config, Qwen2ForCausalLM

from colocate_grpo import lora
from colocate_grpo.lora import MergeAwareLoraLinear, install_merge_aware

LAYER_SHAPES = {  # (out_features, in_features)
    "1.5B q_proj": (1536, 1536),
    "1.5B gate_proj": (8960, 1536),
    "1.5B down_proj": (1536, 8960),
    "7B q_proj": (3584, 3584),
    "7B gate_proj": (18944, 3584),
    "7B down_proj": (3584, 18944),
}
MODEL_1_5B = {**QWEN25["1.5B"], "max_position_embeddings": 8192}


def kernel_time(fn, iters: int = 5) -> float:
    """Seconds of GPU kernel time per fn() call (profiler), excluding CPU launch gaps."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / iters


class OneLinear(torch.nn.Module):
    def __init__(self, out_f: int, in_f: int):
        super().__init__()
        self.proj = torch.nn.Linear(in_f, out_f, bias=False)

    def forward(self, x):
        return self.proj(x)


def peft_wrap(module: torch.nn.Module, targets) -> torch.nn.Module:
    model = get_peft_model(module, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=1e-3)
    return model


def use_merge_aware(model: torch.nn.Module, on: bool) -> None:
    """Switch the same LoRA layers (same weights) between the two forwards."""
    if on:
        install_merge_aware(model)
        return
    for layer in model.modules():
        if isinstance(layer, MergeAwareLoraLinear):
            layer.__class__ = LoraLinear


def fwd_bwd(model, inputs):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(inputs)
            out = out.logits if hasattr(out, "logits") else out
        out.float().mean().backward()

    return step


def layer_rows(tokens_list):
    rows = []
    for name, (out_f, in_f) in LAYER_SHAPES.items():
        model = peft_wrap(OneLinear(out_f, in_f).cuda().to(torch.bfloat16), ["proj"])
        for tokens in tokens_list:
            x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            use_merge_aware(model, False)
            ordinary = cuda_time(fwd_bwd(model, x))
            ordinary_kernels = kernel_time(fwd_bwd(model, x))
            use_merge_aware(model, True)
            merge_aware_kernels = kernel_time(fwd_bwd(model, x))
            merge_aware = cuda_time(fwd_bwd(model, x))
            lora.FUSED_MERGE = False
            unfused = cuda_time(fwd_bwd(model, x))
            lora.FUSED_MERGE = True
            rows.append(
                {
                    "what": f"layer {name}",
                    "tokens": tokens,
                    "peft_lora_s": ordinary,
                    "merge_aware_s": merge_aware,
                    "ratio": merge_aware / ordinary,
                    "merge_aware_unfused_s": unfused,
                    "peft_kernel_s": ordinary_kernels,
                    "merge_aware_kernel_s": merge_aware_kernels,
                    "kernel_ratio": merge_aware_kernels / ordinary_kernels,
                }
            )
        del model
        torch.cuda.empty_cache()
    return rows


def model_rows(tokens_list):
    rows = []
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**MODEL_1_5B)).to("cuda", torch.bfloat16)
    model = peft_wrap(base, "all-linear")
    for tokens in tokens_list:
        ids = torch.randint(0, 151936, (1, tokens), device="cuda")
        use_merge_aware(model, False)
        torch.cuda.reset_peak_memory_stats()
        ordinary = cuda_time(fwd_bwd(model, ids), iters=5)
        ordinary_peak = torch.cuda.max_memory_allocated()
        ordinary_kernels = kernel_time(fwd_bwd(model, ids), iters=3)
        use_merge_aware(model, True)
        torch.cuda.reset_peak_memory_stats()
        merge_aware = cuda_time(fwd_bwd(model, ids), iters=5)
        merge_aware_kernels = kernel_time(fwd_bwd(model, ids), iters=3)
        rows.append(
            {
                "what": "model 1.5B-shaped",
                "tokens": tokens,
                "peft_lora_s": ordinary,
                "merge_aware_s": merge_aware,
                "ratio": merge_aware / ordinary,
                "peft_peak_gib": ordinary_peak / 2**30,
                "merge_aware_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peft_kernel_s": ordinary_kernels,
                "merge_aware_kernel_s": merge_aware_kernels,
                "kernel_ratio": merge_aware_kernels / ordinary_kernels,
            }
        )
    return rows


def merge_rows():
    """The merge alone, fused against plain PyTorch, and the bandwidth floor (read W + write W, bf16)."""
    rows = []
    for name, (out_f, in_f) in LAYER_SHAPES.items():
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(16, in_f, device="cuda") * 1e-2
        b = torch.randn(out_f, 16, device="cuda") * 1e-2
        merge = functools.partial(lora.merged_weight, w, a, b, 2.0, torch.bfloat16)
        lora.FUSED_MERGE = False
        plain = cuda_time(merge, iters=20)
        reference = merge()
        lora.FUSED_MERGE = True
        fused = cuda_time(merge, iters=20)
        differ = (merge() != reference).float().mean().item()
        rows.append(
            {
                "what": f"merge {name}",
                "plain_s": plain,
                "fused_s": fused,
                "floor_s": 4 * w.numel() / 4.8e12,
                "fused_vs_plain_entries_differing": differ,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="lora_speed.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    merges = merge_rows()
    for r in merges:
        print(
            f"{r['what']:24} plain {1e6 * r['plain_s']:8.1f} us  fused {1e6 * r['fused_s']:8.1f} us  "
            f"floor {1e6 * r['floor_s']:6.1f} us  entries differing {r['fused_vs_plain_entries_differing']:.2e}"
        )
    rows = layer_rows(args.tokens) + model_rows(args.tokens)
    print(
        f"{'what':24} {'tokens':>6} {'wall: PEFT ms':>13} {'merge-aware':>11} {'ratio':>6} "
        f"{'kernels: PEFT ms':>16} {'merge-aware':>11} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['what']:24} {r['tokens']:>6} {1e3 * r['peft_lora_s']:>13.3f} {1e3 * r['merge_aware_s']:>11.3f} "
            f"{r['ratio']:>6.2f} {1e3 * r['peft_kernel_s']:>16.3f} {1e3 * r['merge_aware_kernel_s']:>11.3f} "
            f"{r['kernel_ratio']:>6.2f}"
        )
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rank": 16, "dtype": "bf16 autocast"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "merge": merges, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
