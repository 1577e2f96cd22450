"""One request's decode step on CPU as one compiled graph (the CPU's counterpart of the CUDA
graphs of cuda_graph.py); steps of more requests run a batched graph where the dtype has one
(below), and eagerly otherwise.

A lone stream's decode step runs each linear layer on one input row. oneDNN and MKL compute
that product as a matrix product, at about half of this machine's memory bandwidth, and the ~50
small operators per layer cost host time each. Here the forward of one token is traced by
torch's own compiler (inductor) in a few graphs: runs of `LAYERS_PER_GRAPH` decoder layers
(one graph serves every run of a size) and the final norm with the LM head. Each linear layer
becomes a product written as multiply-and-sum (`layers/packed.py`: `linear` while compiling),
which inductor turns into one parallel, vectorised loop over the weight rows that reads each
weight once; the norms, rotary embedding, activation and residual adds fuse into a few loops;
attention reads the request's K/V from the pool's pages (`paged_decode_reference`, traced and
fused into the graph), and the new token's K/V is written into the pool in place by the same
compiled code (`index_copy_` traced; through the Python operator `raydix::store_kv` it cost a
call of 20-40 us a layer).

The graph reads the decoder layers' weights in their plain `[out, in]` layout, so a runner that
uses it keeps them plain (one copy) rather than oneDNN-packed, but in bf16 on a CPU with native
bf16 (AMX tiles or AVX-512-BF16), where every layer is packed and the graphs call oneDNN (or
the packed-weight kernel, layers/packed_gemv.py) on them (`graph_head.py`: `layers_packed`). In bf16 the LM head is packed in any case (`PACKED_HEAD_DTYPES`; the only
copy), and the graphs call oneDNN's product on it as one opaque operator
(`raydix::onednn_linear`): at several rows that
product is about twice as fast as the one on the plain weight, and at one row about as fast as
the multiply-and-sum. SmolLM2-135M, bf16, two threads, decode steps against the all-plain graph
in the same minutes (two runs): one request 16.4-16.8 ms against 17.4-17.6, four 30.2-32.4
against 32.3-36.3, sixteen 46.6-49.0 against 50.4-58.1. In fp32 the packed head lost one stream
on an AMD EPYC (`engine_bench.py --against`: 0.86-0.95x) and won on an Intel Xeon, so there the
runner times both at start (`graph_head.py`).

Models served: the Llama family (Llama, Qwen2/3, Mistral, Gemma, Phi-3) at tp 1 whose layers
are all plain (no sliding window, no logit soft cap, the default softmax scale); others run
eagerly, as `eligible` says.

Decode steps of two or more requests run a second graph (bf16 and fp32, `BATCHED_DTYPES`): the
same runs of layers traced for a batch whose size and key count are dynamic (one compile serves
every batch), its linear layers the products the eager step calls (the small-GEMM kernel up to 32
rows in bf16 and 16 in fp32 where the CPU computes the dtype, `layers/small_gemm.py`; past that,
or elsewhere, bf16: inductor's own call; fp32: oneDNN's, as `raydix::onednn_linear`, where
inductor would call MKL's sgemm, slower on AMD CPUs) and everything between them fused, attention the paged kernel on each
request's pages (the `raydix::paged_decode` operator, attention/paged_decode.py; where it could
not be built, its plain-ops source traced). A mixed workload's decode steps (SmolLM2-135M, two threads, mean of 112
steps of 1-16 requests) took 42-45 ms against 62 eagerly in bf16, 65-67 against 76-78 in fp32.

The graphs are compiled at start (`warm_up`); inductor keeps the compiled code in its on-disk
cache (`TORCHINDUCTOR_CACHE_DIR`), so a restart on the same machine loads it. The steps neither
graph takes (prompts) run the same runs of layers through the step graph (cpu_step_graph.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from .attention.base import ForwardBatch
from .attention.cascade import find_groups
from .attention.paged_decode import attend, paged_decode_reference
from .kv_pool import KVPool
from .layers.fused import TORCH_OPS
from .layers.rotary import RotaryEmbedding
from .models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def wanted(model: torch.nn.Module, kv_pool: str, tp_size: int) -> bool:
    """Whether the graph covers this rank's model; logs why not when it does not."""
    why_not = eligible(model, kv_pool, tp_size)
    if why_not:
        logger.info("CPU decode graph not used: %s", why_not)
    return why_not is None


