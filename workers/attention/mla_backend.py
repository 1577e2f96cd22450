"""Multi-head latent attention over the latent pool (`MLAKVPool`), in torch (CPU, and CUDA).

The pool keeps per token one latent [c_kv (r) | k_pe (dr)]. With kv_b_proj per head split into
W_k [dn, r] and W_v [dv, r], head h's key is [W_k c | k_pe] and its value W_v c, so

    score = q_nope . W_k c + q_pe . k_pe = [W_k^T q_nope | q_pe] . [c | k_pe]
    out   = W_v (sum_j p_j c_j)

Decode uses the right-hand sides ("weight absorption"): the query is mapped into the latent
space, every head attends over the latents themselves (one shared key/value row per token, as
multi-query attention), and the output is mapped back. Per step it reads only the latents:
r + dr values per token and layer, instead of heads * (dn + dr + dv) for expanded K and V.
Extend (prefill, chunks) expands the latents of the request's context into per-head K and V
with one matmul and runs SDPA, which costs less when many queries share the expansion.
`absorb_decode=False` decodes the expanding way too (the benchmark's baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..config import MLAConfig
from ..kv_pool import MLAKVPool
from .base import AttentionBackend, ForwardBatch, LayerAttention
from .torch_backend import split_by_length


@dataclass
class _Decodes:
    token_idx: torch.Tensor  # [Bd] packed index of each decode token
    slots: torch.Tensor  # [Bd * max_len] pool slots, request-major
    max_len: int
    keep: torch.Tensor  # [Bd, 1, max_len] bool, False = past the request's length


@dataclass
class _Extend:
    token_start: int
    extend_len: int
    slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [extend_len, seq_len] bool (True = attend); None: plain causal


class MLABackend(AttentionBackend):
    def __init__(self, pool: MLAKVPool, req_to_token: torch.Tensor, num_heads: int,
                 mla: MLAConfig, layers: Sequence[LayerAttention] | None = None,
                 absorb_decode: bool = True) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.mla = mla
        self.device = req_to_token.device
        self.layers = tuple(layers or [LayerAttention()] * pool.config.num_layers)
        if any(a.window or a.logit_softcap for a in self.layers):
            raise ValueError("latent attention has no sliding window or logit soft cap")
        self.absorb_decode = absorb_decode
        self._out_cache_loc: torch.Tensor | None = None
        self._decodes: list[_Decodes] = []
        self._extends: list[_Extend] = []

    def prepare(self, batch: ForwardBatch) -> None:
        self._out_cache_loc = batch.out_cache_loc
        starts, seq_lens = batch.token_starts, batch.seq_lens
        single = np.flatnonzero(batch.extend_lens == 1)
        self._decodes = []
        for part in split_by_length(single, seq_lens[single]):
            max_len = int(seq_lens[part].max())
            rows = torch.from_numpy(batch.row_idx[part]).to(self.device)
            lens = torch.from_numpy(seq_lens[part]).to(self.device)
            slots = self.req_to_token[rows, :max_len].long()
            keep = torch.arange(max_len, device=self.device)[None, :] < lens[:, None]
            self._decodes.append(_Decodes(torch.from_numpy(starts[part]).to(self.device),
                                          slots.reshape(-1), max_len, keep[:, None, :]))
        self._extends = []
        for i in np.flatnonzero(batch.extend_lens > 1):
            prefix, ext = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
            slots = self.req_to_token[int(batch.row_idx[i]), : prefix + ext].long()
            mask = None
            if prefix:
                q_pos = torch.arange(ext, device=self.device)[:, None] + prefix
                mask = torch.arange(prefix + ext, device=self.device)[None, :] <= q_pos
            self._extends.append(_Extend(int(starts[i]), ext, slots, mask))

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        raise TypeError("the MLA backend attends through forward_mla (latent attention only)")

    def forward_mla(self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                    latent: torch.Tensor, w_kv: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), latent [T, r + dr] (the new tokens'),
        w_kv [H, dn + dv, r] (this rank's kv_b_proj); returns [T, H * dv]."""
        if self._out_cache_loc is None:
            raise RuntimeError("prepare(batch) must run before forward_mla")
        self.pool.set_kv(layer_id, self._out_cache_loc, latent)
        buf = self.pool.kv_buffers[layer_id][:, 0]  # [num_slots, r + dr]
        mla = self.mla
        scale = self.layers[layer_id].softmax_scale(mla.qk_head_dim)
        num_tokens = q_nope.shape[0]
        out = q_nope.new_empty(num_tokens, self.num_heads, mla.v_head_dim)
        for d in self._decodes:
            qn, qp = q_nope[d.token_idx], q_pe[d.token_idx]
            lat = buf.index_select(0, d.slots).view(len(d.token_idx), d.max_len, -1)
            lat = lat.to(q_nope.dtype)
            if self.absorb_decode:
                out[d.token_idx] = self._absorbed(qn, qp, lat, d.keep, w_kv, scale)
            else:
                out[d.token_idx] = self._expanded(qn[:, :, None], qp[:, :, None], lat,
                                                  d.keep[:, :, None], w_kv, scale)[:, :, 0]
        for e in self._extends:
            rows = slice(e.token_start, e.token_start + e.extend_len)
            lat = buf.index_select(0, e.slots).to(q_nope.dtype)
            res = self._expanded(q_nope[rows].transpose(0, 1)[None],
                                 q_pe[rows].transpose(0, 1)[None], lat[None],
                                 e.mask, w_kv, scale)  # [1, H, n, dv]
            out[rows] = res[0].transpose(0, 1)
        return out.view(num_tokens, -1)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                  keep: torch.Tensor, w_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """One query per request over its latents [B, L, r + dr]; returns [B, H, dv]."""
        r, dn = self.mla.kv_lora_rank, self.mla.qk_nope_head_dim
        w_k, w_v = w_kv[:, :dn], w_kv[:, dn:]  # [H, dn, r], [H, dv, r]
        q_lat = torch.matmul(q_nope.transpose(0, 1), w_k).transpose(0, 1)  # [B, H, r]
        query = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, r + dr]
        scores = torch.matmul(query, lat.transpose(1, 2)).float() * scale  # [B, H, L]
        probs = scores.masked_fill_(~keep, float("-inf")).softmax(dim=-1).to(lat.dtype)
        o_lat = torch.matmul(probs, lat[..., :r])  # [B, H, r]
        return torch.matmul(o_lat.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                  mask: torch.Tensor | None, w_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """Queries [B, H, n, dn / dr] over latents [B, L, r + dr] expanded into per-head K and V;
        returns [B, H, n, dv]. `mask` broadcasts to [B, H, n, L]; None: causal."""
        mla = self.mla
        num_req, seq_len = lat.shape[:2]
        heads = w_kv.shape[0]
        kv = torch.matmul(lat[..., : mla.kv_lora_rank], w_kv.reshape(-1, w_kv.shape[-1]).T)
        kv = kv.view(num_req, seq_len, heads, -1).transpose(1, 2)  # [B, H, L, dn + dv]
        k_nope, value = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_pe = lat[:, None, :, mla.kv_lora_rank:].expand(num_req, heads, seq_len, -1)
        key = torch.cat((k_nope, k_pe), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        return F.scaled_dot_product_attention(query, key, value.contiguous(), attn_mask=mask,
                                              is_causal=mask is None, scale=scale)
