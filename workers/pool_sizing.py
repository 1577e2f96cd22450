"""How many KV tokens fit: the `mem_fraction_static` rule of SGLang's `profile_max_num_token`.

    rest     = min over ranks of free memory after weights - (1 - mem_fraction_static) * total
    tokens   = rest // cell_size, aligned down to page_size, capped by max_total_tokens
    cell     = kv_heads_per_rank * head_dim * num_layers * 2 (K and V) * dtype_bytes

`mem_fraction_static` is the share of total memory for weights + KV pool; the remainder is kept
free for activations. The pure function takes made-up readings in tests; `ModelRunner` feeds it
real ones (the free memory of every rank, gathered over the group).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

IMBALANCE_RATIO = 0.9  # warn when a rank has less than 90% of another rank's free memory


def kv_cell_size(kv_heads_per_rank: int, head_dim: int, num_layers: int, dtype_bytes: int) -> int:
    """Bytes of KV one token takes on one rank."""
    return kv_heads_per_rank * head_dim * num_layers * 2 * dtype_bytes


def profile_max_num_tokens(free_bytes_per_rank: Sequence[int], total_bytes: int,
                           mem_fraction_static: float, cell_size: int, page_size: int,
                           max_total_tokens: int | None = None) -> int:
    """The KV pool capacity in tokens (a multiple of `page_size`, padding page not included).

    Raises ValueError when nothing fits, saying to raise `mem_fraction_static`.
    """
    if not free_bytes_per_rank:
        raise ValueError("need the free memory of at least one rank")
    if cell_size <= 0 or page_size <= 0:
        raise ValueError(f"cell_size ({cell_size}) and page_size ({page_size}) must be positive")
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    _warn_imbalance(free_bytes_per_rank)
    min_free = min(free_bytes_per_rank)
    rest = min_free - (1.0 - mem_fraction_static) * total_bytes
    num_tokens = int(rest // cell_size) // page_size * page_size if rest > 0 else 0
    if max_total_tokens is not None:
        num_tokens = min(num_tokens, max_total_tokens // page_size * page_size)
    if num_tokens <= 0:
        raise ValueError(
            f"no room for the KV cache: the least free memory over the ranks is "
            f"{min_free / 2**30:.2f} GiB, and {(1 - mem_fraction_static) * total_bytes / 2**30:.2f} "
            f"GiB of the {total_bytes / 2**30:.2f} GiB total is reserved "
            f"(mem_fraction_static={mem_fraction_static}); one token needs {cell_size} bytes. "
            f"Raise mem_fraction_static, or use a smaller model or a larger tp_size.")
    logger.info("KV pool: %d tokens (%.3f GB per rank, page_size %d)", num_tokens,
                num_tokens * cell_size / 1e9, page_size)
    return num_tokens


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
