"""Decode attention on the pages (workers/attention/paged_decode.c): the kernel agrees with a
per-request float64 reference at every head size, length and dtype it serves, builds no dense
copy of the keys and values, is built once per machine and head sizes, and where it cannot be
built the engine is told why and uses the plain ops."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from raydix.workers import native_build
from raydix.workers.attention import paged_decode

HK, G, D = 3, 3, 16


def _per_request(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention, one request and one KV head at a time, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    scale = q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        own = slots[b, : int(lens[b])]
        for h in range(q.shape[1]):
            k, v = k_buf[own, h].double(), v_buf[own, h].double()
            probs = torch.softmax(q[b, h].double() @ k.T * scale, dim=-1)
            out[b, h] = probs @ v
    return out


def _kernel(hk: int, d: int, g: int, dtype: torch.dtype) -> paged_decode.Kernel:
    kernel = paged_decode.warm_up(hk, d, g, dtype)
    assert kernel is not None, "the paged kernel could not be built on this machine"
    return kernel


def _case(batch: int, max_len: int, dtype: torch.dtype, seed: int, hk: int = HK, g: int = G,
          d: int = D, spread: float = 1.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    num_slots = 4 * batch * max_len
    k_buf = torch.randn(num_slots, hk, d, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, hk, d, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: batch * max_len].view(batch, max_len)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    q = (torch.randn(batch, hk, g, d, generator=gen) * spread).to(dtype)
    return q, k_buf, v_buf, slots, lens


# lengths across the kernel's blocks of 32 keys: one key, a partial block, exact blocks, more
@pytest.mark.parametrize(("batch", "max_len"), [(1, 1), (1, 31), (2, 32), (5, 33), (3, 64),
                                                (12, 130), (4, 700)])
def test_paged_decode_equals_per_request_attention(batch: int, max_len: int) -> None:
    kernel = _kernel(HK, D, G, torch.float32)
    q, k_buf, v_buf, slots, lens = _case(batch, max_len, torch.float32, batch + max_len)
    got = kernel(q, k_buf, v_buf, slots, lens)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _per_request(q, k_buf, v_buf, slots, lens),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hk", "g", "d"), [(1, 1, 8), (2, 4, 64), (4, 2, 128), (1, 7, 80)])
def test_other_head_sizes(hk: int, g: int, d: int) -> None:
    kernel = _kernel(hk, d, g, torch.float32)
    q, k_buf, v_buf, slots, lens = _case(3, 77, torch.float32, d, hk, g, d)
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, lens).double(),
                               _per_request(q, k_buf, v_buf, slots, lens), atol=1e-5, rtol=1e-5)


def test_large_scores_stay_exact() -> None:
    """Scores hundreds apart (peaked softmax, the running maximum rising block after block):
    the online softmax's rescaling must not overflow or lose the winning keys."""
    kernel = _kernel(HK, D, G, torch.float32)
    q, k_buf, v_buf, slots, lens = _case(4, 200, torch.float32, 5, spread=40.0)
    k_buf *= torch.linspace(0.1, 3.0, k_buf.shape[0])[:, None, None]  # later slots: larger
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, lens).double(),
                               _per_request(q, k_buf, v_buf, slots, lens), atol=1e-5, rtol=1e-5)


def _shared_case(runs: list[tuple[int, int]], max_len: int, dtype: torch.dtype, seed: int,
                 hk: int = HK, g: int = G, d: int = D) -> tuple[torch.Tensor, ...]:
    """`_case` with rows that start with the same slots: per (rows, shared) of `runs`, that
    many consecutive rows take their run's first row's first `shared` slots (the radix cache's
    shared prefix); the rest of each row its own slots, every length at least shared + 1."""
    q, k_buf, v_buf, slots, lens = _case(sum(n for n, _ in runs), max_len, dtype, seed, hk, g, d)
    gen = torch.Generator().manual_seed(seed + 1)
    first = 0
    for rows, shared in runs:
        slots[first + 1: first + rows, :shared] = slots[first, :shared]
        lens[first: first + rows] = torch.randint(shared + 1, max_len + 1, (rows,),
                                                  generator=gen)
        first += rows
    return q, k_buf, v_buf, slots, lens


# (rows, shared slots) runs: a group; more rows than one pass takes (10 of G=3's queries); two
# groups beside lone rows; rows whose common start is too short to share (5 < 32 slots); a
# group of two whose common prefix is the whole shorter row but its last key
@pytest.mark.parametrize("runs", [
    [(5, 100)],
    [(23, 40)],
    [(1, 0), (4, 64), (1, 0), (3, 33), (2, 0)],
    [(3, 5), (2, 31), (4, 32)],
    [(2, 199)],
])
def test_rows_that_share_their_first_slots_read_them_once_and_agree(
        runs: list[tuple[int, int]]) -> None:
    kernel = _kernel(HK, D, G, torch.float32)
    q, k_buf, v_buf, slots, lens = _shared_case(runs, 200, torch.float32, len(runs))
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, lens).double(),
                               _per_request(q, k_buf, v_buf, slots, lens), atol=1e-5, rtol=1e-5)


