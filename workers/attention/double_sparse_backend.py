"""DoubleSparse decode attention (an opt-in approximation for long contexts): each token is first
scored on a few "heavy" channels of its key (the pool's label buffer), only the
`heavy_token_num` best tokens per query head are kept, and the query attends exactly over them.

A decode group whose longest request is shorter than `sparse_decode_threshold` attends densely.
When the budget covers a request's context every token is kept and the result is dense
attention's. Extend (prefill and chunks) is always dense.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..kv_pool import DoubleSparseKVPool
from .base import LayerAttention
from .torch_backend import TorchAttentionBackend, _DecodeGroup, _gather


class DoubleSparseBackend(TorchAttentionBackend):
    def __init__(self, pool: DoubleSparseKVPool, req_to_token: torch.Tensor, num_q_heads: int,
                 head_dim: int, layers: Sequence[LayerAttention] | None, heavy_token_num: int,
                 sparse_decode_threshold: int) -> None:
        super().__init__(pool, req_to_token, num_q_heads, head_dim, layers)
        if any(a.window or a.logit_softcap for a in self.layers):
            raise ValueError("the double-sparse KV pool does not combine with sliding windows "
                             "or logit soft caps")
        self.ds_pool = pool
        self.heavy_token_num = heavy_token_num
        self.sparse_decode_threshold = sparse_decode_threshold
        self._layer_id = 0
        # per layer [Hk, D]: summed |q| * |k| per channel while calibrating (double_sparse.py)
        self.calibration: list[torch.Tensor] | None = None

    def _prepare_cascades(self, batch: object, single: np.ndarray) -> np.ndarray:
        return single  # every decode goes through `_decode_attention`

    def _decodes_on_pages(self) -> bool:
        return False  # the sparse selection reads the decode groups' pool rows

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        if self.calibration is not None:
            group = q.shape[1] // k.shape[1]
            q_abs = q.float().abs().view(q.shape[0], k.shape[1], group, -1).sum(2)
            self.calibration[layer_id] += (q_abs * k.float().abs()).sum(0)
        self._layer_id = layer_id
        return super().forward(layer_id, q, k, v)

    def _decode_attention(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                          d: _DecodeGroup, padding: torch.Tensor,
                          attn: LayerAttention) -> torch.Tensor:
        if d.max_len < self.sparse_decode_threshold:
            return super()._decode_attention(q, k_buf, v_buf, d, padding, attn)
        num_req, num_q_heads, head_dim = q.shape
        hk = self.num_kv_heads
        group, budget = num_q_heads // hk, min(self.heavy_token_num, d.max_len)
        channels = self.ds_pool.heavy_channels[self._layer_id]  # [Hk, C]
        assert d.rows is not None  # `_decodes_on_pages` is False here
        labels = _gather(self.ds_pool.label_buffers[self._layer_id], d.rows)
        labels = labels.view(num_req, hk, d.max_len, -1).to(q.dtype)  # [Bd, Hk, L, C]
        qg = q.view(num_req, hk, group, head_dim)
        q_label = qg.gather(-1, channels[None, :, None, :].expand(num_req, hk, group, -1))
        approx = torch.matmul(q_label, labels.transpose(-1, -2)).float()  # [Bd, Hk, G, L]
        approx = approx.masked_fill_(padding, float("-inf"))
        picked = approx.topk(budget, dim=-1).indices  # [Bd, Hk, G, K]
        rows = d.rows.view(num_req, hk, d.max_len).gather(
            -1, picked.reshape(num_req, hk, group * budget)).reshape(-1)
        shape = (num_req, hk, group, budget, head_dim)
        k = _gather(k_buf, rows).view(shape).to(q.dtype)
        v = _gather(v_buf, rows).view(shape).to(q.dtype)
        scores = torch.matmul(qg.unsqueeze(-2), k.transpose(-1, -2)).squeeze(-2).float()
        scores = scores * attn.softmax_scale(head_dim)  # [Bd, Hk, G, K]
        past_end = padding.expand(num_req, hk, group, d.max_len).gather(-1, picked)
        probs = torch.softmax(scores.masked_fill_(past_end, float("-inf")), dim=-1)
        out = torch.matmul(probs.to(q.dtype).unsqueeze(-2), v).squeeze(-2)
        return out.reshape(num_req, num_q_heads, head_dim)
