#!/usr/bin/env bash
# Run here (with a package index), from the repository root, before a GPU check on a machine
# without one: fills the ignored `.gpu/` folder that `. .gpu/device-setup.sh` installs from there.
#   1. the shared GPU kit (flashinfer, its missing dependency, precompiled kernels), and
#   2. pydantic's wheels for the GPU machine's Python, which the kit lacks and `raydix.deploy.config`
#      (the app config that `benchmarks/gpu_bench.py` builds the engine from) needs.
#   3. with GPU_AGAINST=REV, commit REV's tree in the ignored `.gpu-against/`, for gpu_check.sh's
#      `against` step (the engine of REV benchmarked beside this checkout's, in the same call).
# GPU_PYTHON_VERSION picks the GPU machine's Python (default 3.12). Carry `.gpu` (and
# `.gpu-against`) in the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=${GPU_KIT:-../shared/gpu}
bash "$kit/prepare.sh"
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest .gpu \
  --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux_2_17_x86_64 \
  pydantic pydantic-core annotated-types typing-inspection
if [ -n "${GPU_AGAINST:-}" ]; then
  rm -rf .gpu-against && mkdir .gpu-against
  git archive "$GPU_AGAINST" | tar -x -C .gpu-against
  git rev-parse "$GPU_AGAINST" > .gpu-against/REVISION
  echo "baseline for the against step: $(cat .gpu-against/REVISION)"
fi
ls .gpu
