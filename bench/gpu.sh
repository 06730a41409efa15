#!/usr/bin/env bash
# The GPU benchmarks and GPU tests, on any CUDA machine with the package installed (pip install -e ".[vllm]"),
# run from the repository root. Each call writes into one results folder, $OUT, by default
# bench/results/<date>-<gpu>-<commit>/ (the commit gets "-dirty" when tracked files differ from it), with
# environment.txt (GPU, driver, Python and library versions) and commands.txt (the calls that wrote there).
#   bash bench/gpu.sh tests               GPU tests of engine, sync, resume and interrupts; sleep/wake profile (1.5B)
#   bash bench/gpu.sh bench 1.5B [KIND..] stock TRL against ours at one shape (bench/sync_vs_trl.py), e.g.
#                                         bench 7B stock ours-ma (default: every kind)
#   bash bench/gpu.sh generate 1.5B       generation under stock TRL's engine settings and ours (bench/generate_speed.py)
#   bash bench/gpu.sh frontier 1.5B 7B    the smallest simulated card each way of serving runs on (bench/memory_frontier.py)
#   bash bench/gpu.sh push 1.5B           where a sync's push spends its time (bench/profile_push.py)
#   bash bench/gpu.sh dp 1.5B 1 2 4       the user's config on 1, 2 and 4 GPUs of this host (bench/data_parallel.py)
#   bash bench/gpu.sh kernel              merge-kernel tiles and warps at both shapes (bench/merge_kernel_variants.py)
#   bash bench/gpu.sh copies              ways to copy the frozen tensors at both shapes (bench/frozen_copies.py)
#   bash bench/gpu.sh writes              ways to write the LoRA factors into vLLM's buffers (bench/adapter_write_variants.py)
#   bash bench/gpu.sh loragen             vLLM's LoRA generation options against no LoRA, 1.5B and 7B (bench/lora_generate_variants.py)
#   bash bench/gpu.sh loratune 7B         a search of vLLM's LoRA kernel configs, then generation with them, profiled
#                                         (bench/lora_kernel_configs.py, bench/lora_generate_variants.py)
#   bash bench/gpu.sh lora                merge-aware against PEFT LoRA, forward + backward (bench/lora_speed.py)
#   bash bench/gpu.sh head                the trainer's head: bf16, fp32, fp32 on TF32 cores (bench/fp32_head_speed.py)
#   bash bench/gpu.sh sources             each side's logprobs against a float32 reference (bench/mismatch_sources.py)
#   bash bench/gpu.sh step 7B user        the kernels of one profiled optimizer step of a kind (bench/profile_step.py)
#   bash bench/gpu.sh memory              create/train/release cycles (tests/test_memory.py), 200 steps of the
#                                         default job (bench/memory_growth.py)
# The random-weight 1.5B and 7B models are built once, in $MODELS (default /tmp/sync_vs_trl_models).
set -u
case ${1:-} in
tests | kernel | copies | writes | loragen | lora | head | sources | memory) ;;
bench | push | generate | frontier | dp | step | loratune) [ $# -ge 2 ] || { sed -n '2,25p' "$0"; exit 2; } ;;
*) sed -n '2,25p' "$0"; exit 2 ;;
esac
# Every model is built locally (random weights, the tiny model): nothing needs the Hugging Face Hub.
export TRL_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
models=${MODELS:-/tmp/sync_vs_trl_models}
commit=$(git rev-parse --short=7 HEAD 2>/dev/null || echo nogit)
git diff --quiet HEAD 2>/dev/null || commit=$commit-dirty
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/^NVIDIA //' | tr 'A-Z ' 'a-z-')
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

model() {  # build the random-weight model of shape $1 in $models/$1 unless it is there (as sync_vs_trl.py does)
  python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import sync_vs_trl as b; \
b.build_model('$1', Path('$models/$1'))"
}

fresh() {  # $1, or $1_run2, $1_run3, ... when $out already holds $1.txt: a second call keeps the first's files
  local name=$1 i=2
  while [ -e "$out/$name.txt" ]; do name=${1}_run$i; i=$((i + 1)); done
  echo "$name"
}

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
  model 1.5B
  python3 bench/profile_sleep_wake.py "$models/1.5B" > "$out/profile_sleep_wake_1.5B.txt" 2>&1
  grep -a -E "pool|allocates|gc.collect|Error" "$out/profile_sleep_wake_1.5B.txt"
  ;;
