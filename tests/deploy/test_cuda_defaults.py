"""On CUDA, serve's defaults are the fast path: flashinfer attention and CUDA-graph decode over
every batch the table allows; the CLI, the YAML and `serve run` can turn them down."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from raydix.deploy.app import check_attention_backend
from raydix.deploy.cli import ConfigError, build_parser, load_config
from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.workers import attention
from raydix.workers.config import WorkerConfig


def worker(config: AppConfig, folder: str, device: str) -> WorkerConfig:
    return engine_config(config, folder, device).worker


def parse(*argv: str) -> AppConfig:
    return load_config(build_parser().parse_args(["serve", *argv]))


def test_cuda_defaults_are_the_fast_path(model_folder: str) -> None:
    w = worker(AppConfig(), model_folder, "cuda")
    assert w.attention_backend == "flashinfer" and w.cuda_graph
    assert w.cuda_graph_plan == "once"  # a replay writes the page table, no flashinfer plan
    # graphs cover every decode batch the request table allows: no eager fallback past 32
    assert w.graph_max_batch == w.max_running_requests == 64
    assert w.max_prefill_tokens == 8192
    w = worker(AppConfig(max_running_requests=200), model_folder, "cuda")
    assert w.graph_max_batch == 200


def test_cpu_defaults(model_folder: str) -> None:
    w = worker(AppConfig(), model_folder, "cpu")
    assert w.attention_backend == "torch" and not w.cuda_graph and w.graph_max_batch == 0


def test_flags_yaml_and_serve_run_turn_graphs_down(model_folder: str, tmp_path: Path) -> None:
    assert not worker(parse("--disable-cuda-graph"), model_folder, "cuda").cuda_graph
    assert worker(parse("--cuda-graph-max-bs", "16"), model_folder, "cuda").graph_max_batch == 16
    assert worker(parse("--cuda-graph-plan", "every_step"), model_folder,
                  "cuda").cuda_graph_plan == "every_step"
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("disable_cuda_graph: true\nattention_backend: flashinfer\n")
    from_yaml = parse("--config", str(yaml))
    assert from_yaml.disable_cuda_graph and from_yaml.attention_backend == "flashinfer"
    # `serve run raydix.deploy.app:build_app cuda_graph_max_bs=8` passes strings
    from_serve_run = AppConfig.model_validate({"cuda_graph_max_bs": "8",
                                               "disable_cuda_graph": "false"})
    assert worker(from_serve_run, model_folder, "cuda").graph_max_batch == 8


def test_torch_backend_on_cuda_is_explicit(model_folder: str) -> None:
    w = worker(parse("--attention-backend", "torch"), model_folder, "cuda")
    assert w.attention_backend == "torch" and not w.cuda_graph


@pytest.mark.parametrize("argv, device, problem", [
    (("--attention-backend", "torch", "--cuda-graph-max-bs", "8"), "cuda", "cuda_graph_max_bs"),
    (("--disable-cuda-graph", "--cuda-graph-max-bs", "8"), "cuda", "disable_cuda_graph"),
    (("--cuda-graph-max-bs", "8"), "cpu", "cuda_graph_max_bs"),
    (("--attention-backend", "torch", "--cuda-graph-plan", "once"), "cuda", "cuda_graph_plan"),
    (("--disable-cuda-graph", "--cuda-graph-plan", "every_step"), "cuda", "disable_cuda_graph"),
])
def test_settings_that_cannot_be_honoured_are_refused(model_folder: str, argv: tuple[str, ...],
                                                      device: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        worker(parse(*argv), model_folder, device)


def test_bad_values_are_named() -> None:
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        parse("--cuda-graph-max-bs", "0")
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        parse("--device", "cpu", "--cuda-graph-max-bs", "8")
    with pytest.raises(ValidationError, match="attention_backend"):
        AppConfig.model_validate({"attention_backend": "xformers"})
    with pytest.raises(ConfigError, match="cuda_graph_plan"):
        parse("--cuda-graph-plan", "sometimes")
    with pytest.raises(ConfigError, match="cuda_graph_plan"):
        parse("--device", "cpu", "--cuda-graph-plan", "once")
    with pytest.raises(ValueError, match="cuda_graph_plan"):
        WorkerConfig("m", cuda_graph_plan="never")


def test_missing_flashinfer_on_a_cuda_host_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "flashinfer_installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'raydix\[cuda\]'.*--attention-backend torch"):
        check_attention_backend(AppConfig(), "cuda")
    check_attention_backend(AppConfig(attention_backend="torch"), "cuda")  # explicit: allowed
    check_attention_backend(AppConfig(), "cpu")  # auto on CPU is torch


def test_overlap_schedule_is_on_with_cuda(model_folder: str) -> None:
    def overlap(config: AppConfig, device: str) -> bool:
        return engine_config(config, model_folder, device).scheduler.overlap_schedule

    assert overlap(AppConfig(), "cuda") and not overlap(AppConfig(), "cpu")
    assert not overlap(parse("--overlap-schedule", "off"), "cuda")
    assert overlap(parse("--overlap-schedule", "on"), "cpu")
