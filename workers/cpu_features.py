"""What the host CPU computes in hardware, read from torch (functions, so that tests can take
either path): the paths that pay on one CPU lose on another (`graph_head.layers_packed`,
`attention/block_causal.blocks_faster`, `layers/packed.native_bf16`)."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger(__name__)

# Linux's arch_prctl on x86-64: ask for a state component (here the AMX tiles' data, 18)
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def native_bf16() -> bool:
    """The CPU computes bf16 dot products in hardware (AVX-512-BF16 or AMX tiles)."""
    return bool(avx512_bf16() or torch.cpu._is_amx_tile_supported())


@functools.cache
def avx512() -> bool:
    """The CPU has AVX-512 (F, BW, VL, DQ as torch checks them): 16-float vectors."""
    return bool(torch.cpu._is_avx512_supported())


@functools.cache
def avx512_bf16() -> bool:
    """The CPU has AVX-512-BF16: dot products of bf16 pairs into float32 lanes."""
    return bool(torch.cpu._is_avx512_bf16_supported())


def amx_tiles() -> bool:
    """The CPU has AMX tiles: oneDNN's bf16 products, and torch's CPU flash-attention kernel in
    bf16, run on them."""
    return bool(torch.cpu._is_amx_tile_supported())


@functools.cache
def amx_granted() -> bool:
    """The CPU has AMX tiles and Linux lets this process use them: it hands out the tiles'
    state only when a process asks (oneDNN asks before its own tile products; the project's C
    kernels on the tiles ask here). Asked once; False, logged, where refused."""
    if not amx_tiles():
        return False
    try:
        granted = ctypes.CDLL(None, use_errno=True).syscall(
            _SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError) as exc:  # no libc syscall here
        logger.warning("could not ask Linux for the AMX tiles: %s", exc)
        return False
    if not granted:
        logger.warning("Linux did not grant this process the AMX tiles (errno %d): the "
                       "kernels on the tiles stay off", ctypes.get_errno())
    return granted
