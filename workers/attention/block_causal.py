"""Causal attention of one extend (a prompt, or a chunk of one after its prefix) on CPU in bf16,
as row blocks of matrix products: a block of query rows attends to the keys up to its last row,
so the products skip most of the masked half, and only the block's own diagonal is masked.

torch's CPU flash-attention kernel runs a 512-token prompt's attention at about 70 GF/s on two
Zen 4 cores (9 query heads, 3 KV heads of 64), a sixth of what the same cores reach in the bf16
linear layers; it was 29% of a lone 512-token prefill of SmolLM2-135M. Per block here: one
batched product for the scores of every query head of a KV head against that head's keys (no
K/V expansion), a softmax (bf16 in and out, float32 inside, as transformers' eager bf16
attention), one product with the values. `benchmarks/attention_bench.py` (two threads, 9/3
heads of 64, two runs, blocks / flash time): 512 new tokens 2.2-2.3 against 4.3 ms (0.52-0.53),
1,024 0.59-0.60, 256 0.73-0.74, 512 after a 512-token prefix 0.52-0.53, 512 after 1,024
0.57-0.58, 64 after 512 0.61-0.63, 64 after 2,048 0.50-0.52; a lone 64-token prompt 1.28-1.48
(so a few keys stay with the flash kernel, `MIN_KEYS`).

On a CPU with AMX tiles it is the other way round: torch's kernel runs its bf16 products on the
tiles, and the same bench on two cores of an AMX Xeon gives blocks / flash 2.25 (512 new
tokens), 2.50 (256), 2.78 (1,024), 1.73 (512 after 512), 1.83 (64 after 512), 1.30 (64 after
2,048). There the attention backend keeps the flash kernel (`TorchAttentionBackend.block_causal`).

Scores are bf16, as in transformers' eager bf16 path (the flash kernel keeps them in float32);
float32 models keep the flash kernel, exact against transformers.

The softmax, with the diagonal block's mask, is a small C kernel where it builds
(`causal_softmax.c`, `warm_up`; bf16 in and out, float32 inside, as torch's): in place on the
scores, one call per block instead of a masked fill and torch's softmax.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ..native_build import NativeBuildError, load

logger = logging.getLogger(__name__)

MIN_KEYS = 129  # fewer keys: the flash kernel (a 64-token prompt: 0.12 against 0.15-0.22 ms)
BLOCK_ROWS = 128  # query rows per block
LONG_KEYS = 1024  # past this many keys a block takes LONG_BLOCK_ROWS rows (less score memory)
LONG_BLOCK_ROWS = 64


SOURCE = Path(__file__).with_name("causal_softmax.c")
_softmax: ctypes.CDLL | None = None


def warm_up() -> bool:
    """Build (or load) the softmax kernel; False, logged, where it cannot be built (torch's
    softmax then runs)."""
    global _softmax
    if _softmax is None:
        argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        try:
            _softmax = load(SOURCE, {}, {"causal_softmax_bf16": argtypes})
        except (NativeBuildError, OSError) as exc:
            logger.warning("bf16 prompt attention uses torch's softmax: the causal softmax "
                           "kernel could not be built: %s", exc)
            return False
    return True


def _masked_softmax(scores: torch.Tensor, rows: int) -> torch.Tensor:
    """Softmax over the last dim of `scores` [..., block rows, keys] (contiguous) with the last
    `rows` keys masked above the diagonal, in place where the kernel runs."""
    keys = scores.shape[-1]
    if (_softmax is not None and scores.dtype == torch.bfloat16 and scores.is_contiguous()
            and rows <= keys and scores.device.type == "cpu"):
        _softmax.causal_softmax_bf16(scores.data_ptr(), scores.data_ptr(),
                                     scores.numel() // keys, keys, rows, torch.get_num_threads())
        return scores
    above = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu(1)
    scores[..., keys - rows:].masked_fill_(above, float("-inf"))
    return torch.softmax(scores, dim=-1)


def blocks_faster(num_keys: int) -> bool:
    """Whether an extend attending to `num_keys` keys runs faster here than in the flash
    kernel (`benchmarks/attention_bench.py`)."""
    return num_keys >= MIN_KEYS


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                           scale: float) -> torch.Tensor:
    """q [Hq, n, D] (the extend's queries), k and v [Hk, prefix + n, D] (the request's keys and
    values, the extend's last): query row i attends to keys [0, prefix + i]. Returns [n, Hq, D]."""
    num_q_heads, n, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[0], k.shape[1]
    if num_keys != prefix + n or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and prefix {prefix} do not "
                         f"make one causal extend")
    group = num_q_heads // num_kv_heads
    block = LONG_BLOCK_ROWS if num_keys > LONG_KEYS else BLOCK_ROWS
    qs = q.mul(scale).reshape(num_kv_heads, group, n, head_dim)
    out = torch.empty(n, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    for start in range(0, n, block):
        end = min(n, start + block)
        rows = end - start
        keys = prefix + end
        qb = qs[:, :, start:end].reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(qb, k[:, :keys].transpose(1, 2)).view(num_kv_heads, group, rows, keys)
        probs = _masked_softmax(scores, rows).view(num_kv_heads, group * rows, keys)
        block_out = torch.bmm(probs, v[:, :keys]).view(num_kv_heads, group, rows, head_dim)
        out[start:end] = block_out.permute(2, 0, 1, 3).reshape(rows, num_q_heads, head_dim)
    return out
