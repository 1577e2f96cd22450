"""The CPU steps that the decode graphs (cpu_decode_graph.py) do not take, a prompt's tokens
above all, with everything between the products compiled: the norms with their residual adds,
the rotary embedding, SiLU times the up-projection, the K/V write into the pool.

Eagerly a decoder layer is about fifty torch operators, each a pass over the step's
activations and a few to a few tens of microseconds of host time: on two cores, a lone
512-token prompt of SmolLM2-135M in bf16 spent about 80 ms in them beside 86 ms in its 120
products (torch.profiler), and a 64-token chunk after a cached prefix more in their host time
than in its products. Here the same layer code is traced by torch's compiler (inductor) in the
runs of layers the decode graphs use (`layer_groups`), for any number of tokens (one compile
serves every step), with the products the eager step calls (`layers/packed.py`) and the step's
attention as one opaque operator (`raydix::step_attention`): the eager backend's, prepared for
the step as before (`TorchAttentionBackend.prepare`: decode tokens on the pages, cascades,
prompts in row blocks), so a step of prompts and decode tokens together runs as one.

Models served: those the decode graph serves (`cpu_decode_graph.eligible`: the Llama family at
tp 1, plain layers, the default pool), with the torch attention backend, in bf16 and float32
(`STEP_DTYPES`). Steps of a single
token run eagerly (dynamo would specialize a dimension of size one).

Compiled at start (`warm_up`) and cached on disk by inductor as the decode graphs are.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .attention.base import ForwardBatch, LayerAttention
from .attention.torch_backend import TorchAttentionBackend
from .cpu_decode_graph import layer_runs
from .kv_pool import KVPool
from .layers.fused import TORCH_OPS
from .layers.rotary import RotaryEmbedding
from .models.llama import LlamaForCausalLM

# steps of fewer tokens run eagerly (see the docstring)
MIN_TOKENS = 2
# the tokens of the prompt that compiles the graph: inductor sizes its loops' threads by the
# sizes it traced (a loop over too few elements for two threads' chunks runs on one), so a
# three-token trace left a prompt's rotary embedding and K/V write on one thread (390 us a
# layer for 512 tokens); 64 tokens make every loop over the tokens parallel
WARM_UP_TOKENS = 64

# dtypes whose prompt steps run the step graph. `benchmarks/path_bench.py --path step-graph` (SmolLM2-135M,
# two threads, four rounds, step graph / eager, median and range): on an Intel Xeon with AMX,
# bf16 TTFT of a lone 512-token prompt 0.82x (0.76-0.84), shared prefix 1.10x (1.04-1.12), mixed
# 1.30x (1.01-1.80); float32 TTFT 0.95x (0.91-0.99), shared prefix 1.04x (0.93-1.08), mixed
# 0.92x (0.84-1.14). On an AMD EPYC Zen 5, float32 with its prompt attention in the kernel
# (attention/extend_kernel.py), two runs: TTFT 0.91x (0.85-0.99) and 0.89x (0.84-0.92), shared
# prefix 1.05x (0.95-1.18) and 1.05x (1.01-1.07), mixed 1.14x (1.09-1.39) and 1.02x (1.01-1.25);
# so float32 takes it too, for about 3 s more at a start (dynamo's trace; inductor's code is
# cached on disk)
STEP_DTYPES = (torch.bfloat16, torch.float32)


def serves(dtype: torch.dtype) -> bool:
    """Whether a runner in `dtype` runs its prompt steps through the step graph."""
    return dtype in STEP_DTYPES


class _Active:
    """The backend prepared for the step being run, which `raydix::step_attention` calls."""

    backend: TorchAttentionBackend | None = None
    layer: LayerAttention = LayerAttention()


_ACTIVE = _Active()


@torch.library.custom_op("raydix::step_attention", mutates_args=())
def step_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
    """The running step's attention for one layer (`TorchAttentionBackend.attend`), whose new
    K/V the compiled code has written into `k_buf`/`v_buf`: q [T, Hq, D] -> [T, Hq * D]."""
    backend = _ACTIVE.backend
    if backend is None:
        raise RuntimeError("raydix::step_attention called outside a CPU step graph's step")
    return backend.attend(q, k_buf, v_buf, _ACTIVE.layer)


@step_attention.register_fake
def _(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class _StepAttention:
    """The attention backend a traced layer sees: writes the step's new K/V at `out_loc` of
    this layer's buffers, then calls the step's prepared backend on them. The layer id is not
    read: one compiled run serves every run of its size."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, out_loc: torch.Tensor,
                 page_size: int) -> None:
        self.k_buf, self.v_buf, self.out_loc, self.page_size = k_buf, v_buf, out_loc, page_size

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        TORCH_OPS.store_kv(self.k_buf, self.v_buf, self.out_loc, k, v, self.page_size)
        out: torch.Tensor = torch.ops.raydix.step_attention(q, self.k_buf, self.v_buf)
        return out


