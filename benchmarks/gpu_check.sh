#!/usr/bin/env bash
# Every check that needs a CUDA machine, in one command (run from the repository root):
#   1. the GPU tests (pytest -m gpu): flashinfer and CUDA-graph decode against the torch backend;
#      serve's default config builds the fast path; the KV pool leaves the headroom it promises;
#      the warm-up compiles the kernels before the engine is ready; each fused op's flashinfer
#      kernel against its torch code; CUDA-graph decode planned once (flashinfer's plan with the
#      KV split off does not depend on the lengths; replays over the kept page table against an
#      fp32 reference; tokens against eager decode);
#   2. the engine as `raydix serve` builds it by default (benchmarks/gpu_bench.py), beside
#      transformers: decode-heavy (1, 16, 64 streams), shared-prefix and mixed workloads, the
#      decode step's time split and the share of the memory-bandwidth floor at batch 1, for a
#      ~1B Llama (random weights, TinyLlama-1.1B's shape) and the default model;
#   3. the worker-level floor report (benchmarks/worker_bench.py);
#   4. kernels per decoder layer of a decode step (benchmarks/kernel_count.py; budget 15);
#   5. serving through `raydix serve` against the engine in-process (benchmarks/serve_bench.py):
#      the default model at 1, 16 and 64 streams of 256 tokens; the targets are an added TTFT
#      <= 5 ms and an added time per token <= 1 ms at one stream, >= 95% of the engine's
#      throughput at 64 streams, and no gap over 100 ms in any stream;
#   6. the host time of a decode step's page table and of a replay's planning
#      (benchmarks/page_table_bench.py --cuda): kept against rebuilt page by page, and
#      cuda_graph_plan once against every_step, at 1, 16 and 64 requests.
# Results go to $OUT when it is set (else ./gpu-check): logs, JSON and markdown tables.
#
# It uses the Python environment it finds (`make setup` on a CUDA host installs everything). On a
# machine without a package index: here, `bash benchmarks/gpu_prepare.sh`; there, `. .gpu/device-setup.sh`
# first. This checkout is installed without dependencies if `raydix` does not import yet.
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
"$PYTHON" -m pytest -m gpu tests/workers/test_gpu.py tests/workers/test_gpu_defaults.py \
  tests/workers/test_fused_ops_gpu.py tests/workers/test_staging.py \
  tests/workers/test_graph_plan_gpu.py -v \
  -p no:cacheprovider 2>&1 | tee "$out/pytest-gpu.log" || status=1
for model in "--synthetic llama-1b" ""; do
  name=${model:+llama-1b}; name=${name:-default}
  # shellcheck disable=SC2086
  "$PYTHON" benchmarks/gpu_bench.py $model --json "$out/gpu-bench-$name.json" 2>&1 \
    | tee "$out/gpu-bench-$name.log" || status=1
done
"$PYTHON" benchmarks/worker_bench.py --skip-cpu --synthetic llama-1b \
  --json "$out/worker-bench-llama-1b.json" 2>&1 | tee "$out/worker-bench-llama-1b.log" || status=1
"$PYTHON" benchmarks/kernel_count.py --json "$out/kernel-count.json" 2>&1 \
  | tee "$out/kernel-count.log" || status=1
RAY_AUTH_MODE=disabled "$PYTHON" benchmarks/serve_bench.py --streams 1 16 64 --output-len 256 \
  --repeats 2 --json "$out/serve-bench-default.json" 2>&1 | tee "$out/serve-bench-default.log" \
  || status=1
"$PYTHON" benchmarks/page_table_bench.py --cuda --json "$out/page-table-bench.json" 2>&1 \
  | tee "$out/page-table-bench.log" || status=1
exit $status
