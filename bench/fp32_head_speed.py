"""The trainer's head, forward and backward: TRL's bf16 head against its fp32 head, IEEE and on TF32 cores.

TRL's fused head (``trl.kernels.ChunkedLogProbFunction``) over a Qwen2.5 shape's head (bf16 weights,
random), for a micro-batch of completion tokens: the bf16 head (TRL's default), the fp32 head as TRL
computes it (``cast_lm_head_to_fp32``: IEEE fp32 GEMMs), and the fp32 head on TF32 cores
(``colocate_grpo.head``, what ``trl.cast_lm_head_to_fp32: true`` runs here). Each is timed forward +
backward with CUDA events, its largest log-probability difference from the IEEE fp32 head printed
beside it; then the TF32 head's CUDA kernels under the profiler, by time.

    python bench/fp32_head_speed.py --shapes 1.5B 7B --tokens 2048 16384      # GPU only
"""

from __future__ import annotations

import argparse
import functools

import torch
from shapes import QWEN25
from timing import cuda_time
from trl.kernels import ChunkedLogProbFunction

from colocate_grpo.head import TF32ChunkedLogProb

CHUNK = 32768  # TRL's vocabulary tile (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)


def forward_backward(function: type, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):  # noqa: ANN201
    hidden = hidden.detach().requires_grad_()
    log_probs, entropy, *_ = function.apply(hidden, weight, None, targets, 1.0, CHUNK, None, 1.0, ("entropy",))
    log_probs.sum().backward()
    return log_probs.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "7B"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 16384], help="completion tokens a micro-batch")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| shape | tokens | head | fwd+bwd ms | x bf16 | max abs logp diff from IEEE fp32 |")
    print("|---|---|---|---|---|---|")
    profiles = []
    for shape in args.shapes:
        hidden_size, vocab = QWEN25[shape]["hidden_size"], QWEN25[shape]["vocab_size"]
        weight = (torch.randn(vocab, hidden_size, device="cuda") * 0.02).bfloat16()
        for tokens in args.tokens:
            hidden = torch.randn(tokens, hidden_size, device="cuda").bfloat16()
            targets = torch.randint(0, vocab, (tokens,), device="cuda")
            heads = {
                "bf16 (TRL's default)": (ChunkedLogProbFunction, hidden),
                "fp32, IEEE (TRL's cast_lm_head_to_fp32)": (ChunkedLogProbFunction, hidden.float()),
                "fp32 on TF32 cores (ours)": (TF32ChunkedLogProb, hidden.float()),
            }
            reference = forward_backward(*heads["fp32, IEEE (TRL's cast_lm_head_to_fp32)"], weight, targets)
            bf16_ms = None
            for name, (function, inputs) in heads.items():
                ms = 1e3 * cuda_time(
                    functools.partial(forward_backward, function, inputs, weight, targets), warmup=1, iters=5
                )
                bf16_ms = bf16_ms or ms
                diff = (forward_backward(function, inputs, weight, targets) - reference).abs().max().item()
                print(f"| {shape} | {tokens} | {name} | {ms:.2f} | {ms / bf16_ms:.2f} | {diff:.2e} |", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                forward_backward(TF32ChunkedLogProb, hidden.float(), weight, targets)
                torch.cuda.synchronize()
            profiles.append((shape, tokens, profile.key_averages()))
    for shape, tokens, averages in profiles:
        print(f"\nTF32 head, {shape}, {tokens} tokens: CUDA kernels by time")
        for event in sorted(averages, key=lambda e: e.device_time_total, reverse=True)[:6]:
            print(f"  {event.device_time_total / 1e3:8.2f} ms  x{event.count:<3d} {event.key[:110]}")
    assert torch.backends.cuda.matmul.fp32_precision != "tf32"


if __name__ == "__main__":
    main()
