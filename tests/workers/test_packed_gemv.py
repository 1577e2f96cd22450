"""bf16 products of a few rows on oneDNN's packed weights read in place
(workers/layers/packed_gemv.py), by each kernel this CPU runs (AMX tiles, 1-32 rows;
AVX-512-BF16's dot products, 1-128 rows): equal to oneDNN's product and to a float32 product of the
same bf16 values within bf16's rounding; more rows stay with oneDNN; a layout the kernels do not
read is found and left to oneDNN; inside the runner, decode steps of one stream and of a batch
take them and give the tokens oneDNN's products give."""

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

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(),
                                reason="the packed-weight kernel needs AVX-512-BF16")


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
        # one and two rows; the dot products' groups of four, whole and partial (6: 4 + 2), the
        # tiles' group of 16 and a partial second one; the most
        for rows in sorted({1, 2, 3, 6, 16, 17, most, most + 1}):
            x = _bf16(rows, in_features, seed=rows)
            got = packed_product(x, packed, None)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            _close(got, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            _close(got, x.float() @ weight.float().T)
    finally:
        packed_gemv._run = real  # type: ignore[assignment]
    assert calls == sorted(r for r in {1, 2, 3, 6, 16, 17, most} if r <= most)  # more: oneDNN's


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


def test_an_entry_leaves_with_its_weight() -> None:
    packed = pack_weight(_bf16(64, 64, seed=5), 64)
    assert packed_gemv.register(packed)
    key = id(packed)
    assert key in packed_gemv._blocks
    del packed
    assert key not in packed_gemv._blocks


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
    calls = []
    real = packed_gemv._run
    monkeypatch.setattr(packed_gemv, "_run", lambda *args: calls.append(1) or real(*args))
    prompts = [list(p) for p in m.prompts[:streams]]
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

    with_kernel = decode(True)
    if streams <= packed_gemv.max_rows():
        assert calls, f"decode steps of {streams} rows did not take the {kernel} kernel"
    else:
        assert not calls  # more rows than the kernel takes: oneDNN's
    calls.clear()
    without = decode(False)
    assert not calls
    assert with_kernel[0] == without[0]
    np.testing.assert_allclose(with_kernel[1], without[1], atol=0.05, rtol=0.05)
