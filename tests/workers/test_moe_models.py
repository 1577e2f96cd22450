"""Mixture-of-experts and latent-attention models give transformers' greedy tokens (float32):
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 (no q bottleneck, group-limited softmax routing)
and DeepSeek-V3 (`q_lora_rank`, sigmoid routing with correction bias, grouped top-k, yarn).

Each runs whole, chunked and prefix-reuse scenarios at page sizes 1 and 16 (TP=1), and each
family once at TP=2, where every expert's intermediate dimension and the attention heads are
split but the latent pool is not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from raydix.workers.config import ModelConfig

from .conftest import TinyModel
from .moe_models import MOE_CONFIGS, save_moe_model
from .reference import HFReference, assert_greedy_equal
from .test_model_equality import _tp1, _tp1_logits
from .tp_group import SpawnedTPGroup, TPCase

MAX_NEW_TOKENS = 12
MODES = ("whole", "chunked", "prefix")
Models = Callable[[str], TinyModel]
_REFS: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("moe")
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 250, (18,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 250, (5,), generator=gen).tolist(),
               shared + torch.randint(3, 250, (9,), generator=gen).tolist(),
               shared[:3] + torch.randint(3, 250, (2,), generator=gen).tolist()]
    built: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in built:
            save_moe_model(name, root / name)
            built[name] = TinyModel(name, root / name, HFReference(root / name), prompts)
        return built[name]

    return get


def _ref(m: TinyModel) -> list[list[int]]:
    if m.name not in _REFS:
        _REFS[m.name] = m.hf.greedy(m.prompts, MAX_NEW_TOKENS)
    return _REFS[m.name]


def _latent_bytes(folder: Path, num_slots: int) -> int:
    mc = ModelConfig.from_folder(folder)
    assert mc.mla is not None
    return num_slots * (mc.mla.kv_lora_rank + mc.mla.qk_rope_head_dim) * mc.num_layers * 4


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_tp1_matches_transformers(moe_models: Models, name: str, page_size: int) -> None:
    m = moe_models(name)
    ref = _ref(m)
    result, worker = _tp1(TPCase(str(m.folder), m.prompts, MAX_NEW_TOKENS, MODES,
                                 page_size=page_size))
    for mode in MODES:
        assert_greedy_equal(result.outputs[mode], ref, m.prompts, m.hf, _tp1_logits(worker),
                            f"{name} page={page_size} {mode}")
    if page_size == 1:  # the logits agree too, not only their argmax
        seqs = [p + r[:5] for p, r in zip(m.prompts, ref, strict=True)]
        for ours, theirs in zip(_tp1_logits(worker)(seqs), m.hf.last_logits(seqs), strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    if name.startswith("deepseek"):  # one latent of kv_lora_rank + qk_rope_head_dim = 24
        num_slots = 4096 + page_size
        assert result.shard_shapes["kv_pool"] == (num_slots, 1, 24)
        assert result.shard_shapes["kv_pool_bytes"] == (_latent_bytes(m.folder, num_slots),)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_tp2_matches_transformers(moe_models: Models, tp2_group: SpawnedTPGroup,
                                  name: str) -> None:
    m = moe_models(name)
    ref = _ref(m)
    page_size = 16 if name == "deepseek_v3" else 1
    tp2 = tp2_group.run(TPCase(str(m.folder), m.prompts, MAX_NEW_TOKENS, MODES,
                               page_size=page_size))
    for mode in MODES:
        assert_greedy_equal(tp2.outputs[mode], ref, m.prompts, m.hf,
                            lambda s: tp2_group.run(TPCase(str(m.folder), [], 0, (), s))
                            .probe_logits, f"{name} tp=2 {mode}")
    shapes = tp2.shard_shapes
    # rank 0 holds half of every expert's intermediate dimension: gate and up rows, down columns
    size = 96 if name == "mixtral" else 32
    layer = 0 if name == "mixtral" else 1  # layer 0 is dense in the others
    expert = f"model.layers.{layer}.mlp.experts.0"
    assert shapes[f"{expert}.gate_up_proj.weight"] == (2 * size // 2, 64)
    assert shapes[f"{expert}.down_proj.weight"] == (64, size // 2)
    if name.startswith("deepseek"):  # two of four heads, but the whole latent
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 2 * 12)
        num_slots = 4096 + page_size
        assert shapes["kv_pool"] == (num_slots, 1, 24)
        assert tp2.pool_bytes_per_rank == [_latent_bytes(m.folder, num_slots)] * 2  # every rank
