"""Keep freed host memory in the process heap, so a CPU forward does not page-fault.

glibc's malloc serves a large block (above `M_MMAP_THRESHOLD`, dynamically a few MiB) with a
fresh `mmap` and gives it back with `munmap` when freed, and trims the heap top past
`M_TRIM_THRESHOLD`. A CPU forward frees and re-allocates the same large activations every
layer (a 2048-token prefill of SmolLM2-135M: 25 MB per MLP activation), so every layer touched
fresh pages: 370,000 minor page faults per 2048-token prefill, about 15% of its time. Raising
both thresholds keeps those blocks in the heap, where the next layer reuses them.

This is a process-wide setting of the C library; a CPU worker makes it once at start-up. On a
system without glibc it does nothing.

The KV pool is the opposite case: one large block, allocated once, of which a request touches
only its own slots. `zeroed` maps it from the kernel's zero pages instead of writing zeros into
heap memory (`torch.zeros`): the pool of `raydix serve` on CPU (1.2 GB) took 0.3-3.2 s of the
engine replica's start to fill, and now costs a page fault per 4 KiB when a slot is first written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30  # freed heap kept for reuse before it goes back to the OS


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True when both were set."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    logger.debug("glibc malloc keeps freed blocks below %d bytes: %s", MMAP_THRESHOLD_BYTES, done)
    return done


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor on its own private anonymous mapping (page-aligned): the
    kernel supplies each page, zeroed, when it is first touched, so nothing is written now."""
    num_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    block = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(block, dtype=dtype).view(shape)  # the tensor keeps `block` mapped
