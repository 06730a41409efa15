"""vLLM's LoRA kernels (shrink, expand) at a shape's decode batch: vLLM's default tile configs against a search.

Adapter serving adds to each decode step, for every decoder layer, vLLM's LoRA on its four packed linears
(q/k/v, o, gate/up, down): a zeroed buffer, a shrink (x @ A, scaled, split over the input dimension) and
an expand (y += . @ B). This times those kernels alone, as vLLM calls them (``lora_shrink``,
``lora_expand``, one adapter slot, every token on the adapter), for every layer of the shape in one CUDA
graph, under vLLM's default config and under each config of a small grid, and reports per decode step:
the LoRA kernels' time with the defaults, with the best configs found, and what that would take off a
256-token generation. The best configs are written as vLLM's tuned-config files
(``VLLM_TUNED_CONFIG_FOLDER``) for ``lora_generate_variants.py --tuned-configs`` to generate with.

    python bench/lora_kernel_configs.py --shape 7B --out-dir /tmp/lora_configs_7B     # GPU only
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from shapes import QWEN25, layer_linears
from timing import cuda_time

RANK = 16
DECODE_STEPS = 256
# Small enough to compile every config of both grids for the four packed linears in about 3 minutes.
SHRINK_GRID = {
    "block_m": [16, 64],
    "block_n": [16],
    "block_k": [32, 64, 256],
    "split_k": [16, 32, 64],
    "num_warps": [4],
    "num_stages": [2],
}
EXPAND_GRID = {
    "block_m": [16, 64],
    "block_n": [64, 128, 256],
    "block_k": [16],
    "num_warps": [4, 8],
    "num_stages": [2],
}
COMMON = {"num_ctas": 1, "group_size_m": 8, "max_nreg": None}


def packed_linears(shape: str) -> dict[str, tuple[int, list[int]]]:
    """vLLM's packed LoRA linears of one decoder layer: name -> (input width, output width of each slice)."""
    linears = layer_linears(QWEN25[shape])
    width = {name.split(".")[1].removesuffix("_proj"): out for name, (out, _) in linears.items()}
    hidden, inter = linears["self_attn.q_proj"][1], linears["mlp.down_proj"][1]
    return {
        "qkv": (hidden, [width["q"], width["k"], width["v"]]),
        "o": (hidden, [width["o"]]),
        "gate_up": (hidden, [width["gate"], width["up"]]),
        "down": (inter, [width["down"]]),
    }


class LoRACalls:
    """One packed linear's LoRA for every layer of a shape, on ``tokens`` decode tokens, as vLLM's punica
    wrapper calls it: a float32 buffer, ``lora_shrink`` (which zeroes it), ``lora_expand`` adding to y."""

    def __init__(self, fan_in: int, slices: list[int], layers: int, tokens: int) -> None:
        from vllm.lora.ops.triton_ops import LoRAKernelMeta

        device = "cuda"
        meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=tokens, device=device)
        meta.prepare_tensors(torch.zeros(tokens, dtype=torch.long, device=device))
        self.meta = meta.meta_args(tokens, False)
        self.layers = [
            (
                torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16),
                [torch.randn(1, RANK, fan_in, device=device, dtype=torch.bfloat16) / fan_in**0.5 for _ in slices],
                torch.empty(len(slices), tokens, RANK, device=device, dtype=torch.float32),
                [torch.randn(1, width, RANK, device=device, dtype=torch.bfloat16) * 1e-3 for width in slices],
                torch.zeros(tokens, sum(slices), device=device, dtype=torch.bfloat16),
            )
            for _ in range(layers)
        ]

    def __call__(self) -> None:
        from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

        for x, a, buffer, b, y in self.layers:
            lora_shrink(x, a, buffer, *self.meta, 2.0)
            lora_expand(buffer, b, y, *self.meta, offset_start=0, add_inputs=True)


def graph_time(calls: LoRACalls, shrink: dict | None = None, expand: dict | None = None) -> float:
    """Seconds of one replay of a CUDA graph of ``calls`` (every layer's shrink and expand), with the given
    shrink and expand configs (None: vLLM's)."""
    import vllm.lora.ops.triton_ops.lora_expand_op as expand_op
    import vllm.lora.ops.triton_ops.lora_shrink_op as shrink_op
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    # Each op reads its config from this function at each call: the candidate's while it is captured.
    shrink_op.get_lora_op_configs = (lambda *_, **__: shrink) if shrink else get_lora_op_configs
    expand_op.get_lora_op_configs = (lambda *_, **__: expand) if expand else get_lora_op_configs
    try:
        calls()  # compiles the kernels and caches vLLM's pointer tables outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        return cuda_time(graph.replay, warmup=3, iters=20)
    finally:
        shrink_op.get_lora_op_configs = expand_op.get_lora_op_configs = get_lora_op_configs


