#!/usr/bin/env bash
# Every check that needs a CUDA machine, in one command (run from the repository root):
#   1. the flashinfer backend and CUDA-graph decode against the torch backend (pytest -m gpu);
#   2. decode speed with flashinfer + CUDA graphs as a fraction of the memory-bandwidth floor,
#      for a ~1B-parameter Llama (random weights, TinyLlama-1.1B's shape) and the default model.
# Results go to $OUT when it is set (else ./gpu-check): the pytest log and the benchmark's JSON.
#
# It uses the Python environment it finds: torch with CUDA, transformers, safetensors, pytest
# and flashinfer (`make setup` on a CUDA host installs them all). On a machine without internet,
# bring what is missing as wheels and put them on PYTHONPATH first, e.g. flashinfer-python and
# its needs from `pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64`.
# This checkout is installed without dependencies if `raydix` does not import yet.
# PYTHON picks another interpreter.
set -euo pipefail
PYTHON=${PYTHON:-python3}
out=${OUT:-gpu-check}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if ! "$PYTHON" -c 'import raydix.workers' 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$PYTHON" -c 'import torch, flashinfer; assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "flashinfer", flashinfer.__version__, torch.cuda.get_device_name())'
status=0
"$PYTHON" -m pytest -m gpu tests/workers/test_gpu.py -v -p no:cacheprovider 2>&1 \
  | tee "$out/pytest-gpu.log" || status=1
"$PYTHON" benchmarks/worker_bench.py --skip-cpu --synthetic llama-1b \
  --json "$out/worker-bench-llama-1b.json" 2>&1 | tee "$out/worker-bench-llama-1b.log" || status=1
"$PYTHON" benchmarks/worker_bench.py --skip-cpu \
  --json "$out/worker-bench-default.json" 2>&1 | tee "$out/worker-bench-default.log" || status=1
exit $status