def _step_layers(layers: list[torch.nn.Module], positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor, ropes: list[RotaryEmbedding], k_bufs: list[torch.Tensor],
                 v_bufs: list[torch.Tensor], out_loc: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of consecutive decoder layers over a step's tokens."""
    for layer, rope, k_buf, v_buf in zip(layers, ropes, k_bufs, v_bufs, strict=True):
        attention = _StepAttention(k_buf, v_buf, out_loc, page_size)
        hidden, residual = layer(positions, hidden, residual, rope, attention)
    return hidden, residual


class CpuStepGraph:
    """Runs a step's decoder layers through the compiled runs; the runner prepares the backend
    and computes the logits as for an eager step."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool,
                 backend: TorchAttentionBackend) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        self._groups = layer_runs(model, pool)  # the decode graphs' runs of layers
        self._layers: Any = torch.compile(_step_layers, dynamic=False, fullgraph=True)
        self._layer = backend.layers[0]  # every layer is plain (`eligible`)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens >= MIN_TOKENS

    def forward(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states of the step's tokens at `rows` (those sampled; the final
        norm, row by row, runs on them alone); the backend is prepared for `batch`."""
        positions, out_loc = batch.positions, batch.out_cache_loc
        model, page_size = self.model, self.pool.config.page_size
        hidden = model.model.embed(batch.input_ids)
        residual = torch.zeros_like(hidden)  # as the decode graph's first layer: x + 0 is x
        for tensor in (positions, out_loc, hidden, residual):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        _ACTIVE.backend, _ACTIVE.layer = self.backend, self._layer
        try:
            for layers, ropes, k_bufs, v_bufs in self._groups:
                hidden, residual = self._layers(layers, positions, hidden, residual, ropes,
                                                k_bufs, v_bufs, out_loc, page_size)
        finally:
            _ACTIVE.backend = None
        out: torch.Tensor = model.model.norm(hidden[rows], residual[rows])[0]
        return out

    def warm_up(self) -> float:
        """Compile (or load from inductor's cache) before serving; returns the seconds taken.
        Runs a prompt of `WARM_UP_TOKENS` (at most the table's row) on row 0 of the table whose
        K/V go to the padding page's slot 0, the inputs made as the runner makes a step's."""
        start = time.perf_counter()
        tokens = min(WARM_UP_TOKENS, self.backend.req_to_token.shape[1])
        zero = np.zeros(1, dtype=np.int64)
        with torch.inference_mode():  # as runner.forward: its tensors are inference tensors
            batch = ForwardBatch(
                row_idx=zero, prefix_lens=zero.copy(), extend_lens=zero + tokens,
                input_ids=torch.from_numpy(np.zeros(tokens, dtype=np.int64)),
                positions=torch.from_numpy(np.arange(tokens, dtype=np.int64)),
                out_cache_loc=torch.from_numpy(np.zeros(tokens, dtype=np.int64)))
            self.backend.prepare(batch)
            self.forward(batch, torch.tensor([tokens - 1]))
        return time.perf_counter() - start
