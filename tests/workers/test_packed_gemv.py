"""Products of a few rows on oneDNN's packed weights read in place
(workers/layers/packed_gemv.py), by each kernel this CPU runs (bf16: AMX tiles, 1-32 rows;
AVX-512-BF16's dot products, 1-128 rows; float32: AVX-512's FMAs, 1-8 rows, up to 32 as
measured at start): equal to oneDNN's product and to a product in a wider type of the same
values within the dtype's rounding; more rows stay with oneDNN; a layout the kernels do not read
is found and left to oneDNN; inside the runner, decode steps of one stream and of a batch take
them and give the tokens oneDNN's products give."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydix.workers import graph_head
from raydix.workers.config import WorkerConfig
from raydix.workers.layers import packed_gemv
from raydix.workers.layers.packed import pack_weight, packed_product
from raydix.workers.runner import ModelRunner
from raydix.workers.step import ScheduledRequest, StepPlan

from .conftest import TinyModel

needs_bf16 = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(),
                                reason="the bf16 packed-weight kernels need AVX-512-BF16")
needs_avx512 = pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                                  reason="the float32 packed-weight kernel needs AVX-512")


@pytest.fixture(params=["tiles", "dot products"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel this CPU runs: the tiles' where it has AMX, the dot products' (forced off
    the tiles here) everywhere with AVX-512-BF16."""
    assert packed_gemv.warm_up()
    if request.param == "tiles" and not packed_gemv._tiles:
        pytest.skip("no AMX tiles on this CPU (or not granted)")
    if request.param == "dot products":
        monkeypatch.setattr(packed_gemv, "_tiles", False)
    return str(request.param)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16's rounding of the largest output (two roundings of float32 sums)."""
    tolerance = 2 ** -7 * want.float().abs().amax().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=0)


@needs_bf16
@pytest.mark.parametrize(("out_features", "in_features", "batch_hint"),
                         [(960, 576, 64), (3072, 576, 1), (576, 1536, 64), (64, 96, 1),
                          (512, 64, 64)])
