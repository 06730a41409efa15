"""Tiles and warps of the fused merge kernel on a model's LoRA linears: device time, bandwidth, rounding.

Every LoRA linear of a Qwen2.5-shaped model (q, k, v, o, gate, up, down of each layer) gets its own
random W (bf16), A, B (fp32) and output, so that nothing is served from L2 between layers as in a
real sync. Each variant writes all of them, captured once as a CUDA graph (as the sync replays its
writes), and is timed over replays. Rounding: the share of entries that differ from the correctly
rounded bf16(W + s * B @ A) (computed in fp64), and from the kernel in use.

At commit 2826713 this script also ran tf32x3 dots, plain FMA loops and another tile order: all
slower (their results are in git history at d30ef41). At 2351c66 it ran the kernel with W's load
issued before the rank-r product, with and without streaming cache hints: 10 to 13% slower
(bench/results/2026-12-01-h200-2351c66/).

    python bench/merge_kernel_variants.py --shapes 1.5B 7B      # GPU only
"""

from __future__ import annotations

import argparse

import torch
import triton
from profile_push import median_ms
from shapes import linear_shapes

from colocate_grpo.kernels import _merge_kernel, fused_merged_weight


def variant(block_m: int, block_n: int, warps: int):  # noqa: ANN201
    """The merge kernel of colocate_grpo.kernels launched on other tiles and warps."""

    def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor) -> None:
        rows, cols = w.shape
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
        _merge_kernel[grid](
            w, a, b, out, rows, cols, a.shape[0], s, R=16, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps
        )

    return merge


def current(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor) -> None:
    fused_merged_weight(w, a, b, s, torch.bfloat16, out=out)


def copy(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor) -> None:
    out.copy_(w)


VARIANTS = {
    "kernels.fused_merged_weight (in use)": current,
    "copy only (no merge)": copy,
    "64x128 w4 (before 2826713)": variant(64, 128, 4),
    "64x128 w8": variant(64, 128, 8),
    "32x128 w4": variant(32, 128, 4),
    "32x128 w2": variant(32, 128, 2),
    "32x64 w4": variant(32, 64, 4),
    "16x128 w4": variant(16, 128, 4),
    "32x256 w8": variant(32, 256, 8),
    "64x64 w4": variant(64, 64, 4),
    "128x128 w8": variant(128, 128, 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "7B"])
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes:
        print(f"\n{shape}: " + measure(linear_shapes(shape)), flush=True)
        torch.cuda.empty_cache()


def measure(shapes: list[tuple[int, int]]) -> str:
    """A Markdown table of every variant on LoRA linears of these (out, in) shapes."""
    layers = []
    for rows, cols in shapes:
        w = (torch.randn(rows, cols, device="cuda") * 0.02).bfloat16()
        a = torch.randn(16, cols, device="cuda") / cols**0.5
        b = torch.randn(rows, 16, device="cuda") * 1e-3
        layers.append((w, a, b, 2.0, torch.empty_like(w)))
    nbytes = sum(2 * w.numel() * w.element_size() for w, *_ in layers)
    floor_source = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    floor_target = torch.empty_like(floor_source)
    samples = [layers[shapes.index(s)] for s in dict.fromkeys(shapes)]  # one layer of each shape
    exact = [(w.double() + s * (b.double() @ a.double())).bfloat16() for w, a, b, s, _ in samples]
    in_use = []
    for w, a, b, s, out in samples:
        current(w, a, b, s, out)
        in_use.append(out.clone())
    rows = [("one copy of all bytes", median_ms(lambda: floor_target.copy_(floor_source)), "", "")]
    for name, merge in VARIANTS.items():
        try:
            graph = torch.cuda.CUDAGraph()
            for layer in layers:
                merge(*layer)  # compile before the capture
            with torch.cuda.graph(graph):
                for layer in layers:
                    merge(*layer)
            ms = median_ms(graph.replay)
        except Exception as error:  # noqa: BLE001 (a variant that does not compile is reported, not fatal)
            rows.append((name, float("nan"), f"failed: {type(error).__name__}: {str(error)[:120]}", ""))
            continue
        off_exact = off_in_use = total = 0
        for (w, a, b, s, out), want, mine in zip(samples, exact, in_use, strict=True):
            merge(w, a, b, s, out)
            off_exact += int((out != want).sum())
            off_in_use += int((out != mine).sum())
            total += out.numel()
        rows.append((name, ms, f"{off_exact / total:.2e}", f"{off_in_use / total:.2e}"))
    lines = [
        f"{len(layers)} LoRA linears, {nbytes / 2**30:.2f} GiB read + written",
        "| variant | ms | GB/s | off correctly rounded | off the kernel in use |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | {a} | {b} |" for name, ms, a, b in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