bench)
  name=$(fresh "sync_vs_trl_$2")
  python3 bench/sync_vs_trl.py --shapes "$2" ${3:+--kinds ${*:3}} --models "$models" --out "$out/$name.json" \
    > "$out/$name.txt" 2>&1
  tail -25 "$out/$name.txt"
  ;;
frontier)
  name=$(fresh memory_frontier)
  python3 bench/memory_frontier.py --shapes "${@:2}" --models "$models" --out "$out/$name.json" > "$out/$name.txt" 2>&1
  tail -30 "$out/$name.txt"
  ;;
generate)
  name=$(fresh "generate_speed_$2")
  python3 bench/generate_speed.py --shape "$2" --models "$models" --out "$out/$name.json" > "$out/$name.txt" 2>&1
  grep -a -E "generate|failed" "$out/$name.txt"
  ;;
dp)
  name=$(fresh "data_parallel_$2")
  python3 bench/data_parallel.py --shape "$2" ${3:+--ranks ${*:3}} --models "$models" --out "$out/$name.json" \
    > "$out/$name.txt" 2>&1
  tail -8 "$out/$name.txt"
  ;;
push)
  model "$2"
  name=$(fresh "profile_push_$2")
  python3 bench/profile_push.py "$models/$2" > "$out/$name.txt" 2>&1
  grep -a -v -E "^(INFO|WARNING|\[)" "$out/$name.txt" | tail -25
  ;;
kernel)
  python3 bench/merge_kernel_variants.py > "$out/merge_kernel_variants.txt" 2>&1
  cat "$out/merge_kernel_variants.txt"
  ;;
copies)
  python3 bench/frozen_copies.py > "$out/frozen_copies.txt" 2>&1
  cat "$out/frozen_copies.txt"
  ;;
writes)
  python3 bench/adapter_write_variants.py > "$out/adapter_write_variants.txt" 2>&1
  cat "$out/adapter_write_variants.txt"
  ;;
head)
  python3 bench/fp32_head_speed.py > "$out/fp32_head_speed.txt" 2>&1
  grep -a -E "^\|" "$out/fp32_head_speed.txt"
  ;;
sources)
  python3 bench/mismatch_sources.py --shapes 1.5B 1.5B-sharp 7B --models "$models" --out "$out/mismatch_sources.json" \
    > "$out/mismatch_sources.txt" 2>&1
  grep -a -E "^\|" "$out/mismatch_sources.txt"
  ;;
step)
  name=$(fresh "profile_step_$2_${3:-user}")
  python3 bench/profile_step.py --shape "$2" --kind "${3:-user}" --models "$models" > "$out/$name.txt" 2>&1
  grep -a -A25 "micro-batch" "$out/$name.txt"
  ;;
loragen)
  for shape in 1.5B 7B; do
    python3 bench/lora_generate_variants.py --shape $shape --models "$models" --out "$out/lora_generate_variants_$shape.json" \
      > "$out/lora_generate_variants_$shape.txt" 2>&1
    grep -a -E "^\|" "$out/lora_generate_variants_$shape.txt"
  done
  ;;
loratune)
  for shape in "${@:2}"; do
    python3 bench/lora_kernel_configs.py --shape $shape --out-dir "$out/lora_kernel_configs_$shape" \
      > "$out/lora_kernel_configs_$shape.txt" 2>&1
    tail -4 "$out/lora_kernel_configs_$shape.txt"
    python3 bench/lora_generate_variants.py --shape $shape --variants lora merged lora-tuned --profile \
      --tuned-configs "$out/lora_kernel_configs_$shape" --models "$models" --out "$out/lora_generate_tuned_$shape.json" \
      > "$out/lora_generate_tuned_$shape.txt" 2>&1
    grep -a -E "^\|" "$out/lora_generate_tuned_$shape.txt"
  done
  ;;
lora)
  python3 bench/lora_speed.py --out "$out/lora_speed.json" > "$out/lora_speed.txt" 2>&1
  tail -25 "$out/lora_speed.txt"
  ;;
memory)
  # Its own process: the last cycle closes the engine, after which vLLM allows no other in the process.
  python3 -m pytest -q -s -p no:cacheprovider tests/test_memory.py > "$out/pytest_memory.txt" 2>&1
  python3 bench/memory_growth.py --steps 200 --out "$out/memory_growth.json" > "$out/memory_growth.txt" 2>&1
  grep -a -E "GiB in use|passed|failed" "$out/pytest_memory.txt"
  grep -a -E "^ +[0-9]+ |growth|Trained" "$out/memory_growth.txt"
  ;;
esac
