"""Loading shows a progress bar on the driving rank only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raydix.workers.config import ModelConfig
from raydix.workers.loader import load_model
from raydix.workers.parallel import SINGLE_RANK


def test_rank0_shows_a_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    model_config = ModelConfig.from_folder(tmp_path)
    load_model(tmp_path, model_config, SINGLE_RANK, torch.float32, "cpu")
    err = capsys.readouterr().err
    assert f"loading {tmp_path.name}" in err and "100%" in err
    load_model(tmp_path, model_config, SINGLE_RANK, torch.float32, "cpu", show_progress=False)
    assert "loading" not in capsys.readouterr().err
