"""Shared fixtures: tiny random models saved as safetensors, the default model converted once,
and one spawned 2-rank gloo group reused by every TP=2 test."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from raydix.workers.gguf_convert import convert_gguf, find_packaged_gguf

from .reference import HFReference
from .tp_group import SpawnedTPGroup

TINY = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, initializer_range=0.15,
            rms_norm_eps=1e-6)


def _tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    if kind == "llama":  # GQA 4:2, tied embeddings, Llama-3 rope scaling, odd vocab (250)
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2,
                                            tie_word_embeddings=True, rope_parameters=rope))
    if kind == "qwen2":  # q/k/v bias, one KV head (replicated at TP=2)
        return Qwen2ForCausalLM(Qwen2Config(**TINY, num_key_value_heads=1,
                                            tie_word_embeddings=False))
    if kind == "qwen3":  # q/k RMSNorm, explicit head_dim
        return Qwen3ForCausalLM(Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32,
                                            tie_word_embeddings=False))
    raise ValueError(kind)


@dataclass
class TinyModel:
    name: str
    folder: Path
    hf: HFReference
    prompts: list[list[int]]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("tiny")
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 250, (6,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 250, (5,), generator=gen).tolist(),
               shared + torch.randint(3, 250, (9,), generator=gen).tolist(),
               shared[:3] + torch.randint(3, 250, (2,), generator=gen).tolist()]
    models = {}
    for kind in ("llama", "qwen2", "qwen3"):
        folder = root / kind
        # qwen2 is saved in several safetensors shards, to load through more than one file
        shard = "40KB" if kind == "qwen2" else "1GB"
        _tiny(kind).save_pretrained(folder, safe_serialization=True, max_shard_size=shard)
        models[kind] = TinyModel(kind, folder, HFReference(folder), prompts)
    return models


@dataclass
class DefaultModel:
    folder: Path
    gguf: Path
    hf: HFReference
    prompts: list[list[int]]
    tokenizer: object


DEFAULT_PROMPTS = ["The capital of France is", "The capital of France is a city where",
                   "Water boils at a temperature of"]


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> DefaultModel:
    """SmolLM2-135M-Instruct, converted from its GGUF into a per-session cache folder."""
    gguf = find_packaged_gguf()
    folder = convert_gguf(gguf, tmp_path_factory.mktemp("raydix-cache"), show_progress=False)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(p).input_ids for p in DEFAULT_PROMPTS]
    return DefaultModel(folder, gguf, HFReference(folder), prompts, tok)


@pytest.fixture(scope="session")
def tp2_group() -> Iterator[SpawnedTPGroup]:
    group = SpawnedTPGroup(tp_size=2)
    yield group
    group.close()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread in the test process: the machine has 2 cores, the spawned TP ranks
    take one each, and OpenMP threads that wait on a busy core stall every matmul."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
