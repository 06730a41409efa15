#!/usr/bin/env bash
# Device calls after staging vLLM (shared/gpu/README.md). Results go to $OUT (bench/results/ by hand).
#   bash bench/h200.sh tests        the GPU tests of engine, sync, resume and interrupts; sleep/wake profile
#   bash bench/h200.sh bench 1.5B   stock TRL against ours at one shape (bench/sync_vs_trl.py)
#   bash bench/h200.sh push 1.5B    where a sync's push spends its time (bench/profile_push.py)
#   bash bench/h200.sh kernel       merge-kernel variants at both shapes (bench/merge_kernel_variants.py)
set -u
export PYTHONPATH=/tmp/gpu-site:$PWD TRL_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
case $1 in
tests)
  # Two processes: vLLM allows one sleep-mode engine per process, and test_engine.py builds its own.
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py > "$out/h200_pytest_engine.txt" 2>&1
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_sync.py tests/test_end_to_end.py \
    tests/test_interrupts.py > "$out/h200_pytest.txt" 2>&1
  tail -3 "$out/h200_pytest_engine.txt" "$out/h200_pytest.txt"
  python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import sync_vs_trl as b; \
b.build_model('1.5B', Path('/tmp/sync_vs_trl_models/1.5B'))"
  timeout 200 python3 bench/profile_sleep_wake.py /tmp/sync_vs_trl_models/1.5B > "$out/profile_sleep_wake_1.5B.txt" 2>&1
  grep -a -E "pool|allocates|gc.collect|Error" "$out/profile_sleep_wake_1.5B.txt"
  ;;
bench)
  timeout 580 python3 bench/sync_vs_trl.py --shapes "$2" ${3:+--kinds $3} --out "$out/sync_vs_trl_$2.json" \
    > "$out/sync_vs_trl_$2.txt" 2>&1
  tail -25 "$out/sync_vs_trl_$2.txt"
  ;;
push)
  timeout 200 python3 bench/profile_push.py "/tmp/sync_vs_trl_models/$2" > "$out/profile_push_$2.txt" 2>&1
  grep -a -v -E "^(INFO|WARNING|\[)" "$out/profile_push_$2.txt" | tail -25
  ;;
kernel)
  (cd bench && timeout 300 python3 merge_kernel_variants.py > "$out/merge_kernel_variants.txt" 2>&1)
  cat "$out/merge_kernel_variants.txt"
  ;;
esac
