#!/usr/bin/env bash
# One device call on the H200, after staging vLLM (shared/gpu/README.md): the GPU-relevant tests,
# the default job, and the LoRA speed benchmark. Results go to $OUT (bench/results/ when run by hand).
set -u
export PYTHONPATH=/tmp/gpu-site:$PWD TRL_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, peft, trl, vllm; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1
  python3 -c "import hashlib; from colocate_grpo.tiny import tiny_model_path as p
print('tiny model sha256', hashlib.sha256((p() / 'model.safetensors').read_bytes()).hexdigest()[:16])" 2>&1 | tail -1
} > "$out/h200_versions.txt"
for n in 16 64; do timeout 240 python3 bench/probe_max_num_seqs.py $n > "$out/h200_probe_$n.txt" 2>&1
  echo "probe max_num_seqs=$n rc=$?" >> "$out/h200_versions.txt"; done
python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_end_to_end.py tests/test_engine.py \
  tests/test_lora.py > "$out/h200_pytest.txt" 2>&1
python3 -m colocate_grpo.train > "$out/h200_tiny.log" 2>&1
cp outputs/tiny/metrics.jsonl "$out/h200_tiny_metrics.jsonl"
python3 bench/lora_speed.py --out "$out/lora_speed_h200.json" > "$out/lora_speed_h200.txt" 2>&1
cat "$out/h200_versions.txt"; tail -3 "$out/h200_pytest.txt"; grep -a "Trained" "$out/h200_tiny.log"; cat "$out/lora_speed_h200.txt" | tail -25