def test_equals_onednn_and_a_float32_product(out_features: int, in_features: int,
                                             batch_hint: int, kernel: str) -> None:
    weight = _bf16(out_features, in_features, seed=1)
    packed = pack_weight(weight, batch_hint)
    assert packed_gemv.register(packed) in packed_gemv.BLOCKS
    most = packed_gemv.max_rows()
    assert most == (packed_gemv.MAX_TILE_ROWS if kernel == "tiles" else packed_gemv.MAX_ROWS)
    calls = []
    real = packed_gemv._run
    try:
        packed_gemv._run = lambda *args: calls.append(args[0].shape[0]) or real(*args)  # type: ignore[assignment]
        # one and two rows; the dot products' passes of six, whole and partial, with fewer rows
        # than nine and from nine (where each pass also asks for the next block); the tiles'
        # group of 16 and a partial second one; the most
        for rows in sorted({1, 2, 3, 6, 7, 9, 16, 17, most, most + 1}):
            x = _bf16(rows, in_features, seed=rows)
            got = packed_product(x, packed, None)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            _close(got, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            _close(got, x.float() @ weight.float().T)
    finally:
        packed_gemv._run = real  # type: ignore[assignment]
    assert calls == sorted(r for r in {1, 2, 3, 6, 7, 9, 16, 17, most} if r <= most)  # more: oneDNN's


@needs_bf16
def test_a_layout_it_does_not_read_stays_with_onednn(monkeypatch: pytest.MonkeyPatch,
                                                    kernel: str) -> None:
    weight = _bf16(960, 576, seed=2)
    x = _bf16(1, 576, seed=3)
    odd = pack_weight(_bf16(100, 64, seed=4), 64)  # outputs not a multiple of a block
    assert packed_gemv.register(odd) == 0 and packed_gemv.block_of(odd) == 0
    packed = pack_weight(weight, 64)
    block = packed_gemv.register(pack_weight(weight, 64))
    # only the other block size on offer: its reading disagrees with oneDNN's, and is refused
    monkeypatch.setattr(packed_gemv, "BLOCKS", tuple(b for b in (32, 64) if b != block))
    assert packed_gemv.register(packed) == 0 and packed_gemv.block_of(packed) == 0
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert torch.equal(packed_product(x, packed, None), want)  # oneDNN's own


@needs_bf16
def test_an_entry_leaves_with_its_weight() -> None:
    packed = pack_weight(_bf16(64, 64, seed=5), 64)
    assert packed_gemv.register(packed)
    key = id(packed)
    assert key in packed_gemv._blocks
    del packed
    assert key not in packed_gemv._blocks


def _decode_with_and_without(runner: ModelRunner, prompts: list[list[int]],
                             monkeypatch: pytest.MonkeyPatch
                             ) -> tuple[int, tuple[list[list[int]], np.ndarray],
                                        tuple[list[list[int]], np.ndarray]]:
    """The streams decoded together for 8 steps with the kernels on, then off: the kernels'
    calls while on, and each run's greedy tokens and last step's logits (asserting that the
    kernels made no call while off)."""
    calls = []
    real = packed_gemv._run
    monkeypatch.setattr(packed_gemv, "_run", lambda *args: calls.append(1) or real(*args))
    page = runner.kv_pool.config.page_size
    slots = [list(range(page * (1 + 8 * i), page * (1 + 8 * i) + len(p) + 8))
             for i, p in enumerate(prompts)]

    def decode(enabled: bool) -> tuple[list[list[int]], np.ndarray]:
        """Greedy tokens of each stream, decoded together, and the last step's logits."""
        monkeypatch.setattr(packed_gemv, "ENABLED", enabled)
        logits = runner.forward(StepPlan.build(0, [
            ScheduledRequest(i, 0, p, s[:len(p)]) for i, (p, s) in enumerate(zip(prompts, slots, strict=True))]))
        tokens = [[int(row.argmax())] for row in logits]  # one row a request: its last token
        for step in range(1, 8):
            logits = runner.forward(StepPlan.build(step, [
                ScheduledRequest(i, len(p) + step - 1, [t[-1]], [s[len(p) + step - 1]])
                for i, (p, s, t) in enumerate(zip(prompts, slots, tokens, strict=True))]))
            for t, row in zip(tokens, logits, strict=True):
                t.append(int(row.argmax()))
        return tokens, logits.float().numpy()

    with_kernels = decode(True)
    num_calls = len(calls)
    calls.clear()
    without = decode(False)
    assert not calls
    return num_calls, with_kernels, without


@needs_bf16
@pytest.mark.parametrize("streams", [1, 3])
def test_decode_steps_go_through_it_as_through_onednn(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch, kernel: str,
        streams: int) -> None:
    m = tiny_models["llama"]
    monkeypatch.setattr(graph_head, "native_bf16", lambda: True)  # every bf16 layer packed
    runner = ModelRunner(WorkerConfig(str(m.folder), dtype="bfloat16", max_running_requests=4,
                                      max_context_len=256, max_total_tokens=1024,
                                      cpu_decode_graph=True))
    packed = [mod.packed_weight for mod in runner.model.modules()
              if getattr(mod, "packed_weight", None) is not None]
    assert packed, "no packed bf16 weight in this runner"
    assert any(packed_gemv.block_of(p) for p in packed)
    prompts = [list(p) for p in m.prompts[:streams]]
    calls, with_kernel, without = _decode_with_and_without(runner, prompts, monkeypatch)
    if streams <= packed_gemv.max_rows():
        assert calls, f"decode steps of {streams} rows did not take the {kernel} kernel"
    else:
        assert not calls  # more rows than the kernel takes: oneDNN's
    assert with_kernel[0] == without[0]
    np.testing.assert_allclose(with_kernel[1], without[1], atol=0.05, rtol=0.05)


# ----------------------------------------------------------------------------------- float32
def _f32(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_avx512
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(960, 576), (576, 1536), (192, 576), (64, 96), (128, 48)])
def test_float32_equals_onednn_and_a_float64_product(out_features: int, in_features: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 weight packed for more than one row: the kernel takes as many rows as
    `max_rows` gives (six at a time: whole and partial groups), within float32's sums of
    oneDNN's product and of a float64 one; more rows are oneDNN's."""
    assert packed_gemv.warm_up()
    monkeypatch.setattr(packed_gemv, "_f32_rows", packed_gemv.MAX_F32_ROWS)
    weight = _f32(out_features, in_features, seed=1)
    packed = pack_weight(weight, 64)
    assert packed_gemv.register(packed) == 64 and packed_gemv.max_rows(torch.float32) == 64
    calls = []
    real = packed_gemv._run
    try:
        packed_gemv._run = lambda *args: calls.append(args[0].shape[0]) or real(*args)  # type: ignore[assignment]
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 32, 47, 64, 65):
            x = _f32(rows, in_features, seed=rows)
            got = packed_product(x, packed, None)
            assert got.dtype == torch.float32 and got.shape == (rows, out_features)
            want = (x.double() @ weight.double().T)
            tolerance = 1e-6 * (x.double().abs() @ weight.double().abs().T).amax().item()
            torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=0)
            onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            torch.testing.assert_close(got, onednn, atol=tolerance, rtol=0)
    finally:
        packed_gemv._run = real  # type: ignore[assignment]
    assert calls == [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 32, 47, 64]


@needs_avx512
@pytest.mark.parametrize(("kernel_wins", "limit"),
                         [((True, True, True), 64), ((True, True, False), 32),
                          ((True, False, True), 16), ((False, True, True), 8)])
def test_float32_rows_as_measured(kernel_wins: tuple[bool, bool, bool], limit: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`tune_f32` lets the float32 kernel take up to the most rows of `F32_TUNE_ROWS` at which
    it and every smaller count timed faster than oneDNN, `F32_KNOWN_ROWS` at least; products
    follow the limit."""
    assert packed_gemv.warm_up()
    monkeypatch.setattr(packed_gemv, "_f32_rows", packed_gemv.F32_KNOWN_ROWS)
    assert packed_gemv.F32_TUNE_ROWS == (16, 32, 64) and packed_gemv.F32_KNOWN_ROWS == 8
    wins = dict(zip(packed_gemv.F32_TUNE_ROWS, kernel_wins, strict=True))
    timed = []

    def seconds(weights: list[torch.Tensor], rows: int) -> tuple[float, float]:
        timed.append(rows)
        return (1.0 if wins[rows] else 2.0), 1.5

    monkeypatch.setattr(packed_gemv, "_pass_seconds", seconds)
    packed = pack_weight(_f32(128, 64, seed=6), 64)
    assert packed_gemv.register(packed) == 64
    assert packed_gemv.tune_f32([packed]) == limit == packed_gemv.max_rows(torch.float32)
    lost = kernel_wins.index(False) if False in kernel_wins else len(kernel_wins) - 1
    assert timed == list(packed_gemv.F32_TUNE_ROWS[:lost + 1])  # stops at the first it loses
    x = _f32(limit + 1, 64, seed=7)
    assert packed_gemv.product(x[:limit], packed) is not None
    assert packed_gemv.product(x, packed) is None


@needs_avx512
def test_float32_tune_times_the_real_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpatched, `tune_f32` times both products on the weights the kernel reads (and only
    those) and settles on one of its limits; weights it does not read leave the limit alone."""
    assert packed_gemv.warm_up()
    monkeypatch.setattr(packed_gemv, "_f32_rows", packed_gemv.F32_KNOWN_ROWS)
    row_major = pack_weight(_f32(128, 64, seed=2), 1)
    assert packed_gemv.register(row_major) == 0
    assert packed_gemv.tune_f32([row_major]) == packed_gemv.F32_KNOWN_ROWS
    packed = [pack_weight(_f32(256, 128, seed=s), 64) for s in range(3)]
    assert all(packed_gemv.register(p) == 64 for p in packed)
    limit = packed_gemv.tune_f32(packed + [row_major])
    assert limit in (8, 16, 32, 64) and packed_gemv.max_rows(torch.float32) == limit


@needs_avx512
def test_float32_layouts_it_does_not_read_stay_with_onednn() -> None:
    """Packed for one row oneDNN keeps the weight row-major: read as blocks of 64 it disagrees
    with oneDNN's product and is refused; outputs not a multiple of 64 and inputs oneDNN pads
    (not a multiple of 16) are not tried; bf16 rows on a float32 weight are not taken."""
    assert packed_gemv.warm_up()
    row_major = pack_weight(_f32(128, 64, seed=2), 1)
    assert packed_gemv.register(row_major) == 0 and packed_gemv.block_of(row_major) == 0
    odd = pack_weight(_f32(100, 64, seed=3), 64)
    assert packed_gemv.register(odd) == 0
    padded = pack_weight(_f32(128, 40, seed=3), 64)
    assert packed_gemv.register(padded) == 0
    x = _f32(1, 64, seed=4)
    want = torch.ops.mkldnn._linear_pointwise(x, row_major, None, "none", [], "")
    assert torch.equal(packed_product(x, row_major, None), want)  # oneDNN's own
    packed = pack_weight(_f32(128, 64, seed=5), 64)
    assert packed_gemv.register(packed) == 64
    assert packed_gemv.product(x.to(torch.bfloat16), packed) is None


@needs_avx512
@pytest.mark.parametrize("streams", [1, 3])
def test_float32_decode_steps_go_through_it_as_through_onednn(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch,
        streams: int) -> None:
    """A float32 runner with the decode graph packs its layers here (`layers_packed`), and its
    decode steps' products take the kernel; the tokens are oneDNN's, the logits within float32's
    sums of them."""
    m = tiny_models["llama"]
    runner = ModelRunner(WorkerConfig(str(m.folder), dtype="float32", max_running_requests=4,
                                      max_context_len=256, max_total_tokens=1024,
                                      cpu_decode_graph=True))
    assert graph_head.layers_packed(torch.float32)
    linears = [mod for mod in runner.model.modules() if hasattr(mod, "packed_weight")]
    assert linears and all(mod.weight is None and mod.packed_weight is not None
                           for mod in linears)  # each packed weight its layer's only copy
    assert any(packed_gemv.block_of(mod.packed_weight) for mod in linears)
    prompts = [list(p) for p in m.prompts[:streams]]
    calls, with_kernel, without = _decode_with_and_without(runner, prompts, monkeypatch)
    assert calls, f"decode steps of {streams} float32 rows did not take the kernel"
    assert with_kernel[0] == without[0]
    np.testing.assert_allclose(with_kernel[1], without[1], atol=1e-4, rtol=1e-4)