def test_nested_shared_prefixes_agree() -> None:
    """Rows sharing different lengths with the first row of their run (a tree of prefixes):
    each pass shares only what all its rows have in common."""
    kernel = _kernel(HK, D, G, torch.float32)
    q, k_buf, v_buf, slots, lens = _shared_case([(12, 150)], 300, torch.float32, 21)
    for row, cut in ((3, 60), (4, 149), (7, 40), (9, 32)):
        slots[row, cut:] = torch.randperm(k_buf.shape[0])[: slots.shape[1] - cut]
        lens[row] = max(int(lens[row]), cut + 1)
    slots[5, 150:] = slots[0, 150:]  # row 5 shares row 0's whole row (but its length)
    lens[5] = 260
    lens[0] = 300
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, lens).double(),
                               _per_request(q, k_buf, v_buf, slots, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hk", "g", "d"), [(2, 7, 80), (1, 40, 16), (3, 2, 12)])
def test_shared_prefixes_at_other_head_sizes(hk: int, g: int, d: int) -> None:
    """4 rows a pass at 7 queries a KV head; one at 40 (a pass holds at most 40 queries); a
    head size that is no multiple of 8 (the plain loops instead of vectors of 8)."""
    kernel = _kernel(hk, d, g, torch.float32)
    q, k_buf, v_buf, slots, lens = _shared_case([(9, 70), (1, 0)], 120, torch.float32, g, hk,
                                                g, d)
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, lens).double(),
                               _per_request(q, k_buf, v_buf, slots, lens), atol=1e-5, rtol=1e-5)


def test_shared_prefixes_in_bf16() -> None:
    kernel = _kernel(HK, D, G, torch.bfloat16)
    q, k_buf, v_buf, slots, lens = _shared_case([(6, 90), (2, 0)], 128, torch.bfloat16, 8)
    got = kernel(q, k_buf, v_buf, slots, lens)
    want = _per_request(q, k_buf, v_buf, slots, lens)
    assert (got.float() - want.to(torch.bfloat16).float()).abs().max() <= 2 ** -7


# bf16 at head sizes of 32-dim multiples: the keys' and values' own dot products (AVX-512-BF16,
# where the CPU has it): 3 queries a KV head (each query's value sums in registers, 12 of 16),
# 4, 8 (two rounds of 4), 128 dims with 3 (rounds of 2, the last repeating one), 32 dims; lengths
# odd and even across blocks of 32, and shared prefixes (their passes' many queries in rounds)
# with each member's own keys after them, more members than one pass takes
@pytest.mark.parametrize(("hk", "g", "d"), [(3, 3, 64), (2, 4, 64), (1, 8, 64), (2, 3, 128),
                                            (2, 2, 32)])
def test_bf16_at_the_dot_products_head_sizes(hk: int, g: int, d: int) -> None:
    kernel = _kernel(hk, d, g, torch.bfloat16)
    for q, k_buf, v_buf, slots, lens in (
            _case(5, 33, torch.bfloat16, d + g, hk, g, d),
            _case(3, 301, torch.bfloat16, d + g + 1, hk, g, d),
            _shared_case([(4, 64), (1, 0), (3, 97)], 171, torch.bfloat16, d + g + 2, hk, g, d),
            _shared_case([(13, 40)], 90, torch.bfloat16, d + g + 3, hk, g, d)):  # > a pass
        lens[1] = 1  # a single key
        got = kernel(q, k_buf, v_buf, slots, lens)
        want = _per_request(q, k_buf, v_buf, slots, lens)
        assert got.dtype == torch.bfloat16
        # the float64 result rounded to bf16, met but for an ulp (the weights' bf16 rounding
        # in their product with the values stays below it)
        assert (got.float() - want.to(torch.bfloat16).float()).abs().max() <= 2 ** -7


def test_paged_decode_bf16_pool() -> None:
    kernel = _kernel(HK, D, G, torch.bfloat16)
    q, k_buf, v_buf, slots, lens = _case(6, 50, torch.bfloat16, 3)
    got = kernel(q, k_buf, v_buf, slots, lens)
    assert got.dtype == torch.bfloat16
    want = _per_request(q, k_buf, v_buf, slots, lens)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    # rounded as torch rounds: the float64 result rounded to bf16 is met but for an ulp
    assert (got.float() - want.to(torch.bfloat16).float()).abs().max() <= 2 ** -7


