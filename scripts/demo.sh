#!/usr/bin/env bash
# The main job on embedded defaults: offline, CPU, minutes. Creates or reuses .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/ensure_env.sh"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-offline}" TOKENIZERS_PARALLELISM=false
cd "$root"
exec "$root/.venv/bin/coordrl" demo "$@"
