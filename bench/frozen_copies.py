"""Ways to copy a model's frozen tensors (embeddings, lm_head, norms, biases) in a sync, eager and in a CUDA graph.

A sync after a level-2 sleep copies every frozen tensor of the trainer into vLLM: two large ones
(embeddings, lm_head) and about 140 small ones (Qwen2's norms and q/k/v biases). Each way is
timed as launched eagerly and as replayed from a CUDA graph (as the sync replays its writes).

In a graph, copy_ of gigabyte-sized tensors (7B) ran at about 2.7 TB/s against 4.1 TB/s eagerly.
Copying them in pieces was fast or slow depending on the piece size, with no pattern. A Triton
copy kernel ran at 4.1 to 4.2 TB/s (bench/results/2026-12-01-h200-48e6c2a/). Before it went in, a
sweep of its block found 1024 (4 warps) to 16384 (16 warps) elements within 4% of each other, 1024
the fastest (that log is in git history at 48e6c2a).

    python bench/frozen_copies.py --shapes 1.5B 7B      # GPU only
"""

from __future__ import annotations

import argparse

import torch
from profile_push import median_ms
from shapes import QWEN25

from colocate_grpo.kernels import copy_by_kernel


def frozen_shapes(shape: str) -> list[tuple[int, ...]]:
    d = QWEN25[shape]
    hidden = d["hidden_size"]
    kv = hidden // d["num_attention_heads"] * d["num_key_value_heads"]
    layer = [(hidden,), (hidden,), (hidden,), (kv,), (kv,)]  # two norms, q, k and v biases
    return [(d["vocab_size"], hidden)] * 2 + layer * d["num_hidden_layers"] + [(hidden,)]


def each(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def foreach(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    torch._foreach_copy_(targets, sources)


def by_size(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> tuple[list[tuple], tuple[list, list]]:
    """(target, source) pairs of 1 MiB or more, and the smaller ones as (targets, sources) for one foreach."""
    large = [(t, s) for t, s in zip(targets, sources, strict=True) if s.nbytes >= 2**20]
    small = [(t, s) for t, s in zip(targets, sources, strict=True) if s.nbytes < 2**20]
    return large, ([t for t, _ in small], [s for _, s in small])


def large_each_small_foreach(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """The sync's way at commit f7fbbd1: tensors of 1 MiB or more copied one by one, the others in one foreach."""
    large, small = by_size(targets, sources)
    for target, source in large:
        target.copy_(source)
    foreach(*small)


def in_pieces(piece_bytes: int):  # noqa: ANN201
    """Tensors of 1 MiB or more copied in pieces of ``piece_bytes`` (rows), the others in one foreach."""

    def copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        large, small = by_size(targets, sources)
        for target, source in large:
            rows = max(1, piece_bytes // source[0].nbytes)
            each(target.split(rows), source.split(rows))
        foreach(*small)

    return copy


def large_by_kernel(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """The sync's way after f7fbbd1: tensors of 1 MiB or more copied by a Triton kernel, the others in one foreach."""
    large, small = by_size(targets, sources)
    for target, source in large:
        copy_by_kernel(target, source)
    foreach(*small)


WAYS = {
    "copy_ each": each,
    "one _foreach_copy_": foreach,
    "large copy_, small _foreach_copy_": large_each_small_foreach,
    **{f"large in {mib} MiB pieces, small _foreach_copy_": in_pieces(mib * 2**20) for mib in (512, 256, 128, 64)},
    "large by kernels.copy_by_kernel, small _foreach_copy_ (in use)": large_by_kernel,
}


def measure(shapes: list[tuple[int, ...]]) -> str:
    """A Markdown table: each way's milliseconds, eager and replayed, for tensors of these shapes."""
    sources = [torch.randn(s, device="cuda").bfloat16() for s in shapes]
    targets = [torch.empty_like(s) for s in sources]
    nbytes = sum(2 * s.nbytes for s in sources)
    lines = [
        f"{len(shapes)} tensors, {nbytes / 2**30:.2f} GiB read + written",
        "| way | eager ms | graph ms | graph GB/s |",
        "|---|---|---|---|",
    ]
    for name, way in WAYS.items():
        eager = median_ms(lambda way=way: way(targets, sources), repeats=20)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            way(targets, sources)
        replay = median_ms(graph.replay, repeats=20)
        assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
        lines.append(f"| {name} | {eager:.3f} | {replay:.3f} | {nbytes / replay / 1e6:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "7B"])
    args = parser.parse_args()
    for shape in args.shapes:
        print(f"\n{shape}: " + measure(frozen_shapes(shape)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
