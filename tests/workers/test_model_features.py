"""Every architecture and feature beyond plain Llama gives transformers' greedy tokens
(float32): biases, activations, sliding windows (every layer and per layer), Gemma's norms,
soft caps and scales, Phi-3's fused weights and partial longrope, and each rope scaling type.

Prompts are longer than the windows and, with the new tokens, run past the rope scaling's
original length; each case runs whole, chunked and prefix-reuse scenarios at page sizes 1
and 16 (TP=1), and every feature once at TP=2.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .conftest import FEATURE_CONFIGS, TinyModel
from .reference import HFReference, assert_greedy_equal
from .test_model_equality import _tp1, _tp1_logits
from .tp_group import SpawnedTPGroup, TPCase

MAX_NEW_TOKENS = 12
MODES = ("whole", "chunked", "prefix")
Models = Callable[[str], TinyModel]
_REFS: dict[str, list[list[int]]] = {}


def _ref(m: TinyModel) -> list[list[int]]:
    if m.name not in _REFS:
        _REFS[m.name] = m.hf.greedy(m.prompts, MAX_NEW_TOKENS)
    return _REFS[m.name]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", sorted(FEATURE_CONFIGS))
def test_tp1_matches_transformers(feature_models: Models, name: str, page_size: int) -> None:
    m = feature_models(name)
    ref = _ref(m)
    result, worker = _tp1(TPCase(str(m.folder), m.prompts, MAX_NEW_TOKENS, MODES,
                                 page_size=page_size))
    for mode in MODES:
        assert_greedy_equal(result.outputs[mode], ref, m.prompts, m.hf, _tp1_logits(worker),
                            f"{name} page={page_size} {mode}")


@pytest.mark.parametrize("name", ["llama_bias", "mistral", "qwen2_swa", "gemma", "gemma2",
                                  "gemma3", "phi3", "llama_yarn"])
def test_tp2_matches_transformers(feature_models: Models, tp2_group: SpawnedTPGroup,
                                  name: str) -> None:
    m = feature_models(name)
    ref = _ref(m)
    tp2 = tp2_group.run(TPCase(str(m.folder), m.prompts, MAX_NEW_TOKENS, MODES))
    for mode in MODES:
        assert_greedy_equal(tp2.outputs[mode], ref, m.prompts, m.hf,
                            lambda s: tp2_group.run(TPCase(str(m.folder), [], 0, (), s))
                            .probe_logits, f"{name} tp=2 {mode}")


@pytest.mark.parametrize("name", ["llama_dynamic", "phi3"])
def test_prompts_past_the_original_length_rotate_per_position(feature_models: Models,
                                                              name: str) -> None:
    """Dynamic and longrope past the original length (32, Phi-3's 64): each position is
    rotated as transformers rotates it when fed one token at a time, whole or chunked.
    (Phi-3's own `generate` instead drops its cache and recomputes the whole sequence with the
    long factors when it first crosses the length; a prefix cache cannot do that.)"""
    m = feature_models(name)
    prompts = [m.prompts[1] + m.prompts[0] + m.prompts[0], m.prompts[2]]  # 86 and 5 tokens
    ref = m.hf.greedy_stepwise(prompts, 6)
    result, worker = _tp1(TPCase(str(m.folder), prompts, 6, ("whole", "chunked")))
    for mode in ("whole", "chunked"):
        assert_greedy_equal(result.outputs[mode], ref, prompts, m.hf, _tp1_logits(worker),
                            f"{name} {mode}")


def test_windows_change_the_output(feature_models: Models) -> None:
    """The window cases can fail: without its window, Mistral's tokens differ."""
    m = feature_models("mistral")
    full = HFReference(m.folder)
    full.model.config.sliding_window = None
    assert full.greedy(m.prompts, MAX_NEW_TOKENS) != _ref(m)
