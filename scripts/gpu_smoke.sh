#!/usr/bin/env bash
# GPU smoke test for any single-GPU CUDA host: 3 GRPO steps of the tiny random Qwen3 on the GPU, bf16,
# lexical readers and the shipped sample data (configs/tiny_cpu.yaml), no vLLM, no network.
#
#   scripts/gpu_smoke.sh [OUT_DIR]          (default: a new /tmp/coordrl-gpu-smoke.* directory)
#
# Passes when `coordrl train` exits 0 and a checkpoint folder exists; prints GPU memory before, after
# and the peak seen while training. Environment: PYTHON (default: the repo's .venv, else python3),
# CUDA_VISIBLE_DEVICES (default 0), STEPS (default 3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
OUT="${1:-$(mktemp -d "${TMPDIR:-/tmp}/coordrl-gpu-smoke.XXXXXX")}"
STEPS="${STEPS:-3}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu_smoke: nvidia-smi not found: not a CUDA host" >&2; exit 2; }
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_smoke: torch.cuda.is_available() is False for $PYTHON" >&2; exit 2; }
gpu_mem() { nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader; }

echo "== GPU memory before"; gpu_mem
echo "== building the tiny model in $OUT/tiny-qwen3"
"$PYTHON" "$REPO/scripts/build_tiny_qwen3.py" --out "$OUT/tiny-qwen3"

# Sample used memory every 200 ms while training, to report the peak.
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$OUT/mem_samples.txt" 2>/dev/null &
SAMPLER=$!
trap 'kill "$SAMPLER" 2>/dev/null || true' EXIT

echo "== coordrl train: $STEPS steps on GPU $CUDA_VISIBLE_DEVICES (log: $OUT/train.log)"
rc=0
"$PYTHON" -m coordrl.cli train --config "$REPO/configs/tiny_cpu.yaml" --model "$OUT/tiny-qwen3" \
  --bf16 true --use_cpu false --max_steps "$STEPS" --save_steps "$STEPS" --output_dir "$OUT/run" --report_to none \
  2>&1 | tee "$OUT/train.log" || rc=$?
kill "$SAMPLER" 2>/dev/null || true

echo "== GPU memory after"; gpu_mem
peak="$(sort -n "$OUT/mem_samples.txt" 2>/dev/null | tail -1)"
echo "peak memory.used while training: ${peak:-?} MiB"

if [ "$rc" -ne 0 ]; then
  echo "gpu_smoke: FAIL: coordrl train exited with status $rc (log: $OUT/train.log)" >&2
  exit 1
fi
ckpt="$(find "$OUT/run" -maxdepth 1 -type d -name 'checkpoint-*' | sort -V | tail -1)"
if [ -z "$ckpt" ]; then
  echo "gpu_smoke: FAIL: no checkpoint-* folder in $OUT/run" >&2
  exit 1
fi
echo "gpu_smoke: OK: $STEPS steps, checkpoint $ckpt"
