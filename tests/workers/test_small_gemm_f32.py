"""The small-GEMM kernel's float32 path (workers/layers/small_gemm.c, AVX2 + FMA): products of a
few rows on a plain weight agree with a float64 reference within float32's rounding at every row
count, width and depth it takes (the blocks' and the lanes' tails included), split the work and
not the result between threads, and give way to the GEMM library's product past its rows and
wherever they do not serve."""

from __future__ import annotations

import pytest
import torch

from raydix.workers.layers import small_gemm
from raydix.workers.layers.packed import linear

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the float32 kernel needs AVX2 and FMA (this CPU has neither: oneDNN's product runs)")

MAX_ROWS = small_gemm.MAX_ROWS[torch.float32]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert small_gemm.warm_up(), "the small-GEMM kernel could not be built on this machine"
    assert small_gemm.computes(torch.float32)


@pytest.fixture(autouse=True)
def untuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel at its full rows, whatever an engine built earlier in this process measured
    (`small_gemm.tune`)."""
    monkeypatch.setattr(small_gemm, "_limits", {})


def _case(rows: int, out_features: int, in_features: int, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    return x, w


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# rows: the rows kernel's one, pair, and pair and one; the lanes kernel's chunks of 8 and 16
# rows, part-filled, and several of them, up to the limit; widths past the rows kernel's blocks
# of 4 weight rows and the lanes kernel's of 12 (and its halves of 6); depths past the 8-lane
# steps (a scalar tail)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 33, MAX_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (13, 70), (576, 576),
                                                           (9, 63), (576, 1536)])
def test_equals_the_product(rows: int, out_features: int, in_features: int) -> None:
    x, w = _case(rows, out_features, in_features, rows * 1000 + out_features)
    assert small_gemm.serves(x, w)  # the kernel, not the library's product
    _check(small_gemm.small_gemm(x, w), x, w)


def test_the_threads_split_the_work_not_the_result() -> None:
    x, w = _case(7, 203, 96, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_gemm.small_gemm(x, w)
        torch.set_num_threads(2)
        two = small_gemm.small_gemm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_more_rows_take_the_librarys_product() -> None:
    x, w = _case(MAX_ROWS + 1, 40, 64, 1)
    want = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    assert torch.equal(small_gemm.small_gemm(x, w), want)


def test_linear_takes_it_for_a_few_float32_rows_only() -> None:
    x, w = _case(3, 48, 64, 2)
    bias = torch.randn(48)
    assert small_gemm.serves(x, w)
    _check(linear(x, w, None), x, w)
    torch.testing.assert_close(linear(x, w, None, bias).double(),
                               x.double() @ w.double().T + bias.double(), atol=1e-5, rtol=1e-5)
    assert not small_gemm.serves(x.double(), w.double())  # float64: torch's product
    assert not small_gemm.serves(x, w.t().contiguous().t())  # a weight view: the library's
    assert not small_gemm.serves(x, w.bfloat16())  # mixed dtypes
    many, _ = _case(MAX_ROWS + 5, 48, 64, 4)
    with torch.profiler.profile() as prof:
        linear(many, w, None)  # eagerly, past the rows: oneDNN's product, not the operator
        linear(x, w, None)
    calls = [e.name for e in prof.events() if e.name == "raydix::small_gemm"]
    assert len(calls) == 1


@pytest.mark.parametrize(("kernel_ms", "expected"),
                         [((1.0, 1.0, 9.0), 8),  # wins at 2 and 8 rows, loses at 32
                          ((3.0, 1.0, 1.0), 0),  # loses at the fewest: never
                          ((1.0, 1.0, 1.0), MAX_ROWS)])  # wins at every count: its full rows
def test_tune_keeps_the_kernel_up_to_the_rows_it_won(
        monkeypatch: pytest.MonkeyPatch, kernel_ms: tuple[float, ...], expected: int) -> None:
    """`tune` times the kernel against the library's product on the model's weights and keeps it
    only up to the rows where it was faster; past them (or everywhere, at 0) the operator and
    `linear` take the library's product. The library takes 2 ms a pass here."""
    rows = small_gemm.TUNE_ROWS

    def timed(weights: list[torch.Tensor], n: int, kernel: bool) -> float:
        return (kernel_ms[rows.index(n)] if kernel else 2.0) / 1e3

    monkeypatch.setattr(small_gemm, "_pass_seconds", timed)
    _, w = _case(1, 24, 32, 0)
    assert small_gemm.tune([w, w.bfloat16()], torch.float32) == expected
    assert small_gemm.max_rows(torch.float32) == expected

    calls: list[int] = []
    kernel = small_gemm._kernel_product

    def counted(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, weight)

    monkeypatch.setattr(small_gemm, "_kernel_product", counted)
    for n in (1, 2, 8, 9, 32, MAX_ROWS):
        x, _ = _case(n, 24, 32, n)
        _check(small_gemm.small_gemm(x, w), x, w)
        _check(linear(x, w, None), x, w)
    assert sorted(set(calls)) == [n for n in (1, 2, 8, 9, 32, MAX_ROWS) if n <= expected]


def test_tune_times_the_real_products() -> None:
    """On real weights `tune` settles on one of the limits it can pick, and the operator keeps
    computing the product at every row count either way."""
    _, w = _case(1, 256, 128, 0)
    limit = small_gemm.tune([w] * 4, torch.float32)
    assert limit in (0, *small_gemm.TUNE_ROWS[:-1], MAX_ROWS)
    assert small_gemm.max_rows(torch.float32) == limit
    for n in (2, 16, MAX_ROWS):
        x, _ = _case(n, 256, 128, n)
        _check(small_gemm.small_gemm(x, w), x, w)
