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

    def __init__(self, source: _SafeSlice | torch.Tensor, rows: tuple[int, int] | None = None
                 ) -> None:
        self._source = source
        if isinstance(source, torch.Tensor):
            self.shape = tuple(source.shape)
        else:
            self.shape = tuple(source.get_shape())
        self._row_start = 0
        if rows is not None:  # a run of rows of a fused tensor (see `part`)
            self._row_start = rows[0]
            self.shape = (rows[1], *self.shape[1:])

    def part(self, start: int, length: int) -> CheckpointTensor:
        """Rows [start, start + length) of this tensor, still read lazily."""
        if start < 0 or start + length > self.shape[0]:
            raise ValueError(f"rows [{start}, {start + length}) are out of range for a tensor "
                             f"of shape {self.shape}")
        return CheckpointTensor(self._source, (self._row_start + start, length))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) is out of range for dim {dim} "
                             f"of a tensor of shape {self.shape}")
        index = [slice(None)] * len(self.shape)
        index[0] = slice(self._row_start, self._row_start + self.shape[0])
        if dim == 0:
            start += self._row_start
        index[dim] = slice(start, start + length)
        return self._source[tuple(index)]

    def read(self) -> torch.Tensor:
        if not self.shape:
            return self._source[()]
        return self.narrow(0, 0, self.shape[0])


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    """Copy `loaded` into `param`, failing with both shapes named when they differ."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch loading {name or 'a weight'}: parameter "
                         f"{tuple(param.shape)} vs checkpoint shard {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)
