"""Merge-kernel variants on a model's LoRA linears: device time, bandwidth and rounding, to pick one.

Every LoRA linear of a Qwen2.5-shaped model (q, k, v, o, gate, up, down of each layer) gets its own
random W (bf16), A, B (fp32) and output, so that nothing is served from L2 between layers as in a
real sync. Each variant writes all of them, captured once as a CUDA graph (as the sync replays its
writes), and is timed over replays. Rounding: the share of entries that differ from the correctly
rounded bf16(W + s * B @ A) (computed in fp64), and from the current kernel's.

    python bench/merge_kernel_variants.py --shapes 1.5B 7B      # GPU only
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from shapes import QWEN25

from colocate_grpo.kernels import fused_merged_weight


@triton.jit
def _variant_kernel(
    w_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    rows,
    cols,
    rank,
    scaling,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,  # 0: tl.dot ieee, 1: tl.dot tf32x3, 2: rank-1 updates in fp32 FMAs
    COLUMNS_FIRST: tl.constexpr,  # consecutive programs walk along a row of tiles (contiguous memory)
):
    if COLUMNS_FIRST:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < rows
    mask_n = offs_n < cols
    if MODE == 2:
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.static_range(R):
            if k < rank:
                b_k = tl.load(b_ptr + offs_m * rank + k, mask=mask_m, other=0.0)
                a_k = tl.load(a_ptr + k * cols + offs_n, mask=mask_n, other=0.0)
                delta += b_k[:, None] * a_k[None, :]
    else:
        offs_r = tl.arange(0, R)
        b = tl.load(
            b_ptr + offs_m[:, None] * rank + offs_r[None, :],
            mask=mask_m[:, None] & (offs_r[None, :] < rank),
            other=0.0,
        )
        a = tl.load(
            a_ptr + offs_r[:, None] * cols + offs_n[None, :],
            mask=(offs_r[:, None] < rank) & mask_n[None, :],
            other=0.0,
        )
        delta = tl.dot(b, a, input_precision="ieee") if MODE == 0 else tl.dot(b, a, input_precision="tf32x3")
    tile = offs_m[:, None] * cols + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    w = tl.load(w_ptr + tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tile, (w + scaling * delta).to(out_ptr.dtype.element_ty), mask=mask)


def variant(mode: int, block_m: int, block_n: int, warps: int, columns_first: bool):  # noqa: ANN201
    def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor) -> None:
        rows, cols = w.shape
        tiles_m, tiles_n = triton.cdiv(rows, block_m), triton.cdiv(cols, block_n)
        grid = (tiles_n, tiles_m) if columns_first else (tiles_m, tiles_n)
        _variant_kernel[grid](
            w,
            a,
            b,
            out,
            rows,
            cols,
            a.shape[0],
            s,
            R=16,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            MODE=mode,
            COLUMNS_FIRST=columns_first,
            num_warps=warps,
        )

    return merge


def current(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor) -> None:
    fused_merged_weight(w, a, b, s, torch.bfloat16, out=out)


def copy(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor) -> None:
    out.copy_(w)


VARIANTS = {
    "kernels.fused_merged_weight (in use)": current,
    "copy only (no merge)": copy,
    "dot ieee 64x128 w4 (before session 4)": variant(0, 64, 128, 4, False),
    "dot ieee 64x128 w4 cols-first": variant(0, 64, 128, 4, True),
    "dot ieee 64x128 w8": variant(0, 64, 128, 8, False),
    "dot ieee 32x128 w4": variant(0, 32, 128, 4, False),
    "dot ieee 32x128 w2": variant(0, 32, 128, 2, False),
    "dot ieee 32x64 w4": variant(0, 32, 64, 4, False),
    "dot ieee 16x128 w4": variant(0, 16, 128, 4, False),
    "dot ieee 32x256 w8": variant(0, 32, 256, 8, False),
    "dot ieee 64x64 w4": variant(0, 64, 64, 4, False),
    "dot ieee 128x128 w8": variant(0, 128, 128, 8, False),
    "dot tf32x3 128x128 w8 cols-first": variant(1, 128, 128, 8, True),
    "fma 16x256 w4 cols-first": variant(2, 16, 256, 4, True),
}


def linear_shapes(shape: str) -> list[tuple[int, int]]:
    d = QWEN25[shape]
    hidden, inter = d["hidden_size"], d["intermediate_size"]
    kv = hidden // d["num_attention_heads"] * d["num_key_value_heads"]
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden)]
    return (layer + [(hidden, inter)]) * d["num_hidden_layers"]


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


def median_ms(fn, repeats: int = 20) -> float:  # noqa: ANN001
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


if __name__ == "__main__":
    main()
