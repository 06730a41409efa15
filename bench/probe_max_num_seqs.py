"""Probe: does vLLM start on the tiny model with a given max_num_seqs? (python ... 16; exit code 0 = yes)"""

import sys

from vllm import LLM, SamplingParams

from colocate_grpo.tiny import tiny_model_path


def main() -> None:
    llm = LLM(
        str(tiny_model_path()),
        dtype="bfloat16",
        gpu_memory_utilization=0.1,
        max_model_len=32,
        max_num_seqs=int(sys.argv[1]),
        max_num_batched_tokens=4096,
        enforce_eager=True,
        enable_sleep_mode=True,
    )
    print(
        "PROBE max_num_seqs",
        sys.argv[1],
        "generated",
        llm.generate(["1+1="], SamplingParams(max_tokens=2))[0].outputs[0].text,
    )


if __name__ == "__main__":
    main()
