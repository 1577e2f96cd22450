"""Few kernels per layer on the CUDA path, counted on the CPU.

A small bfloat16 Llama runs one decode step as the CUDA path builds it: the fused-op seam's
`raydix::` operators (their CPU kernels), the flashinfer backend's own `forward` (the K/V write
through the seam, then one paged-attention call, here a stand-in operator). A dispatch mode
counts what each decoder layer launches (workers/op_census.py): the GEMMs, attention and one
operator per fused step must stay within the budget. Unfusing a step (the plain torch RMSNorm
or rotary) must break it, which the last test checks.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from raydix.workers.attention.base import ForwardBatch
from raydix.workers.attention.flashinfer_backend import FlashInferAttentionBackend
from raydix.workers.config import ModelConfig
from raydix.workers.kv_pool import KVPool, KVPoolConfig
from raydix.workers.layers import small_gemm
from raydix.workers.layers.custom_ops import CustomOps
from raydix.workers.layers.fused import TORCH_OPS, FusedOps, fused_ops_for
from raydix.workers.models import LlamaForCausalLM, build_model
from raydix.workers.op_census import OpCensus, describe, op_census
from raydix.workers.parallel import SINGLE_RANK

BUDGET = 15  # operators per decoder layer of a decode step (the target on an H100)
LAYERS, PAGE = 3, 4

_LIB = torch.library.Library("raydix_test", "DEF")
_LIB.define("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache) -> Tensor")
_LIB.impl("paged_attention", lambda q, k, v: torch.zeros(q.shape, dtype=q.dtype), "CPU")


@pytest.fixture(autouse=True)
def cuda_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The products as the CUDA path launches them: torch's linear (the CPU's small-GEMM kernel
    for a few bf16 rows, built by another test in this process, never runs on CUDA)."""
    monkeypatch.setattr(small_gemm, "_library", None)


class _Wrapper:
    """flashinfer's decode wrapper, as one operator: only what gets launched matters here."""

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = torch.ops.raydix_test.paged_attention(q, *kv)
        return out


class CPUFlashInferBackend(FlashInferAttentionBackend):
    """The flashinfer backend's per-layer `forward`, on the CPU: no flashinfer import, and the
    wrapper planned for the step replaced by `_Wrapper`."""

    def __init__(self, pool: KVPool, num_q_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.num_kv_heads = pool.config.num_kv_heads
        self.page_size = pool.config.page_size
        self.layer_kind = [0] * pool.config.num_layers
        self._wrappers = [_Wrapper()]
        self._out_cache_loc = None

    def prepare(self, batch: ForwardBatch) -> None:  # planning is host work, not launched
        self._out_cache_loc = batch.out_cache_loc.to(torch.int32)


def _small_llama(ops: FusedOps) -> tuple[LlamaForCausalLM, CPUFlashInferBackend]:
    hf = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256)
    raw = hf.to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    config = ModelConfig.from_dict(raw)
    torch.manual_seed(0)
    model = build_model(config, SINGLE_RANK)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model = model.to(torch.bfloat16).eval()
    model.init_buffers("cpu")
    model.use_fused_ops(ops)
    pool = KVPool(KVPoolConfig(16, PAGE, LAYERS, 2, config.head_dim, torch.bfloat16), "cpu")
    pool.ops = ops
    return model, CPUFlashInferBackend(pool, 4, config.head_dim)


def decode_census(ops: FusedOps, batch: int = 3) -> OpCensus:
    model, backend = _small_llama(ops)
    seq_lens = np.array([5, 9, 2][:batch], dtype=np.int64)
    fb = ForwardBatch(row_idx=np.arange(batch), prefix_lens=seq_lens - 1,
                      extend_lens=np.ones(batch, np.int64),
                      input_ids=torch.tensor([7, 8, 9][:batch]),
                      positions=torch.from_numpy(seq_lens - 1),
                      out_cache_loc=torch.tensor([5, 13, 22][:batch]))
    backend.prepare(fb)
    with torch.inference_mode(), op_census(model.model.layers) as census:
        hidden = model(fb.input_ids, fb.positions, backend)  # what the CUDA graph captures
        model.compute_logits(hidden)
    return census


def test_fused_decode_layer_is_within_budget() -> None:
    census = decode_census(fused_ops_for("fused"))
    report = describe(census)
    assert all(n <= BUDGET for n in census.per_layer()), report
    # four GEMMs (qkv, o, gate_up, down: one linear each), two fused add+norms, rope, the
    # K/V write, attention, SiLU*up; layer 0 norms its input without a residual to add
    gemms = Counter({"aten.linear": 4})
    fused = Counter({"raydix.rope": 1, "raydix.store_kv": 1, "raydix_test.paged_attention": 1,
                     "raydix.act_and_mul": 1})
    for i, layer in enumerate(census.layers):
        norms = Counter({"raydix.rmsnorm": 1, "raydix.add_rmsnorm": 1} if i == 0
                        else {"raydix.add_rmsnorm": 2})
        assert layer == gemms + fused + norms, report
    # the embedding, the final add+norm, the head
    assert census.outside == Counter({"aten.embedding": 1, "raydix.add_rmsnorm": 1,
                                      "aten.linear": 1}), report


class _PartlyUnfused(CustomOps):
    """The fused ops with one step swapped for its plain torch code."""

    def __init__(self, step: str) -> None:
        setattr(self, step, getattr(TORCH_OPS, step))


@pytest.mark.parametrize("step", ["add_rmsnorm", "rope"])
def test_an_unfused_step_breaks_the_budget(step: str) -> None:
    census = decode_census(_PartlyUnfused(step))
    assert max(census.per_layer()) > BUDGET, describe(census)


def test_the_plain_torch_path_is_counted_op_by_op() -> None:
    """The CPU's path (plain torch) is not what the budget is for: it shows every elementwise
    operator, which is what the census must see to catch an unfused step."""
    census = decode_census(TORCH_OPS)
    assert min(census.per_layer()) > 2 * BUDGET, describe(census)
