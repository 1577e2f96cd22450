"""Shared fixtures: tiny random models saved as safetensors, the default model converted once,
and one spawned 2-rank gloo group reused by every TP=2 test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from raydix.workers.gguf_convert import find_packaged_gguf

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


# one tiny random model per architecture / feature, each with prompts longer than its window
# (5 or 6) and, with 12 new tokens, positions past the rope scaling's original length (32; for
# Phi-3's longrope 64, which only the stepwise test crosses: see test_model_features.py)
_KV2 = dict(TINY, num_key_value_heads=2)
_ROPE = {"rope_theta": 10000.0}
FEATURE_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "llama_bias": ("LlamaConfig", dict(_KV2, attention_bias=True, mlp_bias=True,
                                       hidden_act="gelu")),
    "llama_linear": ("LlamaConfig", dict(_KV2, rope_parameters=dict(
        _ROPE, rope_type="linear", factor=2.0))),
    "llama_dynamic": ("LlamaConfig", dict(_KV2, max_position_embeddings=32, rope_parameters=dict(
        _ROPE, rope_type="dynamic", factor=4.0))),
    "llama_yarn": ("LlamaConfig", dict(_KV2, max_position_embeddings=128, rope_parameters=dict(
        _ROPE, rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "llama_llama3": ("LlamaConfig", dict(_KV2, max_position_embeddings=128, rope_parameters=dict(
        _ROPE, rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", dict(_KV2, sliding_window=5)),
    "qwen2_swa": ("Qwen2Config", dict(_KV2, use_sliding_window=True, sliding_window=5,
                                      max_window_layers=1)),
    "gemma": ("GemmaConfig", dict(TINY, num_key_value_heads=1, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(_KV2, head_dim=16, sliding_window=5, query_pre_attn_scalar=8,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        _KV2, head_dim=16, sliding_window=5, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(_ROPE, rope_type="default"),
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6}})),
    "phi3": ("Phi3Config", dict(_KV2, max_position_embeddings=256,  # crossed in stepwise tests
                                original_max_position_embeddings=64, sliding_window=6,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                rope_parameters=dict(
                                    _ROPE, rope_type="longrope", partial_rotary_factor=0.5,
                                    short_factor=[1.0, 1.2, 1.5, 2.0],
                                    long_factor=[1.0, 2.0, 4.0, 8.0]))),
}


def _feature_model(name: str) -> torch.nn.Module:
    import transformers

    config_class, kwargs = FEATURE_CONFIGS[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers starts biases at 0 and Gemma's norms at 0: randomize
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="session")
def feature_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """Builds (once each, on first use) the tiny model of a `FEATURE_CONFIGS` entry."""
    root = tmp_path_factory.mktemp("features")
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 250, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 250, (8,), generator=gen).tolist(),
               shared + torch.randint(3, 250, (10,), generator=gen).tolist(),
               shared[:3] + torch.randint(3, 250, (2,), generator=gen).tolist()]
    built: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in built:
            folder = root / name
            _feature_model(name).save_pretrained(folder, safe_serialization=True)
            built[name] = TinyModel(name, folder, HFReference(folder), prompts)
        return built[name]

    return get


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
def default_model(smollm2: Path) -> DefaultModel:
    """SmolLM2-135M-Instruct, converted from its GGUF into a per-session cache folder (the
    `smollm2` folder of tests/conftest.py)."""
    gguf, folder = find_packaged_gguf(), smollm2
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


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CUDA tests: a small Llama whose head_dim (64) flashinfer has precompiled."""
    pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1)
    folder = tmp_path_factory.mktemp("gpu") / "llama"
    LlamaForCausalLM(config).save_pretrained(folder)  # head_dim 64: a flashinfer size
    return folder
