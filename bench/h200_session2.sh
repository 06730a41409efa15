#!/usr/bin/env bash
# Device call after staging vLLM (shared/gpu/README.md): the GPU tests of the sync, resume, interrupts and
# memory cycles, then the 200-step memory run. Results go to $OUT (bench/results/ when run by hand).
set -u
export PYTHONPATH=/tmp/gpu-site:$PWD TRL_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_sync.py tests/test_end_to_end.py \
  tests/test_interrupts.py > "$out/h200_pytest_sync.txt" 2>&1
# Its own process: the last cycle closes the engine, after which vLLM allows no other in the process.
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_memory.py > "$out/h200_pytest_memory.txt" 2>&1
timeout 200 python3 bench/memory_growth.py --steps 200 --out "$out/memory_growth_h200.json" > "$out/memory_growth_h200.txt" 2>&1
tail -4 "$out/h200_pytest_sync.txt"; grep -a -E "GiB in use|passed|failed" "$out/h200_pytest_memory.txt"
grep -a -E "^ +[0-9]+ |growth|Trained" "$out/memory_growth_h200.txt"