def configs(grid: dict[str, list]) -> list[dict]:
    return [dict(zip(grid, values, strict=True)) | COMMON for values in itertools.product(*grid.values())]


def fastest(calls: LoRACalls, op: str, grid: dict[str, list]) -> dict:
    """The config of ``grid`` under which ``op`` (shrink or expand) runs ``calls`` fastest, the other op on
    vLLM's default."""
    timed = []
    for config in configs(grid):
        try:
            timed.append((graph_time(calls, **{op: config}), config))
        except Exception as error:  # a tile the kernel cannot compile (shared memory): not a candidate
            print(f"  {op} {config}: {type(error).__name__}", flush=True)
    return min(timed, key=lambda pair: pair[0])[1]


def table_keys(op: str, fan_in: int, slices: list[int]) -> tuple[int, int, int]:
    """(slices, K, N) under which vLLM looks up ``op``'s config for one packed linear: the shrink maps the
    input width to the rank, the expand the rank to the widest slice."""
    return (len(slices), fan_in, RANK) if op == "shrink" else (len(slices), RANK, max(slices))


def vllm_default(op: str, batch: int, slices: int, k: int, n: int) -> dict:
    """vLLM's own config for ``op`` at these keys (no tuned-config folder is set in this process)."""
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    hidden, rank = (k, n) if op == "shrink" else (n, k)
    # max_loras counts the no-adapter slot, as vLLM's kernels pass it.
    return get_lora_op_configs(op, 2, batch, hidden, rank, slices, add_inputs=True if op == "expand" else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5B", choices=sorted(QWEN25))
    parser.add_argument("--tokens", type=int, default=64, help="decode batch: sequences generated together")
    parser.add_argument("--out-dir", default="lora_kernel_configs", help="where the tuned-config files go")
    args = parser.parse_args()

    layers = QWEN25[args.shape]["num_hidden_layers"]
    chosen: dict[str, dict[tuple[int, int, int], dict]] = {"shrink": {}, "expand": {}}
    default_total = best_total = 0.0
    # vLLM caches each weight list's pointer table by the tensors' addresses: every linear's tensors stay
    # alive to the end, so that none is allocated where an earlier one's table still points.
    kept = []
    for name, (fan_in, slices) in packed_linears(args.shape).items():
        calls = LoRACalls(fan_in, slices, layers, args.tokens)
        kept.append(calls)
        default_s = graph_time(calls)
        best = {"shrink": fastest(calls, "shrink", SHRINK_GRID), "expand": fastest(calls, "expand", EXPAND_GRID)}
        best_s = graph_time(calls, **best)
        default_total += default_s
        best_total += min(best_s, default_s)
        print(f"{args.shape} {name}, {layers} layers: {default_s * 1e3:.3f} ms with vLLM's defaults, ", end="")
        print(f"{best_s * 1e3:.3f} ms with shrink {best['shrink']} and expand {best['expand']}", flush=True)
        for op, config in best.items():
            keys = table_keys(op, fan_in, slices)
            # Every linear gets an entry, vLLM's default where the search found nothing faster: vLLM takes the
            # nearest entry, and another linear's would stand in for a missing one.
            chosen[op][keys] = config if best_s < default_s else vllm_default(op, args.tokens, *keys)
    print()
    print(f"{args.shape}, {args.tokens} tokens a decode step: the LoRA kernels take {default_total * 1e3:.3f} ms with ")
    print(f"vLLM's defaults and {best_total * 1e3:.3f} ms with the best configs found: ")
    print(f"{(default_total - best_total) * DECODE_STEPS:.3f} s less over a {DECODE_STEPS}-token generation")
    write_tuned_configs(Path(args.out_dir), chosen, args.tokens)


def write_tuned_configs(directory: Path, chosen: dict[str, dict[tuple[int, int, int], dict]], tokens: int) -> None:
    """vLLM's tuned-config files for this GPU: the configs chosen for decode batches up to ``tokens``, vLLM's
    defaults for larger batches (prefill), keyed [max_loras + 1][slices][batch][K][N] as vLLM reads them."""
    directory.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")
    for op, by_keys in chosen.items():
        table: dict = {}
        for (slices, k, n), config in by_keys.items():
            for batch in (2**i for i in range(14)):
                entry = config if batch <= tokens else vllm_default(op, batch, slices, k, n)
                table.setdefault(str(slices), {}).setdefault(str(batch), {}).setdefault(str(k), {})[str(n)] = entry
        name = f"{gpu}_SHRINK.json" if op == "shrink" else f"{gpu}_EXPAND_TRUE.json"
        (directory / name).write_text(json.dumps({"2": table}, indent=1))
        print(f"wrote {directory / name}")


if __name__ == "__main__":
    main()
