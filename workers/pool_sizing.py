"""How many KV tokens fit: the `mem_fraction_static` rule of SGLang's `profile_max_num_token`.

    rest     = min over ranks of free memory after weights - (1 - mem_fraction_static) * total
    tokens   = rest // cell_size, aligned down to page_size, capped by max_total_tokens
    cell     = kv_heads_per_rank * head_dim * num_layers * 2 (K and V) * dtype_bytes
    cell     = (kv_lora_rank + qk_rope_head_dim) * num_layers * dtype_bytes   (MLA: one latent,
               the same on every rank)

`mem_fraction_static` is the share of total memory for weights + KV pool; the remainder is kept
free for activations. That remainder is a floor, not a guess: `estimate_headroom` counts what the
largest step needs beside the pool (its activations, the CUDA graphs' memory pool, the attention
workspace), and when that is more, it is kept instead:

    rest     = min free - max((1 - mem_fraction_static) * total, headroom.total)

The pure functions take made-up readings in tests; `ModelRunner` feeds them real ones (the free
memory of every rank, from `torch.cuda.mem_get_info` on CUDA, gathered over the group).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig, WorkerConfig
    from .parallel import HeadShard

logger = logging.getLogger(__name__)

IMBALANCE_RATIO = 0.9  # warn when a rank has less than 90% of another rank's free memory
ALLOCATOR_SLACK = 1.5  # the caching allocator's rounding and fragmentation over exact sizes
CUDA_RUNTIME_BYTES = 256 << 20  # cuBLAS workspaces and other lazily made CUDA state
LOGITS_BYTES_PER_VALUE = 16  # logits in the model dtype, fp32 copy, probabilities, noise


@dataclass(frozen=True)
class ForwardShape:
    """What sets a step's memory beside the weights and the KV pool, on one rank."""

    hidden_size: int
    intermediate_per_rank: int
    qkv_per_rank: int  # (q heads + 2 kv heads) * head_dim on this rank
    vocab_size: int
    dtype_bytes: int
    max_batch_tokens: int  # the most tokens one step computes (prompt chunk + decodes)
    max_batch: int  # the most requests one step samples
    graph_max_batch: int  # largest CUDA-graph batch; 0 without graphs
    workspace_bytes: int  # attention backend workspace (flashinfer); 0 for torch
    on_cuda: bool


@dataclass(frozen=True)
class Headroom:
    """Bytes kept free beside the KV pool, by cause."""

    activations: int  # the largest eager step
    cuda_graphs: int  # the graphs' shared memory pool (sized by the largest graph)
    workspace: int  # attention workspace and CUDA runtime state

    @property
    def total(self) -> int:
        return self.activations + self.cuda_graphs + self.workspace


def estimate_headroom(shape: ForwardShape) -> Headroom:
    """Peak bytes a step allocates beside the pool: per token, a layer holds the residual and
    hidden states, the fp32 norm, q/k/v, and the MLP's gate/up, activation and down outputs;
    the LM head runs on one token per request."""
    per_token = (shape.dtype_bytes * (6 * shape.hidden_size + shape.qkv_per_rank
                                      + 3 * shape.intermediate_per_rank)
                 + 4 * 2 * shape.hidden_size)

    def step_bytes(num_tokens: int, num_requests: int) -> int:
        logits = num_requests * shape.vocab_size * LOGITS_BYTES_PER_VALUE
        return int(ALLOCATOR_SLACK * (num_tokens * per_token + logits))

    graphs = step_bytes(shape.graph_max_batch, shape.graph_max_batch) if shape.graph_max_batch else 0
    runtime = CUDA_RUNTIME_BYTES if shape.on_cuda else 0
    return Headroom(activations=step_bytes(shape.max_batch_tokens, shape.max_batch),
                    cuda_graphs=graphs, workspace=shape.workspace_bytes + runtime)


def kv_cell_size(kv_heads_per_rank: int, head_dim: int, num_layers: int, dtype_bytes: int) -> int:
    """Bytes of KV one token takes on one rank."""
    return kv_heads_per_rank * head_dim * num_layers * 2 * dtype_bytes


def mla_cell_size(latent_dim: int, num_layers: int, dtype_bytes: int) -> int:
    """Bytes of latent one token takes on every rank: `latent_dim` is
    kv_lora_rank + qk_rope_head_dim (no separate K and V, no head split)."""
    return latent_dim * num_layers * dtype_bytes


