"""Where the train/serve logprob mismatch comes from: each side's logprobs against a float32 reference.

vLLM generates the benchmarks' batch (8 prompts x 8 completions of 256 tokens, temperature 1, bf16) and
returns each sampled token's logprob, as a run's engine does (``vllm``). It then scores the same
sequences in one prefill (``vllm prefill``), and an engine with its head in fp32 scores them too
(``vllm fp32 head``, prefill). The trainer's side scores the same tokens as TRL 1.16 does (the bf16
model, its fused head over the completion), with the head in bf16 (``trainer``) and in fp32
(``trainer fp32 head``, ``colocate_grpo.head.add_fp32_head``, what ``cast_lm_head_to_fp32: true``
computes). The reference is the same bf16 weights upcast to float32, every operation in IEEE float32.
Mean |logp difference| per token between pairs of them says:

- ``vllm / trainer``: the mismatch a run reports;
- each side against the reference: that side's own rounding; with the fp32 head, the body's alone;
- ``vllm fp32 head / trainer fp32 head``: the mismatch with the fp32 head on both sides (prefill);
- ``vllm / vllm prefill``: how far decoding's kernels are from prefill's.

If both sides sit about as far from the reference as from each other, their errors are independent
roundings of the forward, and no setting of one part halves the mismatch; a head-dominated mismatch
shows as much smaller distances with the fp32 head.

    python bench/mismatch_sources.py --shapes 1.5B 1.5B-sharp 7B --out mismatch_sources.json   # GPU
    python bench/mismatch_sources.py --shapes tiny                                             # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from generate_speed import COMPLETION_TOKENS, GENERATIONS, PROMPTS
from sync_vs_trl import benchmark_prompts, build_model

TRAINER_SIDES = ["trainer", "trainer fp32 head", "reference"]
PAIRS = [
    ("vllm", "trainer"),
    ("vllm", "reference"),
    ("vllm prefill", "reference"),
    ("vllm fp32 head", "reference"),
    ("trainer", "reference"),
    ("trainer fp32 head", "reference"),
    ("vllm fp32 head", "trainer fp32 head"),
    ("vllm", "vllm prefill"),
]


def served(model_path: str, fp32_head: bool, samples_path: Path) -> None:
    """One vLLM engine (its head in fp32 or not) in this process. Without samples at ``samples_path`` it
    generates them (prompt ids, completion ids, the sampled tokens' logprobs) and writes them there; then
    it scores every sample's completion in one prefill and adds those logprobs under its side's name."""
    from vllm import LLM, SamplingParams

    tiny = "tiny" in model_path
    completion_tokens = 4 if tiny else COMPLETION_TOKENS
    llm = LLM(
        model=model_path,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=None if tiny else 512 + completion_tokens,
        seed=0,
        logprobs_mode="processed_logprobs",  # as the engine serves them
        **({"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}),
    )
    data = json.loads(samples_path.read_text()) if samples_path.exists() else None
    if data is None:
        params = SamplingParams(
            n=GENERATIONS, temperature=1.0, max_tokens=completion_tokens, ignore_eos=True, logprobs=0, seed=0
        )
        data = {"samples": [], "vllm": []}
        for request in llm.generate(benchmark_prompts(model_path, PROMPTS), params, use_tqdm=False):
            for completion in request.outputs:
                tokens = list(completion.token_ids)
                data["samples"].append([list(request.prompt_token_ids), tokens])
                data["vllm"].append([step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)])
    sequences = [{"prompt_token_ids": prompt + completion} for prompt, completion in data["samples"]]
    outputs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    side = "vllm fp32 head" if fp32_head else "vllm prefill"
    data[side] = [
        [step[t].logprob for step, t in zip(out.prompt_logprobs[-len(completion) :], completion, strict=True)]
        for out, (_, completion) in zip(outputs, data["samples"], strict=True)
    ]
    samples_path.write_text(json.dumps(data))


def scored(model_path: str, side: str, samples: list, device: str) -> list[list[float]]:
    """The completions' logprobs as TRL's trainer computes them, on ``side`` (one of :data:`TRAINER_SIDES`)."""
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
            ids = torch.tensor([prompt + completion for prompt, completion in group], device=device)
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
    parser.add_argument("--child", nargs=3, metavar=("HEAD", "MODEL", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.child:
        head, model_path, samples_path = args.child
        served(model_path, head == "fp32", Path(samples_path))
        return

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for shape in args.shapes:
        model_path = build_model(shape, Path(args.models) / shape)
        samples_path = Path(tempfile.mkdtemp()) / "samples.json"
        for head in ("bf16", "fp32"):  # an engine a process: the device is the trainer's once they exit
            subprocess.run([sys.executable, __file__, "--child", head, model_path, str(samples_path)], check=True)
        logprobs = json.loads(samples_path.read_text())
        samples = logprobs.pop("samples")
        for side in TRAINER_SIDES:
            logprobs[side] = scored(model_path, side, samples, device)
        row = {"shape": shape, "tokens": sum(len(r) for r in logprobs["vllm"])}
        row |= {f"{a} / {b}": mean_abs_difference(logprobs[a], logprobs[b]) for a, b in PAIRS}
        row["mean logp (reference)"] = statistics.fmean(x for r in logprobs["reference"] for x in r)
        results.append(row)
        Path(args.out).write_text(json.dumps(results, indent=1))
        shown = (f"{key}={value:.5g}" if isinstance(value, float) else f"{key}={value}" for key, value in row.items())
        print(" ".join(shown), flush=True)
    print()
    for row in results:
        print(f"{row['shape']}, mean |logp difference| over {row['tokens']} tokens:")
        print("| pair | mean |logp difference| |")
        print("|---|---|")
        for a, b in PAIRS:
            print(f"| {a} / {b} | {row[f'{a} / {b}']:.5f} |")
        print()


if __name__ == "__main__":
    main()
