"""The pinned staging ring (workers/staging.py) on the CPU, with a stand-in device stream that
runs copies late: a copy is queued when issued and runs only when an event recorded after it
is waited on (or at the end). Every staged tensor must still hold its array, however far the
host runs ahead; and no pinned memory is allocated per copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers.staging import PinnedStaging


class LateStream:
    """Copies and event records in issue order; a copy runs when a later event is waited on."""

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0
        self.waits = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append((dst, src))

    def run_until(self, mark: int) -> None:
        for dst, src in self.queue[self.done: mark]:
            dst.copy_(src)
        self.done = max(self.done, mark)

    def event(self) -> Event:
        return Event(self)


class Event:
    def __init__(self, stream: LateStream) -> None:
        self.stream, self.mark = stream, 0

    def record(self) -> None:
        self.mark = len(self.stream.queue)

    def synchronize(self) -> None:
        self.stream.waits += 1
        self.stream.run_until(self.mark)


def _ring(stream: LateStream, **kw: int) -> PinnedStaging:
    return PinnedStaging(torch.device("cpu"), pinned=False, event=stream.event, copy=stream.copy,
                         **kw)


def _arrays(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    out = []
    for i in range(n):
        size = int(rng.integers(1, 60))
        dtype = (np.int64, np.int32, np.float32)[i % 3]
        out.append(rng.integers(0, 1 << 30, size).astype(dtype))
    return out


def test_staged_tensors_hold_their_arrays_while_the_device_lags() -> None:
    stream = LateStream()
    ring = _ring(stream, num_buffers=3, capacity=1024)
    arrays = _arrays(np.random.default_rng(0), 400)  # the ring wraps many times
    staged = [ring.to_device(a) for a in arrays]
    stream.run_until(len(stream.queue))
    for a, t in zip(arrays, staged, strict=True):
        assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
        assert np.array_equal(t.numpy(), a)
    assert stream.waits > 3 * 10  # it wrapped, and waited each time it moved on


def test_a_ring_that_does_not_wait_is_caught() -> None:
    """The check above can fail: skip the wait, and a late copy reads a later array."""
    stream = LateStream()
    ring = _ring(stream, num_buffers=3, capacity=1024)
    ring.events = [type("NoWait", (), {"record": lambda s: None,
                                       "synchronize": lambda s: None})() for _ in range(3)]
    arrays = _arrays(np.random.default_rng(1), 200)
    staged = [ring.to_device(a) for a in arrays]
    stream.run_until(len(stream.queue))
    assert not all(np.array_equal(t.numpy(), a) for a, t in zip(arrays, staged, strict=True))


def test_no_pinned_allocation_per_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = LateStream()
    ring = _ring(stream, num_buffers=2, capacity=4096)
    pins = 0
    real_pin = torch.Tensor.pin_memory

    def counted(self: torch.Tensor, *a: object) -> torch.Tensor:
        nonlocal pins
        pins += 1
        return self.clone() if not torch.cuda.is_available() else real_pin(self)

    monkeypatch.setattr(torch.Tensor, "pin_memory", counted)
    for a in _arrays(np.random.default_rng(2), 300):
        ring.to_device(a)
    assert pins == 0 and ring.oversize == 0
    big = np.arange(1000, dtype=np.int64)  # 8 KB > capacity: the caching host allocator's way
    out = ring.to_device(big)
    stream.run_until(len(stream.queue))
    assert pins == 1 and ring.oversize == 1 and np.array_equal(out.numpy(), big)


def test_empty_and_multidimensional_arrays() -> None:
    stream = LateStream()
    ring = _ring(stream, capacity=256)
    empty = ring.to_device(np.zeros(0, np.int64))
    grid = np.arange(12, dtype=np.int32).reshape(3, 4)
    t = ring.to_device(grid)
    stream.run_until(len(stream.queue))
    assert empty.shape == (0,) and np.array_equal(t.numpy(), grid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ring_under_a_busy_stream() -> None:
    """The real thing: pinned buffers, CUDA events, copies queued behind device work."""
    ring = PinnedStaging(torch.device("cuda", torch.cuda.current_device()), num_buffers=2,
                         capacity=2048)
    arrays = _arrays(np.random.default_rng(3), 300)
    staged = []
    busy = torch.randn(2048, 2048, device="cuda")
    for i, a in enumerate(arrays):
        if i % 50 == 0:
            busy = busy @ busy / 2048  # keeps the stream behind the host
        staged.append(ring.to_device(a))
    torch.cuda.synchronize()
    for a, t in zip(arrays, staged, strict=True):
        assert np.array_equal(t.cpu().numpy(), a)
