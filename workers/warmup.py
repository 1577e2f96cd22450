"""Warm-up: every kernel the first requests use runs once before the rank says it is ready.

On CUDA, flashinfer compiles its kernels on first use (tens of seconds to minutes on a fresh
machine) and `plan` builds its schedules; cuBLAS makes its handles and workspaces. Without a
warm-up the first request pays all of it. So the runner runs one extend (the prefill kernels)
and one decode (the decode kernels), before any CUDA graph is captured and before the engine
reports ready.

The warm-up batch lives on the padding page: its request row is row 0, untouched at start-up
(all zeros, so every position maps to slot 0), and its new K/V go to slot 0. Slot 0 is never
handed out, so no request can see what the warm-up wrote.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Protocol

import numpy as np
import torch
from tqdm import tqdm

from .attention.base import AttentionBackend, ForwardBatch

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 8  # prompt tokens of the warm-up extend


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 backend: AttentionBackend) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class WarmUpResult(NamedTuple):
    phases: tuple[str, ...]  # "prefill", "decode": each ran one forward
    seconds: float


def padding_batch(prefix_len: int, extend_len: int, device: torch.device) -> ForwardBatch:
    """One request on row 0 whose K/V are read from and written to the padding slot."""
    return ForwardBatch(
        row_idx=np.zeros(1, np.int64), prefix_lens=np.array([prefix_len], np.int64),
        extend_lens=np.array([extend_len], np.int64),
        input_ids=torch.zeros(extend_len, dtype=torch.int64, device=device),
        positions=torch.arange(prefix_len, prefix_len + extend_len, dtype=torch.int64,
                               device=device),
        out_cache_loc=torch.zeros(extend_len, dtype=torch.int64, device=device))


@torch.inference_mode()
def warm_up(model: CausalLM, backend: AttentionBackend, req_to_token: torch.Tensor,
            device: torch.device) -> WarmUpResult:
    """Run an extend and a decode on the padding page; returns what ran and how long it took."""
    if bool(req_to_token[0].any()):
        raise RuntimeError("warm-up needs request row 0 unused (all slots 0)")
    start = time.perf_counter()
    phases = (("prefill", 0, WARM_UP_TOKENS), ("decode", WARM_UP_TOKENS, 1))
    on_cuda = device.type == "cuda"
    if on_cuda:
        logger.info("warming up: compiling and planning the attention kernels (flashinfer "
                    "compiles on its first start on a machine, which can take minutes)")
    for name, prefix_len, extend_len in tqdm(phases, desc="warm-up", unit="phase",
                                             disable=not on_cuda):
        batch = padding_batch(prefix_len, extend_len, device)
        backend.prepare(batch)
        hidden = model(batch.input_ids, batch.positions, backend)
        model.compute_logits(hidden[-1:])
        logger.debug("warm-up: %s done", name)
    if on_cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logger.info("warm-up: prefill and decode kernels ready in %.1f s", seconds)
    return WarmUpResult(tuple(name for name, _, _ in phases), seconds)
