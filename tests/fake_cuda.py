"""A fake CUDA runtime for CPU tests of device handling: `torch.cuda` answers as if `count`
devices were visible, and the real `torch.cuda.set_device` runs down to its native call, so its
argument checks (the index a bare "cuda" lacks) are exercised."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch


@dataclass
class FakeCuda:
    count: int = 1
    current: int = 0
    set_calls: list[int] = field(default_factory=list)

    def set_device(self, index: int) -> None:  # stands in for torch._C._cuda_setDevice
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.set_calls.append(index)
        self.current = index


def install(monkeypatch: pytest.MonkeyPatch, count: int = 1, current: int = 0) -> FakeCuda:
    fake = FakeCuda(count, current)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: fake.count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", fake.set_device, raising=False)
    return fake
