"""Linear layers on CPU through oneDNN, with each weight reordered once into oneDNN's layout.

`F.linear` on CPU calls MKL's sgemm on the plain `[out, in]` weight at every call. oneDNN's
matmul on a weight reordered once (the op torch's own CPU compiler uses after freezing) computes
the same product in fp32 with a blocked, cache-friendly weight: on SmolLM2-135M's shapes it is
15-20% faster for the layers and up to 60% for the LM head (measured one thread, AVX-512).

The plain weight stays the parameter (loading, TP sharding and tests see it); the packed copy
is derived from it by `pack_linear_layers` after loading, and is never written.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32,)  # the path measured and tested


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linear runs here: a CPU build with oneDNN and its linear ops."""
    return (
        device.type == "cpu"
        and dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` `[out, in]` in oneDNN's layout, tuned for about `batch_hint` rows of input."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T + b`, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_linear_layers(model: nn.Module, batch_hint: int) -> int:
    """Give every layer with a `packed_weight` slot its packed weight; returns how many.

    Call after the weights are loaded, and again if they ever change."""
    num_packed = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and isinstance(module.weight, torch.Tensor):
            module.packed_weight = pack_weight(module.weight, batch_hint)
            num_packed += 1
    logger.debug("packed %d linear weights for oneDNN (batch hint %d)", num_packed, batch_hint)
    return num_packed
