#!/usr/bin/env bash
# The GPU tests, on any CUDA machine with the package installed (pip install -e ".[vllm]"), run from the
# repository root into one results folder, $OUT, by default bench/results/<date>-<gpu>-<commit>/ (the commit
# gets "-dirty" when tracked files differ from it), with environment.txt (GPU, driver, Python and library
# versions) and commands.txt (the calls that wrote there). The benchmarks are bench/run.py's (bench/README.md).
#   bash bench/gpu.sh tests     GPU tests of engine, sync, resume, interrupts, adapters, shared base, QLoRA
#   bash bench/gpu.sh memory    create/train/release cycles (tests/test_memory.py)
set -u
case ${1:-} in
tests | memory) ;;
*) sed -n '2,7p' "$0"; exit 2 ;;
esac
export TRL_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
commit=$(git rev-parse --short=7 HEAD 2>/dev/null || echo nogit)
git diff --quiet HEAD 2>/dev/null || commit=$commit-dirty
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/^NVIDIA //' | awk '{print tolower($1)}')
out=${OUT:-bench/results/$(date -u +%F)-$gpu-$commit}
mkdir -p "$out"
[ -e "$out/environment.txt" ] || {
  echo "commit $commit"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, peft, trl, vllm; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__, \
'vllm', vllm.__version__)" 2>&1 | tail -1
} > "$out/environment.txt"
echo "bash bench/gpu.sh $*" >> "$out/commands.txt"

case $1 in
tests)
  # Two processes: vLLM allows one sleep-mode engine per process, and test_engine.py builds its own.
  python3 -m pytest -q -p no:cacheprovider tests/test_engine.py > "$out/pytest_engine.txt" 2>&1
  python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_sync.py tests/test_end_to_end.py \
    tests/test_interrupts.py > "$out/pytest.txt" 2>&1
  # Adapter serving starts its engine with LoRA support: a process of its own.
  python3 -m pytest -q -p no:cacheprovider tests/test_adapters.py > "$out/pytest_adapters.txt" 2>&1
  # The shared base, served as the adapter (an engine with LoRA support) and merged: a process each.
  python3 -m pytest -q -p no:cacheprovider tests/test_shared_base.py -k adapter > "$out/pytest_shared_base.txt" 2>&1
  python3 -m pytest -q -p no:cacheprovider tests/test_shared_base.py -k "not adapter" >> "$out/pytest_shared_base.txt" 2>&1
  for case in tied_qwen2 untied_llama qk_norms_qwen3 q_and_v_qwen2; do  # QLoRA: one engine per case
    python3 -m pytest -q -p no:cacheprovider tests/test_qlora.py -k "$case" >> "$out/pytest_qlora.txt" 2>&1
  done
  tail -3 "$out/pytest_engine.txt" "$out/pytest.txt" "$out/pytest_adapters.txt"
  grep -a -E "passed|failed" "$out/pytest_shared_base.txt"
  grep -a -E "passed|failed" "$out/pytest_qlora.txt"
  ;;
memory)
  # Its own process: the last cycle closes the engine, after which vLLM allows no other in the process.
  python3 -m pytest -q -s -p no:cacheprovider tests/test_memory.py > "$out/pytest_memory.txt" 2>&1
  grep -a -E "GiB in use|passed|failed" "$out/pytest_memory.txt"
  ;;
esac
