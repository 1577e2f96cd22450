"""Decode attention that reads a prefix shared by several requests once (CPU).

Requests whose request rows start with the same slots (a prefix they all got from the radix
cache) form a group. Their queries attend to the shared prefix in one matmul against one copy
of its K/V, and each to its own suffix separately; the two softmax parts are merged through
their maxima and sums, which gives exactly the attention over the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_SHARED_LEN = 32  # shorter shared prefixes are not worth a separate pass


@dataclass
class CascadeGroup:
    members: np.ndarray  # positions of the group's requests among the decode requests
    token_idx: torch.Tensor  # [G] packed index of each member's decode token
    prefix_rows: torch.Tensor  # [Hk * P] pool rows of the shared prefix, head-major
    prefix_len: int
    suffix_rows: torch.Tensor  # [G * Hk * S] pool rows of each member's own suffix
    suffix_len: int
    suffix_padding: torch.Tensor  # [G, 1, 1, S] True past a member's length


def find_groups(slots: np.ndarray, lens: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """Groups of >= 2 decode requests whose rows share their first slots: (members, length).

    ``slots`` [B, L] are the rows' slots (anything past a request's length is ignored)."""
    groups = []
    first = slots[:, 0]
    for value in np.unique(first):
        members = np.flatnonzero(first == value)
        if len(members) < 2:
            continue
        rows = slots[members]
        differ = (rows != rows[0]).any(axis=0)
        shared = int(differ.argmax()) if differ.any() else rows.shape[1]
        shared = min(shared, int(lens[members].min()) - 1)  # each keeps its own last token
        if shared >= MIN_SHARED_LEN:
            groups.append((members, shared))
    return groups


def cascade_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      group: CascadeGroup, num_kv_heads: int) -> torch.Tensor:
    """q [G, Hq, D] -> attention output [G, Hq, D] over each member's whole row."""
    num_req, num_q_heads, head_dim = q.shape
    rep = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5
    flat_k, flat_v = k_buf.view(-1, head_dim), v_buf.view(-1, head_dim)
    # shared prefix: [Hk, G * rep, P], one copy of its K/V for the whole group
    kp = flat_k.index_select(0, group.prefix_rows).view(num_kv_heads, group.prefix_len, head_dim)
    vp = flat_v.index_select(0, group.prefix_rows).view(num_kv_heads, group.prefix_len, head_dim)
    qp = q.view(num_req, num_kv_heads, rep, head_dim).permute(1, 0, 2, 3)
    qp = qp.reshape(num_kv_heads, num_req * rep, head_dim)
    sp = torch.matmul(qp, kp.transpose(-1, -2)).float() * scale
    mp = sp.amax(-1, keepdim=True)
    ep = torch.exp(sp - mp)
    op = torch.matmul(ep.to(vp.dtype), vp).float()  # [Hk, G*rep, D], not yet normalised
    lp = ep.sum(-1, keepdim=True)

    def per_member(x: torch.Tensor) -> torch.Tensor:  # [Hk, G*rep, X] -> [G, Hk, rep, X]
        return x.view(num_kv_heads, num_req, rep, -1).permute(1, 0, 2, 3)

    mp, op, lp = per_member(mp), per_member(op), per_member(lp)
    # each member's own suffix: [G, Hk, rep, S]
    shape = (num_req, num_kv_heads, group.suffix_len, head_dim)
    ks = flat_k.index_select(0, group.suffix_rows).view(shape)
    vs = flat_v.index_select(0, group.suffix_rows).view(shape)
    qs = q.view(num_req, num_kv_heads, rep, head_dim)
    ss = torch.matmul(qs, ks.transpose(-1, -2)).float() * scale
    ss = ss.masked_fill_(group.suffix_padding, float("-inf"))
    ms = ss.amax(-1, keepdim=True)
    es = torch.exp(ss - ms)
    os_ = torch.matmul(es.to(vs.dtype), vs).float()
    ls = es.sum(-1, keepdim=True)
    # merge the two parts of each softmax
    m = torch.maximum(mp, ms)
    wp, ws = torch.exp(mp - m), torch.exp(ms - m)
    out = (op * wp + os_ * ws) / (lp * wp + ls * ws)
    return out.to(q.dtype).reshape(num_req, num_q_heads, head_dim)
