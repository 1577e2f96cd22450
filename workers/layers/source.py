"""A checkpoint tensor that is read lazily, one slice at a time."""

from __future__ import annotations

from typing import Protocol

import torch


class _SafeSlice(Protocol):
    """What `safetensors.safe_open(...).get_slice(name)` returns."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class CheckpointTensor:
    """A full checkpoint tensor; `narrow` reads only the part a shard needs.

    Wraps either a safetensors slice (nothing is read until `narrow` / `read`) or an in-memory
    tensor (tests, converted checkpoints).
    """

    def __init__(self, source: _SafeSlice | torch.Tensor) -> None:
        self._source = source
        if isinstance(source, torch.Tensor):
            self.shape = tuple(source.shape)
        else:
            self.shape = tuple(source.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) is out of range for dim {dim} "
                             f"of a tensor of shape {self.shape}")
        if isinstance(self._source, torch.Tensor):
            return self._source.narrow(dim, start, length)
        index = tuple(slice(start, start + length) if d == dim else slice(None)
                      for d in range(len(self.shape)))
        return self._source[index]

    def read(self) -> torch.Tensor:
        if isinstance(self._source, torch.Tensor):
            return self._source
        return self._source[tuple(slice(None) for _ in self.shape)]


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    """Copy `loaded` into `param`, failing with both shapes named when they differ."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch loading {name or 'a weight'}: parameter "
                         f"{tuple(param.shape)} vs checkpoint shard {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)
