"""Which device a rank computes on, and binding the process to it.

A rank's `WorkerConfig.device` is "cpu", "cuda" or "cuda:N":

- "cuda" means the process's current CUDA device. Inside a Ray actor that holds one GPU,
  `CUDA_VISIBLE_DEVICES` leaves exactly that GPU, as index 0, so "cuda" is it.
- "cuda:N" names a visible device; an index beyond the visible ones is refused by name.

`resolve_device` always returns a `torch.device` with an index for CUDA, so everything after it
(NCCL's binding, `torch.cuda.mem_get_info`, tensor placement) sees the same device.
"""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> torch.device:
    """The device `spec` names, with its CUDA index filled in. Raises ValueError naming the
    problem: an unknown device type, no CUDA, or an index that is not visible."""
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"device {spec!r} is not a device torch knows ('cpu', 'cuda', "
                         f"'cuda:N'): {e}") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"device {spec!r}: raydix runs on 'cpu' or 'cuda' only")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for, but CUDA is not available here "
                         "(no GPU visible to this process, or a CPU-only torch build)")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"device {spec!r}: this process sees {count} CUDA device(s) "
                         f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def bind_device(spec: str) -> torch.device:
    """Resolve `spec` and make it this process's current CUDA device (NCCL and every kernel
    launch without an explicit device use it). A no-op on the CPU."""
    device = resolve_device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
