#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): tiny GRPO steps through `coordrl train`, then one optimizer step of
# a random Qwen3-4B-shaped model (8B too while time allows) at the PARSER 4B config's per-device batch,
# with the plan's memory estimate beside the measured peak as `ratio: measured/planned`. JSON under --out.
#
#   scripts/gpu_check.sh [--out DIR] [--cpu-smoke] [-- extra gpu_check.py flags]
#
# On a bare GPU machine that lacks coordrl's dependencies (TRL, datasets, ...), first run
# scripts/fetch_gpu_wheels.sh here: the wheels in .gpu_wheels/ are installed (no network, no
# dependency resolution) into a scratch folder put first on PYTHONPATH, so the machine's own torch
# and CUDA stay as they are. --cpu-smoke runs the same stages with tiny shapes on the CPU (CI).
# Environment: PYTHON (default: the repo's .venv with --cpu-smoke, else python3), WHEELS (default .gpu_wheels).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=""
SMOKE=()
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --cpu-smoke) SMOKE=(--cpu-smoke); shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "gpu_check: unknown argument $1 (use --out DIR, --cpu-smoke, -- extra flags)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/coordrl-gpu-check.XXXXXX")}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ ${#SMOKE[@]} -gt 0 ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"

WHEELS="${WHEELS:-$REPO/.gpu_wheels}"
SITE=""
if [ ${#SMOKE[@]} -eq 0 ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="$(mktemp -d "${TMPDIR:-/tmp}/coordrl-gpu-site.XXXXXX")"
  t0=$SECONDS
  "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl || {
    echo "gpu_check: installing the wheels in $WHEELS failed (fetch_gpu_wheels.sh fetches them for the GPU machine's Python 3.12)" >&2
    exit 2
  }
  echo "gpu_check: installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE in $((SECONDS - t0))s"
fi
export PYTHONPATH="${SITE:+$SITE:}$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "$REPO/scripts/gpu_check.py" --out "$OUT" "${SMOKE[@]}" "${EXTRA[@]}"
