#!/usr/bin/env bash
# Run here (with a package index), from the repository root, before a GPU check on a machine
# without one: fills the ignored `.gpu/` folder that `. .gpu/device-setup.sh` installs from there.
#   1. the shared GPU kit (flashinfer, its missing dependency, precompiled kernels), and
#   2. pydantic's wheels for the GPU machine's Python, which the kit lacks and `raydix.deploy.config`
#      (the app config that `benchmarks/gpu_bench.py` builds the engine from) needs.
#   3. with GPU_AGAINST=REV, commit REV's tree in the ignored `.gpu-against/`, for gpu_check.sh's
#      `against` step (the engine of REV benchmarked beside this checkout's, in the same call).
#   4. with GPU_RAY=1, Ray Serve for the `serve` step, in the ignored `.gpu-ray/`: this
#      environment's Ray and the serve packages the GPU image lacks, as wheels for its Python,
#      unpacked and pruned (Java, the dashboard's web client, RLlib, Tune, Train, Data, tests) into
#      one xz archive of about 30 MB that gpu_check.sh unpacks onto PYTHONPATH; and the default
#      model's tokenizer, which gpu_check.sh puts beside a random model of the default model's
#      shape where that model's package is not installed. Carry `.gpu-ray` too.
# GPU_PYTHON_VERSION picks the GPU machine's Python (default 3.12), GPU_GRPCIO_VERSION its grpcio
# (default 1.84.0). Carry `.gpu` (and
# `.gpu-against`, `.gpu-ray`) in the device call.
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
if [ -n "${GPU_RAY:-}" ]; then
  rm -rf .gpu-ray && mkdir -p .gpu-ray/tokenizer
  wheels=$(mktemp -d) site=$(mktemp -d)
  pins=$("$PY" -c 'import importlib.metadata as m
names = """ray jsonschema jsonschema-specifications referencing rpds-py opentelemetry-proto
opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus
opentelemetry-semantic-conventions mmh3 aiohttp-cors fastapi opencensus
opencensus-context google-api-core googleapis-common-protos proto-plus google-auth pyasn1
pyasn1-modules smart-open starlette watchfiles uvicorn httptools websockets python-dotenv
colorful platformdirs sniffio""".split()
print(" ".join(f"{n}=={m.version(n)}" for n in names))')
  # grpcio-reflection's generated code refuses a grpcio older than itself: the image's grpcio
  pins="$pins grpcio-reflection==${GPU_GRPCIO_VERSION:-1.84.0}"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$wheels" \
    --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $pins
  for w in "$wheels"/*.whl; do unzip -q -o "$w" -d "$site"; done
  (cd "$site" && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/tune ray/train ray/data \
    ray/llm ray/serve/llm ray/util/dask ray/util/spark \
    && find . \( -name tests -o -name __pycache__ \) -type d -prune -exec rm -rf {} + \
    && tar -cJf - .) > .gpu-ray/ray_site.tar.xz
  rm -rf "$wheels" "$site"
  tok=$("$PY" -c 'from raydix.deploy.config import AppConfig, resolve_model_path
print(resolve_model_path(AppConfig()))')
  for name in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    if [ -f "$tok/$name" ]; then cp "$tok/$name" .gpu-ray/tokenizer/; fi
  done
  du -sh .gpu-ray
fi
ls .gpu
