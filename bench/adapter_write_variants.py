"""Ways of writing a trainer's LoRA factors into vLLM's LoRA buffers: device time and kernel count.

Every LoRA linear of a Qwen2.5-shaped model (q, k, v, o, gate, up, down of each layer) gets fp32
factors A (r x in) and B (out x r), as PEFT keeps them beside a bf16 base, and bf16 destinations laid
out as vLLM's ``lora_a_stacked`` / ``lora_b_stacked`` slices are (one LoRA slot, rank r). A write is
A cast, and B times the scaling cast, into them. Each variant is captured as a CUDA graph (as
``colocate_grpo.adapters`` replayed its write before it launched one kernel) and timed over replays;
its kernels are counted in an eager run under the profiler. Every variant's result is checked
bitwise against the plain one.

    python bench/adapter_write_variants.py --shapes 1.5B 7B      # GPU only
"""

from __future__ import annotations

import argparse
import statistics

import torch
from shapes import linear_shapes

from colocate_grpo.kernels import ScaledCopies

RANK = 16
SCALING = 2.0


def per_tensor(dst_a, dst_b, a, b, s):  # noqa: ANN001, ANN201
    for da, db, fa, fb, sc in zip(dst_a, dst_b, a, b, s, strict=True):
        da.copy_(fa)
        db.copy_(fb * sc)


def foreach(dst_a, dst_b, a, b, s):  # noqa: ANN001, ANN201
    torch._foreach_copy_(dst_a, a)
    torch._foreach_copy_(dst_b, torch._foreach_mul(b, s))


def flat_cast(dst_a, dst_b, a, b, s):  # noqa: ANN001, ANN201
    """Scale, gather everything into one fp32 buffer, cast it once, scatter with same-dtype copies."""
    scaled = torch._foreach_mul(b, s)
    flat = torch.cat([t.reshape(-1) for t in [*a, *scaled]]).to(dst_a[0].dtype)
    parts = torch.split(flat, [t.numel() for t in [*a, *b]])
    dst = [*dst_a, *dst_b]
    torch._foreach_copy_(dst, [p.view(d.shape) for p, d in zip(parts, dst, strict=True)])


def foreach_cast_first(dst_a, dst_b, a, b, s):  # noqa: ANN001, ANN201
    """Cast with one multi-tensor op per list (mul by the scaling in fp32 first), then same-dtype copies."""
    dtype = dst_a[0].dtype
    cast_a = [t.to(dtype) for t in a]
    cast_b = [t.to(dtype) for t in torch._foreach_mul(b, s)]
    torch._foreach_copy_([*dst_a, *dst_b], [*cast_a, *cast_b])


_kernels: dict[int, ScaledCopies] = {}


def one_kernel(dst_a, dst_b, a, b, s):  # noqa: ANN001, ANN201
    """kernels.ScaledCopies: every tensor's addresses in a table, one launch."""
    key = id(dst_a)
    if key not in _kernels:
        _kernels[key] = ScaledCopies([*dst_a, *dst_b], [*a, *b], [1.0] * len(a) + list(s))
    _kernels[key]()


VARIANTS = {
    "per tensor": per_tensor,
    "foreach copy with the cast (before)": foreach,
    "one flat fp32 buffer, one cast, foreach copy": flat_cast,
    "cast per tensor, then foreach copy": foreach_cast_first,
    "kernels.ScaledCopies, one launch (in use)": one_kernel,
}


def build(shape: str) -> tuple[list, list, list, list, list]:
    dst_a, dst_b, a, b = [], [], [], []
    for out_features, in_features in linear_shapes(shape):
        # vLLM's slices of one slot: (max_loras, 1, rank, in) and (max_loras, 1, out, rank), slot 0.
        dst_a.append(torch.zeros(1, 1, RANK, in_features, dtype=torch.bfloat16, device="cuda")[0, 0])
        dst_b.append(torch.zeros(1, 1, out_features, RANK, dtype=torch.bfloat16, device="cuda")[0, 0])
        a.append(torch.randn(RANK, in_features, device="cuda") / in_features**0.5)
        b.append(torch.randn(out_features, RANK, device="cuda") * 1e-3)
    return dst_a, dst_b, a, b, [SCALING] * len(a)


def kernel_count(fn) -> int:  # noqa: ANN001
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 50) -> float:
    """Median device milliseconds of one replay (CUDA events)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "7B"])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rank {RANK}")
    print("| shape | variant | kernels (eager) | graph replay ms | bitwise as per tensor |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        tensors = build(shape)
        dst_a, dst_b, a = tensors[:3]
        per_tensor(*tensors)
        expected = [t.clone() for t in [*dst_a, *dst_b]]
        for name, fn in VARIANTS.items():
            torch._foreach_zero_([*dst_a, *dst_b])

            def write(fn=fn, tensors=tensors) -> None:  # noqa: ANN001
                fn(*tensors)

            write()
            torch.cuda.synchronize()
            kernels = kernel_count(write)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                write()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                write()
            torch._foreach_zero_([*dst_a, *dst_b])
            ms = replay_ms(graph)
            same = all(torch.equal(x, y) for x, y in zip([*dst_a, *dst_b], expected, strict=True))
            print(f"| {shape} ({len(a)} layers) | {name} | {kernels} | {ms:.3f} | {same} |", flush=True)
            del graph


if __name__ == "__main__":
    main()
