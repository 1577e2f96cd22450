"""The small-GEMM kernel (workers/layers/small_gemm.c): bf16 products of a few rows on a plain
weight agree with a float64 reference within bf16's rounding at every row count, width and
depth it takes (its blocks' tails included), split the work and not the result between
threads, and give way to torch's product past MAX_ROWS rows and wherever they do not serve."""

from __future__ import annotations

import pytest
import torch

from raydix.workers.cpu_features import native_bf16
from raydix.workers.layers import small_gemm
from raydix.workers.layers.packed import linear

pytestmark = pytest.mark.skipif(
    not (native_bf16() and torch.cpu._is_avx512_bf16_supported()),
    reason="the kernel needs AVX-512 BF16 (this CPU has none: torch's product runs instead)")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert small_gemm.warm_up(), "the small-GEMM kernel could not be built on this machine"


@pytest.fixture(autouse=True)
def untuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel at its full rows, whatever an engine built earlier in this process measured
    (`small_gemm.tune`)."""
    monkeypatch.setattr(small_gemm, "_limits", {})


def _case(rows: int, out_features: int, in_features: int, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).bfloat16()
    return x, w


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # float32 sums of exact bf16 products, one rounding to bf16: within an ulp or two of bf16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1.6e-2)


# rows: the rows kernel (1-4), the lanes kernel (5+, chunks of 16 rows and a partial one);
# widths past the blocks of 4 and 8 weight rows; depths past the blocks of 32 (and an odd one,
# which the lanes kernel's k pairs cannot take: the rows kernel then takes every row)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 32])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (13, 70), (576, 576),
                                                           (9, 63)])
def test_equals_the_product(rows: int, out_features: int, in_features: int) -> None:
    x, w = _case(rows, out_features, in_features, rows * 1000 + out_features)
    _check(small_gemm.small_gemm(x, w), x, w)


def test_matches_torch_bf16_product_closely() -> None:
    """Against torch's own bf16 product (float32 sums, one rounding): the same to within one bf16
    ulp almost everywhere."""
    x, w = _case(16, 3072, 576, 7)
    got, ref = small_gemm.small_gemm(x, w).float(), torch.mm(x, w.t()).float()
    ulp = ref.abs().clamp_min(1e-3) * 2 ** -7
    assert ((got - ref).abs() <= ulp).float().mean() > 0.99


def test_the_threads_split_the_work_not_the_result() -> None:
    x, w = _case(6, 200, 96, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_gemm.small_gemm(x, w)
        torch.set_num_threads(2)
        two = small_gemm.small_gemm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_more_rows_take_torchs_product() -> None:
    x, w = _case(small_gemm.MAX_ROWS[torch.bfloat16] + 1, 40, 64, 1)
    assert torch.equal(small_gemm.small_gemm(x, w), torch.mm(x, w.t()))


def test_linear_takes_it_for_a_few_bf16_rows_only() -> None:
    x, w = _case(3, 48, 64, 2)
    bias = torch.randn(48).bfloat16()
    assert small_gemm.serves(x, w)
    _check(linear(x, w, None), x, w)
    torch.testing.assert_close(linear(x, w, None, bias).double(),
                               (x.double() @ w.double().T + bias.double()), atol=3e-2, rtol=2e-2)
    assert not small_gemm.serves(x, w.float())  # two dtypes: torch's product
    assert not small_gemm.serves(x, w.t().contiguous().t())  # a weight view: torch's
    many, _ = _case(small_gemm.MAX_ROWS[torch.bfloat16] + 5, 48, 64, 4)
    with torch.profiler.profile() as prof:
        linear(many, w, None)  # eagerly, past MAX_ROWS: torch's product, not the operator
        linear(x, w, None)
    calls = [e.name for e in prof.events() if e.name == "raydix::small_gemm"]
    assert len(calls) == 1


def test_the_operator_never_runs_the_kernel_on_what_it_does_not_serve() -> None:
    x, w = _case(3, 40, 64, 9)
    with pytest.raises(RuntimeError):  # torch's product names the shapes
        small_gemm.small_gemm(x, w[:, :32].contiguous())
    got = small_gemm.small_gemm(x.float(), w.float())  # float32: torch's product
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ w.float().T)
