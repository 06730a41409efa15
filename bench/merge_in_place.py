"""Merging a LoRA into a model's shared base weights in place, and restoring them bitwise.

With merged serving on one shared copy of the base, each sync writes ``cast(W + s * B @ A)`` over every
LoRA layer's base weight W and keeps a record to put W back after the generation
(``colocate_grpo.lora.overwrite``: a byte per weight, an index and the old bits where a change does not fit
in one). This times the merge with its record and the restore over a Qwen2.5 shape's linear layers
(random bf16 weights, r=16, an RL-sized delta), reports the record's size and outliers, and checks that
the restore gives the weights back bitwise. ``--in-host-memory`` keeps the record's byte per weight in
page-locked host memory, as the memory plan does where the device cannot hold it: the merge then copies
it to the host and the restore back (``colocate_grpo.sync.MergedInPlace``).

    python bench/merge_in_place.py --shape 7B          # a CUDA device
    python bench/merge_in_place.py --shape 7B --in-host-memory
    python bench/merge_in_place.py --shape tiny-ish    # any device: a few small layers
"""

from __future__ import annotations

import argparse
import time

import torch
from shapes import QWEN25, linear_shapes

from colocate_grpo.lora import merged_weight
from colocate_grpo.sync import MergedInPlace


def shapes_of(shape: str) -> list[tuple[int, int]]:
    """(out, in) of the linear layers to merge: a Qwen2.5 shape's, or a few small ones."""
    return [(256, 128), (128, 256)] * 4 if shape == "tiny-ish" else linear_shapes(shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7B", choices=[*QWEN25, "tiny-ish"])
    parser.add_argument("--delta-std", type=float, default=1e-4, help="std of B; A's is 1e-2 (scaling 2, r=16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-host-memory", action="store_true", help="the record's steps in page-locked host memory")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    layers = []
    for out, in_ in shapes_of(args.shape):
        weight = (torch.randn(out, in_, device=device) * 0.02).to(torch.bfloat16)
        layers.append(
            (weight, torch.randn(16, in_, device=device) * 1e-2, torch.randn(out, 16, device=device) * args.delta_std)
        )
    before = [weight.cpu() for weight, _, _ in layers]  # in host memory: a second copy may not fit the device
    elements = sum(weight.numel() for weight, _, _ in layers)
    print(f"{args.shape}: {len(layers)} layers, {elements / 1e9:.2f} G weights, {device}")

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    in_place = MergedInPlace(in_host_memory=args.in_host_memory)
    start = time.perf_counter()
    in_place.reserve([weight for weight, _, _ in layers])
    if args.in_host_memory:
        locked_s = time.perf_counter() - start
        print(f"host buffer: {elements / 2**30:.2f} GiB allocated and page-locked in {locked_s:.2f} s")
    for repeat in range(args.repeats):  # the first includes the merge kernel's compilation
        synchronize()
        start = time.perf_counter()
        for weight, a, b in layers:
            in_place.add(weight, merged_weight(weight, a, b, 2.0))
        synchronize()
        merged = time.perf_counter()
        records = in_place.records.values()
        size, outliers = sum(r.nbytes for r in records), sum(r.outlier_count for r in records)
        in_place.restore()
        synchronize()
        restored = time.perf_counter()
        print(
            f"repeat {repeat}: merge + record {1e3 * (merged - start):.1f} ms, "
            f"restore {1e3 * (restored - merged):.1f} ms, "
            f"record on the device {size / 2**30:.2f} GiB ({size / elements:.3f} bytes a weight), "
            f"outliers {outliers} ({outliers / elements:.2e})"
        )
    exact = all(
        torch.equal(b.view(torch.int16), w.cpu().view(torch.int16)) for b, (w, _, _) in zip(before, layers, strict=True)
    )
    print("restored bitwise:", exact)


if __name__ == "__main__":
    main()
