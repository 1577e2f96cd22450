"""Cascade decode attention equals plain attention over each request's whole row."""

from __future__ import annotations

import numpy as np
import torch

from raydix.workers.attention.cascade import CascadeBatch, cascade_attention, find_groups


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], k/v [L, Hk, D] -> [Hq, D] (GQA by repetition)."""
    rep = q.shape[0] // k.shape[1]
    kk = k.repeat_interleave(rep, 1).transpose(0, 1)  # [Hq, L, D]
    vv = v.repeat_interleave(rep, 1).transpose(0, 1)
    probs = torch.softmax(torch.einsum("hd,hld->hl", q, kk) * q.shape[-1] ** -0.5, -1)
    return torch.einsum("hl,hld->hd", probs, vv)


def test_cascade_matches_plain_attention() -> None:
    """Two groups of different sizes and prefix lengths (padding of groups, prefixes and
    suffixes), run in the same ops, each member against plain attention over its row."""
    gen = torch.Generator().manual_seed(0)
    num_slots, hk, hq, d = 400, 2, 6, 16
    k_buf = torch.randn(num_slots, hk, d, generator=gen)
    v_buf = torch.randn(num_slots, hk, d, generator=gen)
    first = list(range(10, 60))  # 50 shared slots
    second = list(range(120, 160))  # 40 shared slots
    rows = [first + [100, 101, 102], second + [170, 171], first + [200], second + [180],
            first + [300, 301, 302, 303, 304], [5, 6, 7]]
    lens = np.array([len(r) for r in rows])
    slots = np.zeros((len(rows), lens.max()), dtype=np.int32)
    for i, r in enumerate(rows):
        slots[i, : len(r)] = r
    slots[2, lens[2]:] = 7  # garbage past a row's end must not matter
    groups = find_groups(slots, lens)
    assert [(m.tolist(), n) for m, n in groups] == [([0, 2, 4], 50), ([1, 3], 40)]
    batch = CascadeBatch.build(slots, lens, groups, hk)
    assert batch.members.tolist() == [0, 2, 4, 1, 3]
    assert (batch.num_groups, batch.max_members, batch.prefix_len, batch.suffix_len) == (
        2, 3, 50, 5)
    q = torch.randn(len(rows), hq, d, generator=gen)
    got = cascade_attention(q[torch.from_numpy(batch.members)], k_buf, v_buf, batch, hk)
    for i, member in enumerate(batch.members):
        r = rows[member]
        want = _plain(q[member], k_buf[r], v_buf[r])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_short_or_single_prefixes_form_no_group() -> None:
    slots = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [5, 6, 7, 8]])
    assert find_groups(slots, np.array([4, 4, 4])) == []
