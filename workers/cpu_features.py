"""What the host CPU computes in hardware, read from torch (functions, so that tests can take
either path): the paths that pay on one CPU lose on another (`graph_head.layers_packed`,
`attention/block_causal.blocks_faster`, `layers/packed.native_bf16`)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16() -> bool:
    """The CPU computes bf16 dot products in hardware (AVX-512-BF16 or AMX tiles)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def amx_tiles() -> bool:
    """The CPU has AMX tiles: oneDNN's bf16 products, and torch's CPU flash-attention kernel in
    bf16, run on them."""
    return bool(torch.cpu._is_amx_tile_supported())
