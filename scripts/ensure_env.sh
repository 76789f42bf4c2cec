#!/usr/bin/env bash
# Create or reuse the project virtualenv (.venv) with coordrl installed in editable mode.
# torch is pinned to the CPU build first so that no dependency drags in a CUDA build.
# Reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${COORDRL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.coordrl-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "coordrl: setting up $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet "torch==2.13.0" >&2
fi
"$venv/bin/python" -m pip install --quiet -e "$root[test]" >&2
echo "$want" > "$stamp"
