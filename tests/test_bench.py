"""The benchmarks still run: every script imports, and those with a CPU check pass it (bench/README.md).

The benchmarks mostly run on a GPU, which is scarce: a change to the library that breaks one should fail
here, before a GPU's time is spent on it. Each runs in its own process, from a temporary directory, as a
user runs it (``python bench/<script>.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py"))

# The CPU checks that the scripts' docstrings name, cut to few steps, kinds and batches.
CPU_CHECKS = {
    "sync_vs_trl": ["--shapes", "tiny", "--kinds", "ours-ma", "user-adapter", "--steps", "2", "--together"]
    + ["--repeat-syncs", "1", "--models", ".", "--out", "out.json"],
    "memory_frontier": ["--plan-only", "--micro-batch", "8"],
    "mismatch_sources": ["--shapes", "tiny", "--models", ".", "--out", "out.json"],
    "lora_generate_variants": ["--shape", "tiny", "--variants", "lora", "--batches", "1", "--models", "."]
    + ["--out", "out.json"],
    "data_parallel": ["--shape", "tiny", "--ranks", "1", "--steps", "3", "--models", ".", "--out", "out.json"],
    "merge_in_place": ["--shape", "tiny-ish"],
}


def run_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRL_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_every_benchmark_imports(tmp_path):
    imports = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]); [importlib.import_module(m) for m in sys.argv[2:]]"
    )
    done = run_script(["-c", imports, str(BENCH), *SCRIPTS], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CPU_CHECKS))
def test_benchmark_passes_its_cpu_check(script, tmp_path):
    done = run_script([str(BENCH / f"{script}.py"), *CPU_CHECKS[script]], tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    if "out.json" in CPU_CHECKS[script]:
        assert (tmp_path / "out.json").stat().st_size > 0
