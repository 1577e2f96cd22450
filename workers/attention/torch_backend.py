"""Attention with `scaled_dot_product_attention`: runs on CPU, and on CUDA as a fallback.

Single-token requests (decode) are attended in one padded batch; multi-token requests (extend)
one request at a time, with a causal mask shifted by the request's prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kv_pool import KVPool
from .base import AttentionBackend, ForwardBatch


@dataclass
class _ExtendEntry:
    token_start: int
    extend_len: int
    slots: torch.Tensor  # [seq_len] slot of every position
    mask: torch.Tensor | None  # [extend_len, seq_len] bool, None when plain causal


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [Bd] packed index of each decode token
    slots: torch.Tensor  # [Bd, max_len]
    mask: torch.Tensor  # [Bd, 1, 1, max_len] bool, True = attend


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.device = req_to_token.device
        self._out_cache_loc: torch.Tensor | None = None
        self._decode: _DecodeGroup | None = None
        self._extends: list[_ExtendEntry] = []

    def prepare(self, batch: ForwardBatch) -> None:
        self._out_cache_loc = batch.out_cache_loc
        starts = batch.token_starts
        seq_lens = batch.seq_lens
        single = np.flatnonzero(batch.extend_lens == 1)
        self._decode = None
        if len(single):
            max_len = int(seq_lens[single].max())
            rows = torch.from_numpy(batch.row_idx[single]).to(self.device)
            lens = torch.from_numpy(seq_lens[single]).to(self.device)
            slots = self.req_to_token[rows, :max_len].long()
            mask = torch.arange(max_len, device=self.device)[None, :] < lens[:, None]
            self._decode = _DecodeGroup(torch.from_numpy(starts[single]).to(self.device),
                                        slots, mask[:, None, None, :])
        self._extends = []
        for i in np.flatnonzero(batch.extend_lens > 1):
            prefix, ext = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
            slots = self.req_to_token[int(batch.row_idx[i]), : prefix + ext].long()
            mask = None
            if prefix:
                q_pos = torch.arange(ext, device=self.device)[:, None] + prefix
                mask = torch.arange(prefix + ext, device=self.device)[None, :] <= q_pos
            self._extends.append(_ExtendEntry(int(starts[i]), ext, slots, mask))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if self._out_cache_loc is None:
            raise RuntimeError("prepare(batch) must run before forward")
        self.pool.set_kv(layer_id, self._out_cache_loc, k, v)
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        out = torch.empty_like(q)
        if self._decode is not None:
            d = self._decode
            out[d.token_idx] = self._decode_attention(q[d.token_idx], k_buf, v_buf, d)
        for e in self._extends:
            qe = q[e.token_start: e.token_start + e.extend_len].transpose(0, 1)  # [Hq, n, D]
            ke = _gather(k_buf, e.slots).transpose(0, 1).to(q.dtype)  # [Hk, L, D]
            ve = _gather(v_buf, e.slots).transpose(0, 1).to(q.dtype)
            if ke.shape[0] != qe.shape[0]:  # expand GQA here: the fused CPU kernels lack it
                group = qe.shape[0] // ke.shape[0]
                ke, ve = ke.repeat_interleave(group, 0), ve.repeat_interleave(group, 0)
            res = F.scaled_dot_product_attention(  # 4-D inputs take the fused CPU kernel
                qe[None], ke[None], ve[None], attn_mask=e.mask, is_causal=e.mask is None)
            out[e.token_start: e.token_start + e.extend_len] = res[0].transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _decode_attention(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          d: _DecodeGroup) -> torch.Tensor:
        """One query per request: the query heads that share a KV head become rows of one
        matmul against that head's keys (no KV expansion; faster than SDPA here on CPU)."""
        num_req, num_q_heads, head_dim = q.shape
        k = _gather(k_buf, d.slots).transpose(1, 2).to(q.dtype)  # [Bd, Hk, L, D]
        v = _gather(v_buf, d.slots).transpose(1, 2).to(q.dtype)
        num_kv_heads = k.shape[1]
        qg = q.view(num_req, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * head_dim ** -0.5  # [Bd, Hk, G, L]
        scores = scores.float().masked_fill_(~d.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(num_req, num_q_heads, head_dim)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] for a [..] slot index tensor, as one index_select over the slot dimension."""
    return buf.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[1:])
