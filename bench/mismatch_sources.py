"""Where the train/serve logprob mismatch comes from: each side's logprobs against a float32 reference.

vLLM generates the benchmarks' batch (8 prompts x 8 completions of 256 tokens, temperature 1, bf16) and
returns each sampled token's logprob, as a run's engine does. The trainer's side then scores the same
tokens as TRL 1.16 does (the bf16 model, its fused head over the completion), once with the head in bf16
and once in fp32 (``colocate_grpo.head.add_fp32_head``, what ``cast_lm_head_to_fp32: true`` computes).
The reference is the same bf16 weights upcast to float32, every operation in IEEE float32. Mean |logp
difference| per token between each pair:

- ``vllm / trainer``: the mismatch a run reports;
- ``vllm / reference``, ``trainer / reference``: each side's own rounding, the head's and the body's;
- ``trainer fp32 head / reference``: the trainer's rounding without the head's, so the body's alone.

If both sides sit about as far from the reference as from each other, their errors are independent
roundings of the forward, and no setting on one side halves the mismatch; a head-dominated mismatch
shows as a trainer-with-fp32-head much nearer the reference than the trainer.

    python bench/mismatch_sources.py --shapes 1.5B 1.5B-sharp 7B --out mismatch_sources.json   # GPU
    python bench/mismatch_sources.py --shapes tiny                                             # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from pathlib import Path

import torch
from generate_speed import COMPLETION_TOKENS, GENERATIONS, PROMPTS
from sync_vs_trl import benchmark_prompts, build_model

SIDES = ["trainer", "trainer fp32 head", "reference"]
PAIRS = [
    ("vllm", "trainer"),
    ("vllm", "reference"),
    ("trainer", "reference"),
    ("trainer fp32 head", "reference"),
    ("vllm", "trainer fp32 head"),
]


def served(model_path: str, completion_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """vLLM's completions of the benchmark prompts: (prompt ids, completion ids, the sampled tokens' logprobs)."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_path,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=None if "tiny" in model_path else 512 + completion_tokens,
        seed=0,
        logprobs_mode="processed_logprobs",  # as the engine serves them
    )
    params = SamplingParams(
        n=GENERATIONS, temperature=1.0, max_tokens=completion_tokens, ignore_eos=True, logprobs=0, seed=0
    )
    samples = []
    for request in llm.generate(benchmark_prompts(model_path, PROMPTS), params, use_tqdm=False):
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
            samples.append((list(request.prompt_token_ids), tokens, logprobs))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return samples


def scored(model_path: str, side: str, samples: list, device: str) -> list[list[float]]:
    """The completions' logprobs as TRL's trainer computes them, on ``side`` (one of :data:`SIDES`)."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from colocate_grpo.head import add_fp32_head

    dtype = torch.float32 if side == "reference" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    if side == "trainer fp32 head":
        add_fp32_head(model, temperature=1.0)
    else:
        add_fused_lm_head(model, temperature=1.0)
    logprobs = []
    with torch.no_grad():
        for start in range(0, len(samples), GENERATIONS):  # one prompt's completions: one length, no padding
            group = samples[start : start + GENERATIONS]
            ids = torch.tensor([prompt + completion for prompt, completion, _ in group], device=device)
            labels = ids.clone()
            labels[:, : len(group[0][0])] = -100
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            logprobs += out.log_probs[:, -len(group[0][1]) :].float().cpu().tolist()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return logprobs


def mean_abs_difference(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = (pair for row_a, row_b in zip(a, b, strict=True) for pair in zip(row_a, row_b, strict=True))
    return statistics.fmean(abs(x - y) for x, y in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1.5B", "1.5B-sharp"])
    parser.add_argument("--out", default="mismatch_sources.json")
    parser.add_argument("--models", default="/tmp/sync_vs_trl_models")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for shape in args.shapes:
        model_path = build_model(shape, Path(args.models) / shape)
        samples = served(model_path, 4 if shape == "tiny" else COMPLETION_TOKENS)
        logprobs = {"vllm": [logprobs for _, _, logprobs in samples]}
        for side in SIDES:
            logprobs[side] = scored(model_path, side, samples, device)
        row = {"shape": shape, "tokens": sum(len(r) for r in logprobs["vllm"])}
        row |= {f"{a} / {b}": mean_abs_difference(logprobs[a], logprobs[b]) for a, b in PAIRS}
        row["mean logp (reference)"] = statistics.fmean(x for r in logprobs["reference"] for x in r)
        results.append(row)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(
            " ".join(
                f"{key}={value:.5g}" if isinstance(value, float) else f"{key}={value}" for key, value in row.items()
            )
        )
    print()
    print("| shape | " + " | ".join(f"{a} / {b}" for a, b in PAIRS) + " |")
    print("|---" * (len(PAIRS) + 1) + "|")
    for row in results:
        print(f"| {row['shape']} | " + " | ".join(f"{row[f'{a} / {b}']:.5f}" for a, b in PAIRS) + " |")


if __name__ == "__main__":
    main()
