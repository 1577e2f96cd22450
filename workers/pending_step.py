"""A launched step whose result is still on its way to the host, and the device-side tokens that
the next step reads.

`ModelRunner.launch` queues a step's kernels and its one device->host copy (the sampled token
ids, logprobs and top tokens, packed in one tensor) and returns a `PendingStep` at once; its
`result` waits for that copy and builds the `StepResult`. On CUDA the copy lands in pinned
memory and an event marks it done, so the rank prepares and queues the next step while the
device still runs this one. The next step's inputs that this step samples (the overlapped
loop's placeholders, `step.pending_token`) are read on the device from `SampledTokens`, in
stream order after the sampling kernels: the host never waits for them. On the CPU the copy is
the tensor itself and `result` only unpacks it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from .req_table import to_device
from .step import SamplingParams, StepPlan, StepResult


class SampledTokens(NamedTuple):
    """The token ids a step sampled, on the device, by request index."""

    step_id: int
    token_ids: torch.Tensor  # [B] int64


def input_ids_on_device(ids: np.ndarray, tokens_from_step: int, sampled: SampledTokens | None,
                        device: torch.device) -> torch.Tensor:
    """`ids` on the device with each placeholder replaced there by the token it names. A plan
    naming another step than the last one sampled, or an index that step did not have, is
    refused: a stale token would silently change the output."""
    holes = np.flatnonzero(ids < 0)
    if not len(holes):
        return to_device(ids, device)
    last = -1 if sampled is None else sampled.step_id
    if sampled is None or tokens_from_step != sampled.step_id:
        raise ValueError(f"the plan takes the tokens of step {tokens_from_step}, but the last "
                         f"step sampled was {last}")
    index = -ids[holes] - 1
    if int(index.max()) >= len(sampled.token_ids):
        raise ValueError(f"the plan takes token {int(index.max())} of step {last}, which had "
                         f"{len(sampled.token_ids)}")
    n, h = len(ids), len(holes)
    # one host->device copy: the known ids (0 in the holes), the holes and their indices
    packed = to_device(np.concatenate([np.where(ids < 0, 0, ids), holes, index]), device)
    out = packed[:n].clone()
    out[packed[n: n + h]] = sampled.token_ids[packed[n + h:]]
    return out


class PendingStep:
    """A step's result: `result()` waits for its device->host copy once (from any thread) and
    returns the `StepResult` that `finish` builds from the copied rows."""

    def __init__(self, finish: Callable[[np.ndarray], StepResult] | None, host: torch.Tensor | None,
                 event: torch.cuda.Event | None = None, done: StepResult | None = None) -> None:
        self._finish, self._host, self._event = finish, host, event
        self._result = done
        self._lock = threading.Lock()

    @classmethod
    def copy(cls, rows: torch.Tensor, finish: Callable[[np.ndarray], StepResult]) -> PendingStep:
        """Start copying `rows` to the host (non-blocking on CUDA) and return at once."""
        if rows.device.type != "cuda":
            return cls(finish, rows)
        # the caching host allocator keeps pinned blocks, and holds this one until the copy
        # recorded on the stream is done, so nothing is pinned per step after the first
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(finish, host, event)

    @classmethod
    def done(cls, result: StepResult) -> PendingStep:
        return cls(None, None, done=result)

    def result(self) -> StepResult:
        with self._lock:
            if self._result is None:
                assert self._finish is not None and self._host is not None
                if self._event is not None:
                    self._event.synchronize()
                self._result = self._finish(self._host.numpy())
                self._finish = self._host = self._event = None
            return self._result


def unpack_result(plan: StepPlan, sampling: tuple[SamplingParams, ...], has_logprobs: bool,
                  k: int, grammars_ended: Callable[[StepPlan, np.ndarray], np.ndarray] | None,
                  host: np.ndarray) -> StepResult:
    """The step's result from its rows copied to the host: token ids, then logprobs (where
    asked), then the `k` likeliest tokens' logprobs and ids."""
    token_ids = host[0].astype(np.int64)
    logprobs = top_ids = top_logprobs = None
    if has_logprobs:
        asked = np.array([p.return_logprob or p.top_logprobs > 0 for p in sampling])
        logprobs = np.where(asked, host[1], np.nan).astype(np.float32)
    if k:
        top_logprobs = host[2: 2 + k].T.astype(np.float32)
        top_ids = host[2 + k: 2 + 2 * k].T.astype(np.int64)
    stopped = np.array([int(t) in p.stop_token_ids for t, p in zip(token_ids, sampling,
                                                                    strict=True)], dtype=bool)
    if grammars_ended is not None:
        stopped |= grammars_ended(plan, token_ids)
    return StepResult(plan.step_id, token_ids, logprobs, stopped, top_ids, top_logprobs)
