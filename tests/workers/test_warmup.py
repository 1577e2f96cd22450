"""Warm-up: the runner runs a prefill and a decode before it is ready, on the padding page."""

from __future__ import annotations

import pytest
import torch

from raydix.workers.attention.torch_backend import TorchAttentionBackend
from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner
from raydix.workers.warmup import WARM_UP_TOKENS

from .conftest import TinyModel


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    seen: list[tuple[bool, int]] = []
    prepare = TorchAttentionBackend.prepare

    def spy(self: TorchAttentionBackend, batch: object) -> None:
        seen.append((batch.is_decode, batch.num_tokens))  # type: ignore[attr-defined]
        prepare(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchAttentionBackend, "prepare", spy)
    return seen


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_and_decode_run_before_ready(tiny_models: dict[str, TinyModel],
                                             monkeypatch: pytest.MonkeyPatch,
                                             page_size: int) -> None:
    seen = _spy(monkeypatch)
    runner = ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), page_size=page_size,
                                      max_total_tokens=64))
    assert seen == [(False, WARM_UP_TOKENS), (True, 1)]
    assert runner.warm_up is not None and runner.warm_up.phases == ("prefill", "decode")
    # only the padding page was written; no row of the table was taken
    pool = runner.kv_pool
    for buffers in (pool.k_buffers, pool.v_buffers):
        for layer in buffers:
            assert not layer[page_size:].any()
            assert layer[0].any()  # the warm-up really wrote its K/V (to slot 0)
    assert not runner.req_to_token.any()


def test_warm_up_can_be_off(tiny_models: dict[str, TinyModel],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    runner = ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), warm_up=False,
                                      max_total_tokens=64))
    assert seen == [] and runner.warm_up is None


def test_refuses_a_used_row(tiny_models: dict[str, TinyModel]) -> None:
    from raydix.workers.warmup import warm_up

    runner = ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), warm_up=False,
                                      max_total_tokens=64))
    runner.req_to_token[0, 0] = 5
    with pytest.raises(RuntimeError, match="row 0"):
        warm_up(runner.model, runner.backend, runner.req_to_token, torch.device("cpu"))