def _on_one_and_two_threads(kernel: Callable[..., torch.Tensor],
                            inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel(*inputs)` computed on one thread, then on two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(*inputs)
        torch.set_num_threads(2)
        two = kernel(*inputs)
    finally:
        torch.set_num_threads(threads)
    return one, two


def _agrees_on_one_and_two_threads(kernel: Callable[..., torch.Tensor],
                                   case: Sequence[torch.Tensor]) -> None:
    """The kernel's result meets the float64 reference (float32: within 1e-5; bf16: the
    reference rounded to bf16 but for an ulp at its size, or 2^-7 below 1), the same bits on
    one thread as on two."""
    got = kernel(*case)
    want = _per_request(*case)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:
        near = want.to(torch.bfloat16).float()
        ulp = torch.exp2(torch.floor(torch.log2(near.abs().clamp_min(1.0))) - 7)
        assert ((got.float() - near).abs() <= ulp).all()
    one, two = _on_one_and_two_threads(kernel, case)
    assert torch.equal(one, two)


def test_the_threads_split_the_work_not_the_result() -> None:
    kernel = _kernel(HK, D, G, torch.float32)
    one, two = _on_one_and_two_threads(kernel, _case(9, 90, torch.float32, 11))
    assert torch.equal(one, two)  # each (request, KV head) is computed whole by one thread


# a batch too small to give each thread several (request, KV head) tasks: each lone request's
# keys in pieces of 256 or more, whose softmax states are merged. One request (pieces uneven:
# 2,049 keys), peaked scores (a piece's maximum far below another's), a lone row too short to
# split beside a long one, a shared group beside a lone long row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_batch_splits_its_keys_and_agrees(dtype: torch.dtype) -> None:
    kernel = _kernel(HK, D, G, dtype)
    peaked = _case(1, 2049, dtype, 21, spread=40.0)
    peaked[1].mul_(torch.linspace(0.1, 3.0, peaked[1].shape[0])[:, None, None].to(dtype))
    short_and_long = _case(2, 700, dtype, 22)
    short_and_long[4][1] = 40
    cases = [peaked, short_and_long, _shared_case([(1, 0), (3, 64)], 500, dtype, 23)]
    for q, k_buf, v_buf, slots, lens in cases:
        got = kernel(q, k_buf, v_buf, slots, lens)
        want = _per_request(q, k_buf, v_buf, slots, lens)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        else:  # the float64 result rounded to bf16, met but for an ulp
            assert (got.float() - want.to(torch.bfloat16).float()).abs().max() <= 2 ** -7
    one, two = _on_one_and_two_threads(kernel, peaked)
    assert torch.equal(one, two)  # the pieces are the same on one thread as on two


# a lone request's KV heads in one task (up to 32 queries' worth: 10 heads of 3 queries), key
# after key over its heads' rows of each slot, where the batch gives the threads enough tasks:
# 8 requests (a task each, no pieces); one request of 2,049 keys (eight pieces, merged); four of
# 600 (two pieces each); 12 KV heads of 3 queries (a request's heads in a task of 10 and one of
# 2); 128-dim heads; in float32 and in bf16 (at 64 dims, its dot products of pairs); beside a
# shared group, whose heads stay a task each. The same on one thread and on two.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hk", "g", "d"), [(3, 3, 16), (3, 3, 64), (12, 3, 32), (2, 4, 128)])
def test_a_lone_requests_heads_in_one_task_agree(dtype: torch.dtype, hk: int, g: int,
                                                 d: int) -> None:
    kernel = _kernel(hk, d, g, dtype)
    seed = hk + g + d
    long_one = _case(1, 2049, dtype, seed, hk, g, d, spread=8.0)
    four = _case(4, 600, dtype, seed + 1, hk, g, d)
    four[4][:] = 600
    beside_a_group = _shared_case([(8, 0), (3, 64), (8, 0)], 150, dtype, seed + 2, hk, g, d)
    for case in (_case(8, 100, dtype, seed + 3, hk, g, d), long_one, four, beside_a_group):
        _agrees_on_one_and_two_threads(kernel, case)


# a lone group gives the threads a task per KV head only: its common keys are split into pieces
# (their states merged with its members' own keys'). Eight rows sharing 500 keys, one of them
# nothing but those (no keys of its own), with peaked scores; three rows sharing 1,000.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_group_splits_its_common_keys_and_agrees(dtype: torch.dtype) -> None:
    kernel = _kernel(HK, D, G, dtype)
    eight = _shared_case([(8, 500)], 700, dtype, 31)
    eight[0].mul_(20.0)
    eight[1].mul_(torch.linspace(0.1, 3.0, eight[1].shape[0])[:, None, None].to(dtype))
    eight[4][1] = 500
    three = _shared_case([(3, 1000)], 1100, dtype, 32)
    for case in (eight, three):
        _agrees_on_one_and_two_threads(kernel, case)


def test_paged_decode_builds_no_dense_kv_copy() -> None:
    kernel = _kernel(HK, D, G, torch.float32)
    batch, max_len = 16, 256
    q, k_buf, v_buf, slots, lens = _case(batch, max_len, torch.float32, 9)
    dense_bytes = batch * max_len * HK * D * 4  # what k_buf[slots] would allocate
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
        kernel(q, k_buf, v_buf, slots, lens)
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations, "the profiler saw no allocation at all (not even the output)"
    assert max(allocations) < dense_bytes / 4, (max(allocations), dense_bytes)
    # the plain ops do build it: the check would catch a kernel that gathers
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         profile_memory=True) as prof:
        paged_decode.paged_decode_reference(q, k_buf, v_buf, slots, lens)
    assert max(e.cpu_memory_usage for e in prof.events()) >= dense_bytes


def test_built_once_then_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library is compiled once per source, head sizes and machine; a second start finds
    it on disk without calling the compiler; other head sizes are a library of their own."""
    first = native_build.build(paged_decode.SOURCE, {"HEAD_DIM": 16, "GROUP": 2}, tmp_path)
    compiles: list[list[str]] = []
    real_run = subprocess.run

    def counted(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        if "-c" in command or "-shared" in command:
            compiles.append(command)
        return real_run(command, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(native_build.subprocess, "run", counted)
    again = native_build.build(paged_decode.SOURCE, {"HEAD_DIM": 16, "GROUP": 2}, tmp_path)
    assert again == first and not compiles
    other = native_build.build(paged_decode.SOURCE, {"HEAD_DIM": 32, "GROUP": 2}, tmp_path)
    assert other != first and len(compiles) == 2  # compile, then link
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_loading_it_leaves_the_float_mode_alone() -> None:
    """Compiled with finite, reordering float math, the library must not switch the process
    to flush-to-zero (a fast-math link does): torch's float32 results would change."""
    _kernel(2, 24, 3, torch.float32)
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a subnormal
    assert (tiny * 1.0).item() > 0.0


def test_no_compiler_means_dense_copies_and_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(paged_decode, "_libraries", {})
    monkeypatch.setattr(paged_decode, "_failed", None)
    monkeypatch.setenv("RAYDIX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger=paged_decode.logger.name):
        assert paged_decode.warm_up(HK, D, G, torch.float32) is None
    assert "no-such-compiler-here" in caplog.text and "dense" in caplog.text
    # the graphs' entry point then runs the plain ops, with the same result
    q, k_buf, v_buf, slots, lens = _case(3, 40, torch.float32, 2)
    assert not paged_decode.supports(q, k_buf, v_buf, slots, lens)
    torch.testing.assert_close(paged_decode.attend(q, k_buf, v_buf, slots, lens).double(),
                               _per_request(q, k_buf, v_buf, slots, lens), atol=1e-5, rtol=1e-5)


def test_inputs_it_does_not_serve_take_the_plain_ops() -> None:
    _kernel(HK, D, G, torch.float32)
    q, k_buf, v_buf, slots, lens = _case(3, 40, torch.float32, 4)
    assert paged_decode.supports(q, k_buf, v_buf, slots, lens)
    half = [t.half() for t in (q, k_buf, v_buf)]
    assert not paged_decode.supports(*half, slots, lens)  # no float16 kernel
    assert not paged_decode.supports(q, k_buf[:, :, :8], v_buf[:, :, :8], slots, lens)
    assert not paged_decode.supports(q, k_buf, v_buf, slots.int(), lens)
    assert paged_decode.warm_up(HK, D, G, torch.float16) is None
    got = paged_decode.attend(*half, slots, lens)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), _per_request(*half, slots, lens), atol=2e-3,
                               rtol=2e-3)


def test_inputs_out_of_contract_are_computed_right_or_not_by_the_kernel() -> None:
    """The operator never reads memory its inputs do not describe: a length past the slots'
    width counts the width (as the reference does), a pool of another dtype than the queries
    takes the reference (the kernel would read its bytes as the queries' dtype)."""
    kernel = _kernel(HK, D, G, torch.float32)
    q, k_buf, v_buf, slots, lens = _case(3, 40, torch.float32, 6)
    longer = lens.clone()
    longer[1] = 1000
    full = lens.clone()
    full[1] = slots.shape[1]
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, longer),
                               kernel(q, k_buf, v_buf, slots, full), atol=0, rtol=0)
    torch.testing.assert_close(kernel(q, k_buf, v_buf, slots, full).double(),
                               _per_request(q, k_buf, v_buf, slots, full), atol=1e-5, rtol=1e-5)
    qb = q.bfloat16()
    got = kernel(qb, k_buf, v_buf, slots, lens)  # bf16 queries, float32 pool
    torch.testing.assert_close(got.double(), _per_request(qb.float(), k_buf, v_buf, slots, lens),
                               atol=2e-2, rtol=2e-2)
