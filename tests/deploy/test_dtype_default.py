"""`raydix serve`'s dtype default: `auto`, the fastest the CPU computes (workers/layers/packed.py
picks), while the in-process engine keeps fp32."""

from __future__ import annotations

from pathlib import Path

import torch

from raydix.deploy.cli import build_parser, load_config
from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.workers.config import WorkerConfig


def parse(*argv: str) -> AppConfig:
    return load_config(build_parser().parse_args(["serve", *argv]))


def test_the_server_dtype_defaults_to_auto(smollm2: Path) -> None:
    """`raydix serve` computes in the dtype the CPU runs fastest (bf16 where native and measured
    faster), as vLLM's CPU build defaults to bf16; an explicit dtype is kept, and the in-process
    engine's own default stays fp32, exact against transformers."""
    on_cpu = engine_config(AppConfig(model=str(smollm2)), str(smollm2), "cpu").worker
    assert on_cpu.dtype == "auto" and on_cpu.dtype_measured
    on_cuda = engine_config(AppConfig(model=str(smollm2)), str(smollm2), "cuda").worker
    assert on_cuda.dtype == "auto" and on_cuda.torch_dtype == torch.bfloat16
    pinned = engine_config(parse("--model", str(smollm2), "--dtype", "float32"), str(smollm2),
                           "cpu").worker
    assert pinned.dtype == "float32" and not pinned.dtype_measured
    assert WorkerConfig(str(smollm2)).torch_dtype == torch.float32