def profile_max_num_tokens(free_bytes_per_rank: Sequence[int], total_bytes: int,
                           mem_fraction_static: float, cell_size: int, page_size: int,
                           max_total_tokens: int | None = None,
                           headroom: Headroom | None = None) -> int:
    """The KV pool capacity in tokens (a multiple of `page_size`, padding page not included).

    `free_bytes_per_rank` is read after the weights are loaded. Raises ValueError when nothing
    fits, saying to raise `mem_fraction_static`.
    """
    if not free_bytes_per_rank:
        raise ValueError("need the free memory of at least one rank")
    if cell_size <= 0 or page_size <= 0:
        raise ValueError(f"cell_size ({cell_size}) and page_size ({page_size}) must be positive")
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    _warn_imbalance(free_bytes_per_rank)
    min_free = min(free_bytes_per_rank)
    by_fraction = (1.0 - mem_fraction_static) * total_bytes
    needed = headroom.total if headroom is not None else 0
    reserve = max(by_fraction, needed)
    rest = min_free - reserve
    num_tokens = int(rest // cell_size) // page_size * page_size if rest > 0 else 0
    capped = max_total_tokens is not None and max_total_tokens // page_size * page_size < num_tokens
    if max_total_tokens is not None:
        num_tokens = min(num_tokens, max_total_tokens // page_size * page_size)
    why = _reserve_reason(by_fraction, total_bytes, mem_fraction_static, headroom)
    if num_tokens <= 0:
        raise ValueError(
            f"no room for the KV cache: the least free memory over the ranks is "
            f"{min_free / 2**30:.2f} GiB after the weights, and {reserve / 2**30:.2f} GiB is kept "
            f"free ({why}); one token needs {cell_size} bytes. "
            f"Raise mem_fraction_static, or use a smaller model or a larger tp_size.")
    logger.info("KV pool: %d tokens (%.3f GB per rank, page_size %d): %s", num_tokens,
                num_tokens * cell_size / 1e9, page_size,
                f"capped by max_total_tokens={max_total_tokens}" if capped else
                f"{min_free / 2**30:.2f} GiB free after the weights (least over "
                f"{len(free_bytes_per_rank)} rank(s)), {reserve / 2**30:.2f} GiB kept free "
                f"({why}), {cell_size} bytes per token")
    return num_tokens


def _reserve_reason(by_fraction: float, total_bytes: int, mem_fraction_static: float,
                    headroom: Headroom | None) -> str:
    fraction = (f"1 - mem_fraction_static={mem_fraction_static} of {total_bytes / 2**30:.2f} GiB "
                f"= {by_fraction / 2**30:.2f} GiB")
    if headroom is None:
        return fraction
    parts = (f"the largest step's activations {headroom.activations / 2**30:.2f} GiB, CUDA "
             f"graphs {headroom.cuda_graphs / 2**30:.2f} GiB, workspace "
             f"{headroom.workspace / 2**30:.2f} GiB")
    if headroom.total > by_fraction:
        return f"{parts}: more than {fraction}"
    return f"{fraction}, which covers {parts}"


def _warn_imbalance(free_bytes_per_rank: Sequence[int]) -> None:
    most = max(range(len(free_bytes_per_rank)), key=lambda r: free_bytes_per_rank[r])
    low = [r for r, b in enumerate(free_bytes_per_rank)
           if b < IMBALANCE_RATIO * free_bytes_per_rank[most]]
    if low:
        logger.warning(
            "uneven free memory: rank(s) %s have under %d%% of rank %d's %.2f GiB (%s GiB); "
            "the KV pool is sized by the least", low, int(IMBALANCE_RATIO * 100), most,
            free_bytes_per_rank[most] / 2**30,
            ", ".join(f"rank {r}: {free_bytes_per_rank[r] / 2**30:.2f}" for r in low))


def step_headroom(mc: ModelConfig, config: WorkerConfig, dtype: torch.dtype, qkv_heads: int,
                  on_cuda: bool) -> Headroom:
    """What the largest step of this rank needs beside the KV pool (`qkv_heads`: its query
    and K/V heads)."""
    workspace = 0
    if config.attention_backend == "flashinfer":
        from .attention.flashinfer_backend import WORKSPACE_BYTES

        workspace = WORKSPACE_BYTES
    intermediate, qkv = mc.intermediate_size, qkv_heads * mc.head_dim
    if mc.moe is not None:  # each token runs top_k experts and the shared ones
        intermediate = max(intermediate, mc.moe.top_k * mc.moe.intermediate_size
                           + mc.moe.shared_intermediate_size)
    if mc.mla is not None:  # q, the latent, and the prefill's per-head K and V
        heads, m = -(-mc.num_heads // config.tp_size), mc.mla
        qkv = heads * (2 * m.qk_head_dim + 2 * m.v_head_dim) + m.latent_dim
    return estimate_headroom(ForwardShape(
        hidden_size=mc.hidden_size,
        intermediate_per_rank=-(-intermediate // config.tp_size),
        qkv_per_rank=qkv, vocab_size=mc.vocab_size,
        dtype_bytes=dtype.itemsize,
        max_batch_tokens=config.max_prefill_tokens + config.max_running_requests,
        max_batch=config.max_running_requests, graph_max_batch=config.graph_max_batch,
        workspace_bytes=workspace, on_cuda=on_cuda))


def pool_cell(mc: ModelConfig, config: WorkerConfig, heads: HeadShard,
              dtype: torch.dtype) -> tuple[int, int, int]:
    """(heads, head size, bytes per token over every layer) of this rank's KV pool."""
    if mc.mla is not None:  # one latent per token, the same on every rank
        return 1, mc.mla.latent_dim, mla_cell_size(mc.mla.latent_dim, mc.num_layers,
                                                   dtype.itemsize)
    from .parallel import head_shard

    # every rank holds the same number of tokens: the most KV heads set the cell
    max_kv_heads = max(head_shard(mc.num_heads, mc.num_kv_heads, r, config.tp_size).num_kv_heads
                       for r in range(config.tp_size))
    cell = kv_cell_size(max_kv_heads, mc.head_dim, mc.num_layers, dtype.itemsize)
    if config.kv_pool == "double-sparse":  # and each head's heavy-channel label
        cell += max_kv_heads * config.ds_heavy_channel_num * mc.num_layers * dtype.itemsize
    return heads.num_kv_heads, mc.head_dim, cell
