"""Decode attention that reads a prefix shared by several requests once (CPU).

Requests whose request rows start with the same slots (a prefix they all got from the radix
cache) form a group. Their queries attend to the shared prefix in one matmul against one copy
of its K/V, and each to its own suffix separately; the two softmax parts are merged through
their maxima and sums, which gives exactly the attention over the whole row.

All groups of a step run in the same few ops: prefixes are padded to the longest one and
groups to the largest one (padding keys are masked, padding queries dropped), and every
member's suffix to the longest suffix. Per layer that is about twenty ops whatever the number
of groups, each large enough to be worth the intra-op threads; a loop over groups made a
hundred small ops per layer, which cost more in dispatch and thread wake-ups than in math.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MIN_SHARED_LEN = 32  # shorter shared prefixes are not worth a separate pass


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


@dataclass
class CascadeBatch:
    """Every group of one step. "Grouped requests" are the members of all groups, group by
    group; `members` gives their positions among the step's decode requests."""

    members: np.ndarray  # [M] position of each grouped request among the decode requests
    num_groups: int  # NG
    max_members: int  # G, members of the largest group
    member_idx: torch.Tensor  # [NG * G] grouped request in each (group, place); padding repeats
    member_places: torch.Tensor  # [M] (group * G + place) of each grouped request
    prefix_rows: torch.Tensor  # [NG * Hk * P] pool rows of each group's prefix, head-major
    prefix_len: int  # P, the longest shared prefix
    prefix_padding: torch.Tensor  # [NG, 1, 1, P] True past a group's shared length
    suffix_rows: torch.Tensor  # [M * Hk * S] pool rows of each grouped request's own suffix
    suffix_len: int  # S, the longest suffix
    suffix_padding: torch.Tensor  # [M, 1, 1, S] True past a request's length

    @classmethod
    def build(cls, slots: np.ndarray, lens: np.ndarray, groups: list[tuple[np.ndarray, int]],
              num_kv_heads: int, device: torch.device | str = "cpu") -> CascadeBatch:
        """``slots`` [B, L] and ``lens`` [B] of the decode requests; ``groups`` from
        `find_groups` (not empty)."""
        num_groups = len(groups)
        max_members = max(len(m) for m, _ in groups)
        prefix_len = max(shared for _, shared in groups)
        members = np.concatenate([m for m, _ in groups])
        shared_of = np.concatenate([np.full(len(m), shared) for m, shared in groups])
        prefix_slots = np.zeros((num_groups, prefix_len), dtype=np.int64)  # 0: padding slot
        member_idx = np.zeros((num_groups, max_members), dtype=np.int64)
        places = []
        start = 0
        for g, (m, shared) in enumerate(groups):
            prefix_slots[g, :shared] = slots[m[0], :shared]
            member_idx[g, :] = start  # padding places repeat the group's first member
            member_idx[g, : len(m)] = start + np.arange(len(m))
            places.append(g * max_members + np.arange(len(m)))
            start += len(m)
        shared_lens = np.array([s for _, s in groups])
        suffix_lens = lens[members] - shared_of
        suffix_len = int(suffix_lens.max())
        cols = np.minimum(shared_of[:, None] + np.arange(suffix_len), slots.shape[1] - 1)
        suffix_slots = slots[members[:, None], cols]

        def tensor(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(arr)).to(device)

        return cls(
            members, num_groups, max_members, tensor(member_idx.reshape(-1)),
            tensor(np.concatenate(places)),
            tensor(_pool_rows(prefix_slots, num_kv_heads)), prefix_len,
            tensor(np.arange(prefix_len)[None, :] >= shared_lens[:, None])[:, None, None, :],
            tensor(_pool_rows(suffix_slots, num_kv_heads)), suffix_len,
            tensor(np.arange(suffix_len)[None, :] >= suffix_lens[:, None])[:, None, None, :])


def _pool_rows(slots: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Rows of a layer's pool viewed as [num_slots * Hk, D] for slots [N, L]: [N * Hk * L],
    head-major within each of the N, so one index_select yields [N, Hk, L, D]."""
    heads = np.arange(num_kv_heads)[None, :, None]
    return (slots[:, None, :].astype(np.int64) * num_kv_heads + heads).reshape(-1)


def cascade_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      batch: CascadeBatch, num_kv_heads: int) -> torch.Tensor:
    """q [M, Hq, D] of the grouped requests -> attention output [M, Hq, D] over each one's
    whole row."""
    num_req, num_q_heads, head_dim = q.shape
    rep = num_q_heads // num_kv_heads
    groups, places = batch.num_groups, batch.max_members
    scale = head_dim ** -0.5
    flat_k, flat_v = k_buf.view(-1, head_dim), v_buf.view(-1, head_dim)
    # shared prefixes: [NG, Hk, G * rep, P], one copy of each prefix's K/V for its group
    shape = (groups, num_kv_heads, batch.prefix_len, head_dim)
    kp = flat_k.index_select(0, batch.prefix_rows).view(shape)
    vp = flat_v.index_select(0, batch.prefix_rows).view(shape)
    qp = q.index_select(0, batch.member_idx).view(groups, places, num_kv_heads, rep, head_dim)
    qp = qp.transpose(1, 2).reshape(groups, num_kv_heads, places * rep, head_dim)
    sp = torch.matmul(qp, kp.transpose(-1, -2)).float().mul_(scale)
    sp = sp.masked_fill_(batch.prefix_padding, float("-inf"))
    mp = sp.amax(-1, keepdim=True)
    ep = torch.exp(sp.sub_(mp))
    lp = ep.sum(-1, keepdim=True)
    op = torch.matmul(ep.to(vp.dtype), vp).float()  # not yet normalised
    # back to one row per grouped request: [M, Hk, rep, D + 2]
    parts = torch.cat([op, mp, lp], dim=-1).view(groups, num_kv_heads, places, rep, -1)
    parts = parts.transpose(1, 2).reshape(groups * places, num_kv_heads, rep, head_dim + 2)
    parts = parts.index_select(0, batch.member_places)
    op, mp, lp = parts.split([head_dim, 1, 1], dim=-1)
    # each request's own suffix: [M, Hk, rep, S]
    shape = (num_req, num_kv_heads, batch.suffix_len, head_dim)
    ks = flat_k.index_select(0, batch.suffix_rows).view(shape)
    vs = flat_v.index_select(0, batch.suffix_rows).view(shape)
    qs = q.view(num_req, num_kv_heads, rep, head_dim)
    ss = torch.matmul(qs, ks.transpose(-1, -2)).float().mul_(scale)
    ss = ss.masked_fill_(batch.suffix_padding, float("-inf"))
    ms = ss.amax(-1, keepdim=True)
    es = torch.exp(ss.sub_(ms))
    os_ = torch.matmul(es.to(vs.dtype), vs).float()
    ls = es.sum(-1, keepdim=True)
    # merge the two parts of each softmax
    m = torch.maximum(mp, ms)
    wp, ws = torch.exp(mp - m), torch.exp(ms - m)
    out = (op * wp + os_ * ws) / (lp * wp + ls * ws)
    return out.to(q.dtype).reshape(num_req, num_q_heads, head_dim)
