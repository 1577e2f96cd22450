"""One- and two-row bf16 products on oneDNN's packed weights read in place
(workers/layers/packed_gemv.py): equal to oneDNN's product and to a float32 product of the same
bf16 values within bf16's rounding; a layout the kernel does not read is found and left to
oneDNN; inside the runner, decode steps of one stream take it and give the tokens oneDNN's
products give."""

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
                                             batch_hint: int) -> None:
    weight = _bf16(out_features, in_features, seed=1)
    packed = pack_weight(weight, batch_hint)
    assert packed_gemv.register(packed) in packed_gemv.BLOCKS
    calls = []
    real = packed_gemv._run
    try:
        packed_gemv._run = lambda *args: calls.append(args[0].shape[0]) or real(*args)  # type: ignore[assignment]
        for rows in (1, 2, 3):
            x = _bf16(rows, in_features, seed=rows)
            got = packed_product(x, packed, None)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            _close(got, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            _close(got, x.float() @ weight.float().T)
    finally:
        packed_gemv._run = real  # type: ignore[assignment]
    assert calls == [1, 2]  # three rows take oneDNN's product


def test_a_layout_it_does_not_read_stays_with_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_one_stream_decodes_through_it_as_through_onednn(
        tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_models["llama"]
    monkeypatch.setattr(graph_head, "amx_tiles", lambda: True)  # every bf16 layer packed
    runner = ModelRunner(WorkerConfig(str(m.folder), dtype="bfloat16", max_running_requests=2,
                                      max_context_len=256, max_total_tokens=1024,
                                      cpu_decode_graph=True))
    packed = [mod.packed_weight for mod in runner.model.modules()
              if getattr(mod, "packed_weight", None) is not None]
    assert packed, "no packed bf16 weight in this runner"
    assert any(packed_gemv.block_of(p) for p in packed)
    calls = []
    real = packed_gemv._run
    monkeypatch.setattr(packed_gemv, "_run", lambda *args: calls.append(1) or real(*args))

    def decode(enabled: bool) -> tuple[list[int], np.ndarray]:
        """Greedy tokens of the first prompt, one stream, and the last step's logits."""
        monkeypatch.setattr(packed_gemv, "ENABLED", enabled)
        prompt = list(m.prompts[0])
        first = runner.kv_pool.config.page_size
        slots = list(range(first, first + len(prompt) + 8))
        logits = runner.forward(StepPlan.build(0, [ScheduledRequest(0, 0, prompt,
                                                                    slots[:len(prompt)])]))
        tokens = [int(logits[-1].argmax())]
        for step in range(1, 8):
            pos = len(prompt) + step - 1
            logits = runner.forward(StepPlan.build(step, [ScheduledRequest(
                0, pos, [tokens[-1]], [slots[pos]])]))
            tokens.append(int(logits[-1].argmax()))
        return tokens, logits.float().numpy()

    with_kernel = decode(True)
    assert calls, "one-row decode steps did not take the packed-weight kernel"
    calls.clear()
    without = decode(False)
    assert not calls
    assert with_kernel[0] == without[0]
    np.testing.assert_allclose(with_kernel[1], without[1], atol=0.05, rtol=0.05)
