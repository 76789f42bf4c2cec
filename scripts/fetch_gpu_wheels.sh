#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh needs on the lent GPU machine into .gpu_wheels/ (git-ignored;
# give it to the device call as a carried path) and print their total size.
#
#   scripts/fetch_gpu_wheels.sh [DIR]
#
# That machine (Python 3.12, x86-64, no network) already has torch with CUDA, accelerate, safetensors,
# pyarrow, pandas, numpy, xxhash, fsspec, aiohttp, httpx, yarl, pyyaml and tokenizers; it lacks TRL and
# datasets, and its transformers (5.17) and huggingface_hub (1.x) are older than coordrl's pins. So:
# coordrl's pinned versions of those (all pure Python), datasets' two missing pure-Python dependencies,
# and multiprocess built for CPython 3.12. No dependency resolution: exactly this list.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO/.gpu_wheels}"
PIP="${PIP:-$REPO/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
mkdir -p "$DIR"
PURE=(trl==1.16.0 datasets==5.2.0 transformers==5.24.0 huggingface_hub==2.4.0 dill==0.4.1)
$PIP download --quiet --no-deps --only-binary=:all: --dest "$DIR" "${PURE[@]}"
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --dest "$DIR" multiprocess==0.70.19
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
ls -1 "$DIR"/*.whl | xargs -n1 basename
echo "fetch_gpu_wheels: $(ls -1 "$DIR"/*.whl | wc -l) wheels in $DIR, $(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1e6 }') MB in all (limit 40 MB)"
