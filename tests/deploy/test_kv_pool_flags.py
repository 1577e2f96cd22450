"""`--kv-pool double-sparse` and its settings reach the worker; it refuses flashinfer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydix.deploy.cli import build_parser, load_config
from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config


def test_double_sparse_flags_reach_the_worker(model_folder: str, tmp_path: Path) -> None:
    argv = ["serve", "--kv-pool", "double-sparse", "--ds-heavy-channel-num", "8",
            "--ds-heavy-token-num", "64", "--ds-sparse-decode-threshold", "512",
            "--ds-channel-config", str(tmp_path / "channels.json")]
    worker = engine_config(load_config(build_parser().parse_args(argv)), model_folder,
                           "cpu").worker
    assert (worker.kv_pool, worker.ds_heavy_channel_num, worker.ds_heavy_token_num,
            worker.ds_sparse_decode_threshold) == ("double-sparse", 8, 64, 512)
    assert worker.ds_channel_config == str(tmp_path / "channels.json")
    assert engine_config(AppConfig(), model_folder, "cpu").worker.kv_pool == "auto"


def test_kv_prefault_is_on_unless_turned_off(model_folder: str) -> None:
    assert engine_config(AppConfig(), model_folder, "cpu").worker.cpu_prefault_kv
    args = build_parser().parse_args(["serve", "--disable-kv-prefault"])
    assert not engine_config(load_config(args), model_folder, "cpu").worker.cpu_prefault_kv


def test_double_sparse_refuses_flashinfer(model_folder: str) -> None:
    with pytest.raises(ValueError, match="double-sparse needs attention_backend torch"):
        engine_config(AppConfig(kv_pool="double-sparse"), model_folder, "cuda")
    worker = engine_config(AppConfig(kv_pool="double-sparse", attention_backend="torch"),
                           model_folder, "cuda").worker
    assert worker.attention_backend == "torch" and not worker.cuda_graph


def test_latent_attention_models_take_the_torch_backend_on_cuda(tmp_path: Path) -> None:
    import transformers


    raw = transformers.DeepseekV3Config(num_hidden_layers=2).to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    worker = engine_config(AppConfig(), str(tmp_path), "cuda").worker
    assert worker.attention_backend == "torch" and not worker.cuda_graph
    with pytest.raises(ValueError, match=r"latent attention .* torch only, not flashinfer"):
        engine_config(AppConfig(attention_backend="flashinfer"), str(tmp_path), "cuda")
