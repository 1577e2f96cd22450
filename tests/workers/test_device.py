"""Device handling for "cuda", "cuda:N" and a Ray-assigned GPU, on the CPU with a fake CUDA."""

from __future__ import annotations

import pytest
import torch

from raydix.workers import worker as worker_module
from raydix.workers.config import WorkerConfig
from raydix.workers.device import bind_device, resolve_device
from raydix.workers.worker import TPWorker

from ..fake_cuda import install


def test_cpu_needs_no_cuda() -> None:
    assert bind_device("cpu") == torch.device("cpu")


def test_bare_cuda_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # inside a Ray actor with one GPU, CUDA_VISIBLE_DEVICES leaves it as index 0
    fake = install(monkeypatch, count=1)
    assert bind_device("cuda") == torch.device("cuda", 0)
    assert fake.set_calls == [0]
    fake = install(monkeypatch, count=4, current=2)
    assert resolve_device("cuda") == torch.device("cuda", 2)


def test_indexed_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(monkeypatch, count=2)
    assert bind_device("cuda:1") == torch.device("cuda", 1)
    assert fake.set_calls == [1] and fake.current == 1


@pytest.mark.parametrize("spec, problem", [("cuda:2", "sees 2 CUDA device"),
                                           ("tpu", "not a device torch knows"),
                                           ("meta", "'cpu' or 'cuda' only")])
def test_bad_devices_are_named(monkeypatch: pytest.MonkeyPatch, spec: str, problem: str) -> None:
    fake = install(monkeypatch, count=2)
    with pytest.raises(ValueError, match=problem):
        bind_device(spec)
    assert fake.set_calls == []


def test_cuda_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


class _Runner:
    """Stands in for the model runner: records the device it was bound on."""

    def __init__(self, config: WorkerConfig, group: object) -> None:
        self.bound_to = torch.cuda.current_device()
        self.max_num_tokens = 16


@pytest.mark.parametrize("spec, count, expected", [("cuda", 1, 0), ("cuda:1", 2, 1)])
def test_worker_binds_before_loading(monkeypatch: pytest.MonkeyPatch, spec: str, count: int,
                                     expected: int) -> None:
    """The start-up path of every GPU entry point (serve, Ray ranks, in-process engine)."""
    fake = install(monkeypatch, count=count)
    monkeypatch.setattr(worker_module, "ModelRunner", _Runner)
    worker = TPWorker(WorkerConfig("unused", device=spec))
    assert fake.set_calls == [expected]
    assert worker.runner.bound_to == expected  # type: ignore[attr-defined]
