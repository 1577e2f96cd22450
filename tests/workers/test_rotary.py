"""Our rope frequencies and attention factors equal transformers' ROPE_INIT_FUNCTIONS for every
supported scaling type, read from the same config."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from raydix.workers.config import ModelConfig
from raydix.workers.layers.rotary import rope_angles, rope_inv_freq

_BASE = dict(hidden_size=128, num_attention_heads=2, num_hidden_layers=1,
             max_position_embeddings=4096)
CASES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16},
    "yarn_mscale": {"factor": 40.0, "original_max_position_embeddings": 512, "mscale": 1.0,
                    "mscale_all_dim": 0.707},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
}


def _configs(case: str) -> tuple[LlamaConfig, ModelConfig]:
    rope_type = case.split("_")[0]
    params = dict(CASES[case], rope_type=rope_type, rope_theta=50000.0)
    hf = LlamaConfig(**_BASE, rope_parameters=params)
    raw = hf.to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    return hf, ModelConfig.from_dict(raw)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seq_len", [100, 5000])
def test_inv_freq_and_attention_factor(case: str, seq_len: int) -> None:
    hf, ours = _configs(case)
    rope_type = ours.rope.rope_type
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=seq_len)
    torch.testing.assert_close(rope_inv_freq(64, ours.rope, seq_len), inv_freq.float(),
                               rtol=1e-6, atol=0)
    assert ours.rope.attention_factor == pytest.approx(factor)


def test_dynamic_rotates_each_position_at_its_own_length() -> None:
    hf, ours = _configs("dynamic")
    angles = rope_angles(64, ours.rope, 6000)
    for pos in (10, 4095, 4096, 5999):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=pos + 1)
        torch.testing.assert_close(angles[pos], pos * inv_freq.float(), rtol=1e-5, atol=1e-4)


def test_longrope_switches_at_the_original_length() -> None:
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "short_factor": [1.0 + i / 10 for i in range(16)],
              "long_factor": [2.0 + i for i in range(16)]}
    hf = Phi3Config(hidden_size=128, num_attention_heads=2, num_hidden_layers=1,
                    max_position_embeddings=8192, original_max_position_embeddings=1024,
                    pad_token_id=0, rope_parameters=params)
    raw = hf.to_dict()
    raw["architectures"] = ["Phi3ForCausalLM"]
    ours = ModelConfig.from_dict(raw)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=1024)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=1025)
    assert ours.rope.attention_factor == pytest.approx(factor) and factor > 1
    angles = rope_angles(64, ours.rope, 2048)
    assert angles.shape == (2048, 16)
    torch.testing.assert_close(angles[1023], 1023 * short, rtol=1e-6, atol=0)
    torch.testing.assert_close(angles[1024], 1024 * long, rtol=1e-6, atol=0)
