#!/usr/bin/env bash
# gpu_check.sh's `against` step: benchmarks/gpu_bench.py of the baseline commit in .gpu-against/
# (`GPU_AGAINST=REV bash benchmarks/gpu_prepare.sh`), on the same card as this checkout's `bench`
# step, then each workload's ratio (this checkout / the baseline). The baseline is installed in
# this checkout's place for its run, and this checkout again after it. Argument: the results
# folder (where `bench` wrote gpu-bench-llama-1b.json).
set -uo pipefail
PYTHON=${PYTHON:-python3}
out=$(realpath "${1:?the results folder}")
rev=$(cat .gpu-against/REVISION)
echo "baseline: $rev"
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .gpu-against || exit 1
(cd .gpu-against && "$PYTHON" benchmarks/gpu_bench.py --synthetic llama-1b \
  --json "$out/gpu-bench-against.json")
rc=$?
"$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
[ "$rc" -eq 0 ] || exit "$rc"
"$PYTHON" benchmarks/gpu_ratios.py "$out/gpu-bench-llama-1b.json" "$out/gpu-bench-against.json" \
  --baseline "$rev"