def eligible(model: torch.nn.Module, kv_pool: str, tp_size: int) -> str | None:
    """None when `model` can decode through the graph with a `kv_pool` pool (WorkerConfig's
    setting); otherwise why not."""
    if tp_size != 1:
        return f"tp {tp_size} (the graph covers one rank)"
    if type(model).forward is not LlamaForCausalLM.forward or not isinstance(
            model, LlamaForCausalLM):
        return f"{type(model).__name__} is not of the Llama family"
    config = model.config
    if config.moe is not None or config.mla is not None:
        return "mixture-of-experts and MLA models are not covered"
    if kv_pool != "auto":
        return f"the {kv_pool} KV pool is not covered"
    if not all(a.is_plain(config.head_dim) for a in model.layer_attention()):
        return "a layer has a sliding window, a logit soft cap or its own softmax scale"
    return None


class _BatchAttention:
    """The attention backend a batched traced layer sees: request b's query token writes its
    K/V to `out_loc[b]` and attends to the first `lens[b]` of `slots[b]`."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, out_loc: torch.Tensor,
                 slots: torch.Tensor, lens: torch.Tensor, page_size: int) -> None:
        self.k_buf, self.v_buf = k_buf, v_buf
        self.out_loc, self.slots, self.lens, self.page_size = out_loc, slots, lens, page_size

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        TORCH_OPS.store_kv(self.k_buf, self.v_buf, self.out_loc, k, v, self.page_size)
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = self.k_buf.shape[1]
        qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        out = attend(qg, self.k_buf, self.v_buf, self.slots, self.lens)
        return out.reshape(batch, num_q_heads * head_dim)


class _OneRequestAttention:
    """The attention backend a traced layer sees: one query token, whose K/V goes to `out_loc`
    of this layer's buffers and which attends to the K/V at `slots` (all of them: the request's
    `[0, L)`). The layer id is not read: one compiled layer serves every layer."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, out_loc: torch.Tensor,
                 slots: torch.Tensor, page_size: int) -> None:
        self.k_buf, self.v_buf = k_buf, v_buf
        self.out_loc, self.slots, self.page_size = out_loc, slots, page_size

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        TORCH_OPS.store_kv(self.k_buf, self.v_buf, self.out_loc, k, v, self.page_size)
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = self.k_buf.shape[1]
        qg = q.view(1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        lens = torch.full((1,), self.slots.shape[1], dtype=torch.int64)
        # the plain ops, fused into the graph: one request's attention is small, and the paged
        # kernel as an opaque call in the graph cost a lone stream 8-9% (one stream 0.91-0.92x)
        out = paged_decode_reference(qg, self.k_buf, self.v_buf, self.slots, lens)
        return out.reshape(1, num_q_heads * head_dim)


def _layer_step(layer: torch.nn.Module, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, rope: RotaryEmbedding, k_buf: torch.Tensor,
                v_buf: torch.Tensor, out_loc: torch.Tensor, slots: torch.Tensor,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    attention = _OneRequestAttention(k_buf, v_buf, out_loc, slots, page_size)
    out: tuple[torch.Tensor, torch.Tensor] = layer(positions, hidden, residual, rope, attention)
    return out


def _layers_step(layers: list[torch.nn.Module], positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor, ropes: list[RotaryEmbedding], k_bufs: list[torch.Tensor],
                 v_bufs: list[torch.Tensor], out_loc: torch.Tensor, slots: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of consecutive decoder layers for one request (`layer_groups`)."""
    for layer, rope, k_buf, v_buf in zip(layers, ropes, k_bufs, v_bufs, strict=True):
        hidden, residual = _layer_step(layer, positions, hidden, residual, rope, k_buf, v_buf,
                                       out_loc, slots, page_size)
    return hidden, residual


def _batch_layer_step(layer: torch.nn.Module, positions: torch.Tensor, hidden: torch.Tensor,
                      residual: torch.Tensor | None, rope: RotaryEmbedding, k_buf: torch.Tensor,
                      v_buf: torch.Tensor, out_loc: torch.Tensor, slots: torch.Tensor,
                      lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    attention = _BatchAttention(k_buf, v_buf, out_loc, slots, lens, page_size)
    out: tuple[torch.Tensor, torch.Tensor] = layer(positions, hidden, residual, rope, attention)
    return out


def _batch_layers_step(layers: list[torch.nn.Module], positions: torch.Tensor,
                       hidden: torch.Tensor, residual: torch.Tensor, ropes: list[RotaryEmbedding],
                       k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor],
                       out_loc: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                       page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of consecutive decoder layers for a batch (`layer_groups`)."""
    for layer, rope, k_buf, v_buf in zip(layers, ropes, k_bufs, v_bufs, strict=True):
        hidden, residual = _batch_layer_step(layer, positions, hidden, residual, rope, k_buf,
                                             v_buf, out_loc, slots, lens, page_size)
    return hidden, residual


def _head_step(model: LlamaForCausalLM, hidden: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model.model.norm(hidden, residual)[0])


# two run sizes for each of the two layer graphs, the heads, and room for more models in one
# process (the tests)
RECOMPILE_LIMIT = 16

# Decode steps run their decoder layers this many to a call of a compiled graph
# (`layer_groups`): each call costs host time (dynamo's cache lookup, inductor's Python wrapper),
# about 0.2-0.3 ms on two cores, against a layer's 1 ms of kernels (SmolLM2-135M, float32, one
# request). In one process, alternating, five runs of 30 one-request steps each (ms a step): a
# layer a call 32.7-49.3 (median 40.1), 5 a call 30.1-42.1 (32.7), 10 30.1-38.6 (31.3), 15
# 30.0-38.6 (31.1), all 30 30.5-43.1 (33.9). Four requests through the batched graph, a layer a
# call against 10: float32 63.7-83.9 ms a step (median 68.1) against 59.0-66.4 (61.9), bf16
# 38.2-55.7 (52.5) against 35.2-48.2 (45.4). The compile grows with the run, and dynamo traces
# it at every start: an engine with both graphs (bf16) was built in 55.5 s on a cold inductor
# cache and 8.6-9.9 s from it with 5 a call, 63.0 and 13.5 s with 10, 70.7 and 12.7-15.5 with 15
# (a layer a call, float32: 34.7 and 8.7). 5 keeps most of the gain for about a second a start.
LAYERS_PER_GRAPH = 5

# Decode steps of up to this many requests run the one-request graph; larger ones the batched
# graph (where the dtype has one, `BATCHED_DTYPES`), else eagerly. Two requests ran the
# one-request graph once each until the batched graph took them faster: bf16, SmolLM2-135M, two
# threads, five pairs of runs, 26.9-32.4 ms a step against 32.0-33.9 (fp32, two pairs:
# 39.1-43.1 against 43.5-44.8).
MAX_REQUESTS = 1

# the batched graph's warm-up batch: 3 requests of 2 keys, sizes apart from all else, so that
# dynamo keeps the batch size and the key count as two sizes of their own
WARM_UP_BATCH = 3

# dtypes whose larger decode steps run the batched graph (see the module's docstring)
BATCHED_DTYPES = (torch.bfloat16, torch.float32)

# dtypes whose LM head is packed for oneDNN beside the plain decoder layers (the docstring);
# float32's is where `graph_head.packed_head_pays`
PACKED_HEAD_DTYPES = (torch.bfloat16,)

# Requests that share a long prefix decode faster eagerly: the eager backend's cascade reads the
# shared keys once per group (attention/cascade.py), the batched graph once per request (through
# the paged kernel). Past this many key reads saved a layer the eager step wins (bf16, two
# threads, SmolLM2-135M, mean decode step eagerly against through the graph: 48 requests on a
# 3,000-token prefix, 141,000 saved, 191 ms against 218; 32 on 2,000, 62,000 saved, 116 against
# 117; 8 groups of 8 on 512, 28,672 saved, 168 against 135; 4 groups of 4 on 512, 64 against 64).
CASCADE_KEYS_SAVED = 65_536


def layer_groups(num_layers: int, per_graph: int) -> list[range]:
    """The layers split into runs of at most `per_graph`, as even as can be: two sizes at most,
    so each layer graph compiles at most twice (30 layers by 5: six runs of 5)."""
    count = -(-num_layers // per_graph)
    size, longer = divmod(num_layers, count)
    groups, start = [], 0
    for i in range(count):
        stop = start + size + (i < longer)
        groups.append(range(start, stop))
        start = stop
    return groups


LayerRun = tuple[list[torch.nn.Module], list[RotaryEmbedding], list[torch.Tensor],
                 list[torch.Tensor]]


def layer_runs(model: LlamaForCausalLM, pool: KVPool) -> list[LayerRun]:
    """The runs of layers (`layer_groups`) as the lists each call of a layer graph passes:
    layers, their ropes, their K and V buffers. Marks the pool's slot dimension dynamic, so the
    graphs serve pools of any size (a process may hold several runners, as the tests do) and
    compile once for every graph's calls (dynamo guards on the marking), and raises dynamo's
    recompile limit to `RECOMPILE_LIMIT`."""
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        torch._dynamo.maybe_mark_dynamic(buf, 0)
    layers, ropes = list(model.model.layers), list(model.ropes)
    return [(layers[g.start:g.stop], ropes[g.start:g.stop], pool.k_buffers[g.start:g.stop],
             pool.v_buffers[g.start:g.stop])
            for g in layer_groups(len(layers), LAYERS_PER_GRAPH)]


def _as_warmed_up(batch: ForwardBatch) -> bool:
    """The step's input tensors are of the kind the warm-up's were (as the runner makes them):
    int64, one dimension, contiguous, at the start of their storage, inference tensors."""
    return all(t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous()
               and t.storage_offset() == 0 and t.is_inference()
               for t in (batch.input_ids, batch.positions, batch.out_cache_loc))


def _global_state() -> tuple[object, ...]:
    """What of torch's global state dynamo guards every graph on and a caller may change after
    the warm-up: a graph compiled for other values must not be run without its guards (with
    them skipped, dynamo raises where it would compile). The thread count is one: a process
    that calls `torch.set_num_threads` after the warm-up."""
    return (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled())


class CpuDecodeGraph:
    """Runs decode steps through the compiled layers: torch.compile inlines the modules, so
    their weights are inputs and layers of the same shape share the compiled code. A lone
    request's step runs its decoder layers in runs of up to `LAYERS_PER_GRAPH` (one graph a run
    size, at most two sizes), then the final norm and the LM head; with `batched`, larger steps
    run the batched graphs over the same runs."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, req_to_token: torch.Tensor,
                 batched: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.req_to_token = req_to_token
        self._groups = layer_runs(model, pool)
        self._layers: Any = torch.compile(_layers_step, dynamic=False, fullgraph=True)
        self._head: Any = torch.compile(_head_step, dynamic=False, fullgraph=True)
        self.skip_guards = False  # set by warm_up (see replay)
        self._warm_state: tuple[object, ...] = ()  # `_global_state()` in the warm-up
        # decode steps of more than MAX_REQUESTS: one graph, the batch dynamic; None: eager
        self._batch_layers: Any = (torch.compile(_batch_layers_step, dynamic=False,
                                                 fullgraph=True) if batched else None)
        self._batch_head: Any = (torch.compile(_head_step, dynamic=False, fullgraph=True)
                                 if batched else None)

    def can_run(self, batch: ForwardBatch) -> bool:
        size = batch.batch_size
        if size < 1 or not bool((batch.extend_lens == 1).all()):
            return False
        if not bool((batch.prefix_lens >= 1).all()):
            # a one-token prompt's token: one key, where the graphs were compiled for two or
            # more (dynamo specializes a dimension of size 1: the graph would compile again,
            # and after the warm-up, with the guards skipped, raise instead)
            return False
        if size <= MAX_REQUESTS:
            return True
        return self._batch_layers is not None and not self._cascade_pays(batch)

    def _cascade_pays(self, batch: ForwardBatch) -> bool:
        """The step's requests share enough prefix keys for the eager cascade to win."""
        lens = batch.prefix_lens + 1
        slots = self.req_to_token[torch.from_numpy(batch.row_idx), :int(lens.max())].numpy()
        saved = sum((len(members) - 1) * shared for members, shared in find_groups(slots, lens))
        return saved > CASCADE_KEYS_SAVED

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of the step's decode tokens: a lone request through the one-request
        graphs, more all at once through the batched graph.

        After the warm-up, steps whose inputs are of the kind it compiled for skip dynamo's
        guard checks (31 calls a step at about 55 us each: one stream 52 -> 57 tok/s, bf16, two
        threads): every graph a step can need exists by then (the tests run each path under
        `error_on_recompile`), and dynamo still checks the guards that tell its graphs apart
        (the first layer's from the others', one request's from a batch's). Other inputs take
        the guarded path, which compiles what they need, and so do all steps while torch's
        global state differs from the warm-up's (`_global_state`)."""
        if self.skip_guards and _as_warmed_up(batch) and _global_state() == self._warm_state:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._replay(batch)
        return self._replay(batch)

    def _replay(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size > MAX_REQUESTS:
            return self._replay_batch(batch)
        return self._replay_one(batch.input_ids, batch.positions, batch.out_cache_loc,
                                int(batch.row_idx[0]), int(batch.prefix_lens[0]))

    def _replay_one(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    out_loc: torch.Tensor, row: int, prefix_len: int) -> torch.Tensor:
        slots = self.req_to_token[row, :prefix_len + 1].long()[None]
        return self._run(input_ids, positions, out_loc, slots)

    def _replay_batch(self, batch: ForwardBatch) -> torch.Tensor:
        lens_np = batch.prefix_lens + 1
        slots = self.req_to_token[torch.from_numpy(batch.row_idx), :int(lens_np.max())].long()
        lens = torch.from_numpy(lens_np.astype(np.int64))
        input_ids, positions, out_loc = batch.input_ids, batch.positions, batch.out_cache_loc
        # one graph for every batch size (>= 3) and key count (>= 2)
        for tensor, dim in ((input_ids, 0), (positions, 0), (out_loc, 0), (slots, 0),
                            (slots, 1), (lens, 0)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        model, page_size = self.model, self.pool.config.page_size
        hidden = model.model.embed(input_ids)
        residual = torch.zeros_like(hidden)  # as in `_run`
        torch._dynamo.maybe_mark_dynamic(hidden, 0)
        torch._dynamo.maybe_mark_dynamic(residual, 0)
        for layers, ropes, k_bufs, v_bufs in self._groups:
            hidden, residual = self._batch_layers(layers, positions, hidden, residual, ropes,
                                                  k_bufs, v_bufs, out_loc, slots, lens, page_size)
        logits: torch.Tensor = self._batch_head(model, hidden, residual)
        return logits

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
        # one graph for every number of keys (>= 2: a decode token follows one at least)
        torch._dynamo.maybe_mark_dynamic(slots, 1)
        model, page_size = self.model, self.pool.config.page_size
        hidden = model.model.embed(input_ids)
        # the first layer's residual is zero rather than none, so that its run is the others'
        # graph: x + 0 is x exactly, and the norm sees the same input
        residual = torch.zeros_like(hidden)
        for layers, ropes, k_bufs, v_bufs in self._groups:
            hidden, residual = self._layers(layers, positions, hidden, residual, ropes, k_bufs,
                                            v_bufs, out_loc, slots, page_size)
        logits: torch.Tensor = self._head(model, hidden, residual)
        return logits

    def warm_up(self) -> float:
        """Compile (or load from inductor's cache) before serving; returns the seconds taken.
        The inputs are made as the runner makes a step's (host arrays viewed as tensors, the
        slots read from the request table inside inference mode): dynamo guards on how a
        tensor was made, and a warm-up with other tensors would leave the first real steps to
        compile again. Reads row 0 of the table and writes only the padding page's slot 0."""
        start = time.perf_counter()
        sizes = (1, WARM_UP_BATCH) if self._batch_layers is not None else (1,)
        for size in sizes:
            zero = np.zeros(size, dtype=np.int64)
            with torch.inference_mode():  # as runner.forward: its tensors are inference tensors
                self.replay(ForwardBatch(row_idx=zero, prefix_lens=zero + 1,
                                         extend_lens=zero + 1,
                                         input_ids=torch.from_numpy(zero.copy()),
                                         positions=torch.from_numpy(zero + 1),
                                         out_cache_loc=torch.from_numpy(zero.copy())))
                self._warm_state = _global_state()  # as the runner's steps see it
        self.skip_guards = True
        return time.perf_counter() - start
