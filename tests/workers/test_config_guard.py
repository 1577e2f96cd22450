"""The config guard: every field transformers' config class defines for a supported architecture
is read by our parser, inert for inference, or refused when it leaves its default, by name."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import transformers

from raydix.workers.config import ModelConfig
from raydix.workers.models.config_fields import INERT
from raydix.workers.models.registry import ARCHITECTURES, read_config, supported_table

README = Path(__file__).resolve().parents[2] / "README.md"

# fields no parser reads: the guard accepts only their default (a new transformers field lands
# here first, and fails this test until it is implemented, declared inert or listed)
DEFAULT_ONLY = {"is_encoder_decoder": True}


def _raw(arch: str, **fields: object) -> dict[str, object]:
    cls = getattr(transformers, ARCHITECTURES[arch].config_class)
    raw = cls(num_hidden_layers=2, **fields).to_dict()
    raw["architectures"] = [arch]
    return raw


def _class_fields(arch: str) -> set[str]:
    cls = getattr(transformers, ARCHITECTURES[arch].config_class)
    return {f.name for f in dataclasses.fields(cls)} | set(cls().to_dict())


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_field_is_read_inert_or_refused(arch: str) -> None:
    _, fields = read_config(_raw(arch))
    left = _class_fields(arch) - fields.taken - INERT
    assert left == set(DEFAULT_ONLY), (
        f"{arch}: fields {sorted(left - set(DEFAULT_ONLY))} of "
        f"{ARCHITECTURES[arch].config_class} are neither read nor declared inert")
    for name, value in DEFAULT_ONLY.items():
        raw = _raw(arch)
        raw[name] = value
        with pytest.raises(ValueError, match=f"{name}={value!r}"):
            ModelConfig.from_dict(raw)


@pytest.mark.parametrize(("arch", "field", "value", "message"), [
    ("LlamaForCausalLM", "hidden_act", "relu", "supported activations"),
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "proportional", "factor": 2.0,
                                             "rope_theta": 1e4}, "rope_type 'proportional'"),
    ("LlamaForCausalLM", "rope_parameters", {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 1e4, "mrope_section": [1, 2]},
     "mrope_section"),
    ("LlamaForCausalLM", "quantization_config", {"quant_method": "fp8"}, "unquantized"),
    ("Qwen2ForCausalLM", "layer_types", ["full_attention", "chunked_attention"],
     "supported layer types"),
    ("GemmaForCausalLM", "use_bidirectional_attention", True, "causal decoders only"),
    ("Gemma2ForCausalLM", "hidden_activation", "gelu_fast", "supported activations"),
    ("Gemma3ForCausalLM", "attn_logit_softcapping", -1.0, "soft cap"),
])
def test_refusals_name_the_field_and_value(arch: str, field: str, value: object,
                                           message: str) -> None:
    raw = _raw(arch)
    raw[field] = value
    with pytest.raises(ValueError, match=re.escape(f"{field}=")) as err:
        ModelConfig.from_dict(raw)
    assert message in str(err.value) and arch in str(err.value)


def test_unsupported_architecture_and_unknown_keys(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    raw = _raw("MistralForCausalLM")
    raw["my_custom_key"] = 3
    with caplog.at_level(logging.WARNING):
        ModelConfig.from_dict(raw)
    assert "my_custom_key" in caplog.text


def test_fields_reach_the_model_config() -> None:
    """What the architectures imply beyond field names: Qwen2's q/k/v bias without o bias,
    Mistral's window on every layer, Qwen2's windows above max_window_layers, Gemma 2's
    alternating windows and scale, Gemma 3's two ropes, Phi-3's longrope resolution."""
    qwen2 = ModelConfig.from_dict(_raw("Qwen2ForCausalLM", use_sliding_window=True,
                                       sliding_window=8, max_window_layers=1))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.layer_windows) == (True, False, (0, 8))
    llama = ModelConfig.from_dict(_raw("LlamaForCausalLM", attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    mistral = ModelConfig.from_dict(_raw("MistralForCausalLM", sliding_window=5))
    assert mistral.layer_windows == (5, 5)
    assert ModelConfig.from_dict(_raw("MistralForCausalLM", sliding_window=None)
                                 ).layer_windows == (0, 0)
    gemma2 = ModelConfig.from_dict(_raw("Gemma2ForCausalLM", sliding_window=6,
                                        query_pre_attn_scalar=64))
    assert gemma2.layer_windows == (6, 0) and gemma2.attn_scale == 64 ** -0.5
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    legacy = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "num_hidden_layers": 4, "sliding_window_pattern": 2, "sliding_window": 3,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    gemma3 = ModelConfig.from_dict(legacy)
    assert gemma3.layer_windows == (3, 0, 3, 0) and gemma3.qk_norm
    assert (gemma3.rope.rope_type, gemma3.rope.factor, gemma3.rope.theta) == ("linear", 8.0, 1e6)
    assert gemma3.local_rope is not None and gemma3.local_rope.theta == 1e4
    assert gemma3.layer_rope(0) is gemma3.local_rope and gemma3.layer_rope(1) is gemma3.rope
    phi3 = ModelConfig.from_dict(_raw(
        "Phi3ForCausalLM", max_position_embeddings=256, original_max_position_embeddings=64,
        hidden_size=64, num_attention_heads=4,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                         "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    assert phi3.rope.factor == 4.0 and phi3.rope.original_max_position_embeddings == 64
    assert phi3.rope.attention_factor == pytest.approx((1 + 1.3862943611 / 4.158883083) ** 0.5)


def test_readme_table_is_the_registry() -> None:
    assert supported_table() in README.read_text(), (
        "README's table of supported architectures differs from the registry; paste the "
        "output of `python -c 'from raydix.workers.models import supported_table as t; "
        "print(t())'` into README.md")
