"""Host -> device copies of a step's small index arrays through a ring of pinned buffers.

Each array is written into the next free bytes of the current pinned buffer and copied from
there with a non-blocking copy; the buffer's event is recorded after every copy from it. When a
buffer is full the ring moves on to the next one, and waits for that buffer's event first: its
last copy must have run before the host writes over the bytes it reads. Without that wait, a
host running a step ahead of the device (the overlapped loop) would overwrite the input of a
copy still queued and the device would read the later step's indices. With four 1 MiB buffers a
decode step's few kilobytes fill one in tens of steps, so the wait has long been satisfied.

No pinned memory is allocated per step (torch's `pin_memory()` takes a block from its caching
host allocator on every call); an array larger than a buffer still goes that way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

Copy = Callable[[torch.Tensor, torch.Tensor], None]
ALIGN = 64  # bytes: every dtype's view of a chunk starts aligned


class _Event:
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


def _device_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class PinnedStaging:
    """`to_device(arr)`: a device tensor holding `arr`, its copy queued on the current stream.
    `pinned`, `event` and `copy` are the CUDA defaults; tests give stand-ins."""

    def __init__(self, device: torch.device, num_buffers: int = 4, capacity: int = 1 << 20,
                 pinned: bool = True, event: Callable[[], _Event] | None = None,
                 copy: Copy = _device_copy) -> None:
        self.device = device
        self.capacity = capacity
        self.buffers = [torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
                        for _ in range(num_buffers)]
        self._host = [b.numpy() for b in self.buffers]
        make_event = event or (lambda: torch.cuda.Event())  # type: ignore[return-value]
        self.events = [make_event() for _ in range(num_buffers)]
        self.copy = copy
        self.index, self.offset = 0, 0
        self.oversize = 0  # arrays too large for a buffer (copied through pin_memory())
        self._lock = threading.Lock()

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        dtype = torch.from_numpy(arr[:0]).dtype
        dst = torch.empty(arr.shape, dtype=dtype, device=self.device)
        n = arr.nbytes
        if n == 0:
            return dst
        if n > self.capacity:
            self.oversize += 1
            self.copy(dst, torch.from_numpy(arr).pin_memory())
            return dst
        with self._lock:
            start = -(-self.offset // ALIGN) * ALIGN
            if start + n > self.capacity:
                self.index = (self.index + 1) % len(self.buffers)
                self.events[self.index].synchronize()  # its last copy has read its bytes
                start = 0
            self._host[self.index][start: start + n] = arr.reshape(-1).view(np.uint8)
            src = self.buffers[self.index][start: start + n].view(dtype).view(arr.shape)
            self.copy(dst, src)
            self.events[self.index].record()
            self.offset = start + n
        return dst


_RINGS: dict[torch.device, PinnedStaging] = {}
_RINGS_LOCK = threading.Lock()


def staging_for(device: torch.device) -> PinnedStaging:
    """The process's ring for a CUDA device, made on first use."""
    with _RINGS_LOCK:
        if device not in _RINGS:
            _RINGS[device] = PinnedStaging(device)
        return _RINGS[device]
