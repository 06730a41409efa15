"""What vLLM's detokenization of the sampled tokens costs a generation batch, on this machine.

TRL reads the token ids and logprobs of each completion and decodes them itself; vLLM detokenizes
every sampled token too (and its logprob's token), on the CPU, between decode steps, unless the
sampling parameters say ``detokenize=False`` (what colocate_grpo's generation passes). One engine
generates the same batch with and without, alternating, and prints the medians.

    python bench/detokenize_cost.py                                       # the tiny model (CPU or GPU)
    python bench/detokenize_cost.py --model /tmp/sync_vs_trl_models/1.5B --tokens 256   # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the tiny model)")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48, help="completion tokens per sequence")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams

    from colocate_grpo.config import VLLMConfig
    from colocate_grpo.engine import Engine
    from colocate_grpo.tiny import tiny_model_path

    model = args.model or str(tiny_model_path())
    length = 64 if args.model is None else 64 + args.tokens
    engine = Engine(model, VLLMConfig(max_model_len=length), max_num_seqs=args.sequences)
    prompts = [{"prompt_token_ids": [20, 11, 21, 29 + i % 5]} for i in range(args.sequences)]
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for detokenize in (True, False):
            params = SamplingParams(
                temperature=1.0, max_tokens=args.tokens, min_tokens=args.tokens, logprobs=0, detokenize=detokenize
            )
            began = time.perf_counter()
            engine.generate(prompts, params)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[detokenize].append(time.perf_counter() - began)
    # The first round warms up.
    result = {f"detokenize={k}": {"median_s": statistics.median(v[1:]), "all_s": v} for k, v in times.items()}
    text, ids = result["detokenize=True"]["median_s"], result["detokenize=False"]["median_s"]
    print(json.dumps(result, indent=1))
    print(
        f"{args.sequences} sequences x {args.tokens} tokens: {text:.4f} s detokenized, {ids:.4f} s not "
        f"({100 * (1 - ids / text):.0f}% less)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    engine.close()


if __name__ == "__main__":
    main()
