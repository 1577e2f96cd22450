"""The torch backend names its SDPA kernels: torch, left to choose, picks cuDNN attention on
recent GPUs, whose first call for each new prompt length builds a plan (~45 ms on an H100).
The kernel list applies on every device, so a CPU run sees the flags a GPU run would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydix.workers.config import WorkerConfig
from raydix.workers.runner import ModelRunner

from .conftest import TinyModel


def test_extend_attention_never_lets_torch_pick_cudnn(tiny_models: dict[str, TinyModel],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default: cuDNN may be picked
    flags: list[tuple[bool, bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        cuda = torch.backends.cuda
        flags.append((cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(),
                      cuda.mem_efficient_sdp_enabled()))
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ModelRunner(WorkerConfig(str(tiny_models["llama"].folder), max_total_tokens=64))  # warm-up
    assert flags, "the warm-up's prefill ran no extend attention"
    assert all(f == (False, True, True) for f in flags), flags  # flash or memory-efficient
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the step
