"""Cascade decode attention equals plain attention over each request's whole row."""

from __future__ import annotations

import numpy as np
import torch

from raydix.workers.attention.cascade import CascadeGroup, cascade_attention, find_groups


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], k/v [L, Hk, D] -> [Hq, D] (GQA by repetition)."""
    rep = q.shape[0] // k.shape[1]
    kk = k.repeat_interleave(rep, 1).transpose(0, 1)  # [Hq, L, D]
    vv = v.repeat_interleave(rep, 1).transpose(0, 1)
    probs = torch.softmax(torch.einsum("hd,hld->hl", q, kk) * q.shape[-1] ** -0.5, -1)
    return torch.einsum("hl,hld->hd", probs, vv)


def test_cascade_matches_plain_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    num_slots, hk, hq, d = 400, 2, 6, 16
    k_buf = torch.randn(num_slots, hk, d, generator=gen)
    v_buf = torch.randn(num_slots, hk, d, generator=gen)
    shared = list(range(10, 60))  # 50 shared slots
    rows = [shared + [100, 101, 102], shared + [200], shared + [300, 301, 302, 303, 304]]
    lens = np.array([len(r) for r in rows])
    slots = np.zeros((3, lens.max()), dtype=np.int64)
    for i, r in enumerate(rows):
        slots[i, : len(r)] = r
    slots[1, lens[1]:] = 7  # garbage past a row's end must not matter
    groups = find_groups(slots, lens)
    assert [(m.tolist(), n) for m, n in groups] == [([0, 1, 2], 50)]
    members, prefix_len = groups[0]
    heads = torch.arange(hk)[:, None]
    prefix_rows = (torch.tensor(shared)[None, :] * hk + heads).reshape(-1)
    suffix_len = int(lens.max()) - prefix_len
    suffix = torch.from_numpy(slots[:, prefix_len: prefix_len + suffix_len])
    suffix_rows = (suffix[:, None, :] * hk + heads).reshape(-1)
    pad = torch.from_numpy(np.arange(suffix_len)[None, :] + prefix_len >= lens[:, None])
    group = CascadeGroup(members, torch.arange(3), prefix_rows, prefix_len, suffix_rows,
                         suffix_len, pad[:, None, None, :])
    q = torch.randn(3, hq, d, generator=gen)
    got = cascade_attention(q, k_buf, v_buf, group, hk)
    for i, r in enumerate(rows):
        want = _plain(q[i], k_buf[r], v_buf[r])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_short_or_single_prefixes_form_no_group() -> None:
    slots = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [5, 6, 7, 8]])
    assert find_groups(slots, np.array([4, 4, 4])) == []
