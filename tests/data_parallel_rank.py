"""One rank of tests/test_data_parallel.py, started by torchrun: trains, then reports what its engine serves.

python -m torch.distributed.run --nproc_per_node 2 tests/data_parallel_rank.py CONFIG REPORT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
from vllm import SamplingParams

from colocate_grpo.sync import served_weight_mismatches
from colocate_grpo.train import build_trainer


def main(config: str, reports: str) -> None:
    trainer = build_trainer(config)
    trainer.train()
    generation, engine = trainer.vllm_generation, trainer.engine
    generation.sync_weights()  # the trained weights, into this rank's engine
    executor = engine.llm_engine.model_executor
    sampled = engine.generate([{"prompt_token_ids": [20, 11, 21, 29]}] * 4, SamplingParams(max_tokens=8, seed=None))
    lora = torch.cat([p.detach().flatten().float() for n, p in trainer.model.named_parameters() if "lora_" in n])
    report = {
        "rank": int(os.environ["RANK"]),
        "executor": type(executor).__name__,
        "worker_rank": executor.driver_worker.worker.rank,
        "mismatches": served_weight_mismatches(trainer.model, engine, generation.merged_in_place),
        "lora_sum": lora.double().sum().item(),
        "sampled": [list(out.outputs[0].token_ids) for out in sampled],
    }
    Path(reports, f"rank{report['rank']}.json").write_text(json.dumps(report))
    generation.merged_in_place.restore()  # the trainer's base again, as after a generation
    trainer.engine.sleep()


if __name__ == "__main__":
    main(*sys.argv[1:])
