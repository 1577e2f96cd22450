"""A request's state inside the engine, and what the engine reports back per step.

Token layout of a request, as the scheduler sees it::

    fill_ids = prompt_ids + output_ids
    0                 kv_len                     len(fill_ids)
    |-- K/V in the pool --|-- still to compute --|

A new request has ``kv_len = cached_len`` (its prefix hit). An extend step computes a chunk of
``fill_ids[kv_len:]``; once ``kv_len == len(fill_ids) - 1`` is passed the sampled token is
appended to ``output_ids`` and the request decodes one token per step.

With the overlapped step loop, a step's sampled token is *pending* from the moment the step is
committed until its result is read one step later: the request then counts one output token
more than ``output_ids`` holds, and its next input is a placeholder (``PENDING``) that the
driving rank replaces with the token it sampled (``workers/step.py``)::

    0                 kv_len == len(fill_ids)   fill_len == kv_len + 1
    |-- K/V in the pool --|-- pending token (sampled, not read yet) --|
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from raydix.workers.step import GREEDY, SamplingParams, pending_token


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # the client went away or asked to stop


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class GenerationParams:
    """What a client asks of one generation, beyond the prompt."""

    sampling: SamplingParams = GREEDY
    max_new_tokens: int = 128
    # no EOS or stop token id before this many output tokens (stop strings still apply)
    min_new_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0  # larger runs earlier under the priority policy
    extra_key: Hashable = None  # prefix-cache namespace

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.min_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        if self.min_new_tokens and self.sampling.grammar is not None:
            raise ValueError("min_new_tokens can't be combined with a grammar: the grammar "
                             "decides where the output ends")


class Usage(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class RequestOutput(NamedTuple):
    """One step's news for one request."""

    rid: str
    new_token_ids: tuple[int, ...]
    text: str  # newly decoded text, never a split character (the output processor's)
    finish_reason: FinishReason | None
    usage: Usage
    logprobs: tuple[float, ...] = ()
    # per new token, the likeliest tokens as (token id, logprob), likeliest first
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # with logprobs, the text of each new token alone and of each of its likeliest tokens
    # (`decode([token_id])`, the output processor's), so the frontend decodes nothing again
    token_texts: tuple[str, ...] = ()
    top_token_texts: tuple[tuple[str, ...], ...] = ()
    # on a request's first output with tokens, as an engine replica sends it: seconds from the
    # replica receiving the request to that output (queueing, prefill, the hop from the engine's
    # loop thread); the ingress's time to the first token less this is the serving path's
    engine_ttft_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def with_engine_ttft(outputs: list[RequestOutput], seconds: float) -> list[RequestOutput]:
    """`outputs` with `seconds` as `engine_ttft_s` of the first one that carries tokens."""
    for i, out in enumerate(outputs):
        if out.new_token_ids:
            return [*outputs[:i], out._replace(engine_ttft_s=seconds), *outputs[i + 1:]]
    return outputs


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: npt.NDArray[np.int32]
    params: GenerationParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int | None = None
    kv_len: int = 0  # tokens of fill_ids whose K/V is in the pool
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    admitted_once: bool = False
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    # the sampling while fewer than min_new_tokens are out: EOS and stop token ids banned
    early_sampling: SamplingParams | None = None
    # the sampling its request row last sent to the ranks (None: no row, or not sent yet)
    sent_sampling: SamplingParams | None = None
    # (step id, index in that step) of the sampled token not read yet; None: nothing pending
    pending: tuple[int, int] | None = None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the pending one included."""
        return len(self.output_ids) + (self.pending is not None)

    def sampling_now(self) -> SamplingParams:
        """The sampling of this request's next token."""
        if (self.early_sampling is not None
                and self.num_output_tokens < self.params.min_new_tokens):
            return self.early_sampling
        return self.params.sampling

    @property
    def fill_ids(self) -> npt.NDArray[np.int32]:
        if not self.output_ids:
            return self.prompt_ids
        return np.concatenate((self.prompt_ids, np.asarray(self.output_ids, dtype=np.int32)))

    def token_slice(self, start: int, end: int) -> npt.NDArray[np.int32]:
        """``fill_ids[start:end]`` without building the whole of ``fill_ids``; a pending token
        reads as its placeholder."""
        known = len(self.prompt_ids) + len(self.output_ids)
        if self.pending is not None and end > known:
            if end != known + 1:
                raise ValueError(f"request {self.rid}: positions past its pending token")
            head = self._known_slice(start, known) if start < known else np.zeros(0, np.int32)
            return np.concatenate((head, [pending_token(self.pending[1])])).astype(np.int32)
        return self._known_slice(start, end)

    def _known_slice(self, start: int, end: int) -> npt.NDArray[np.int32]:
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:
            return np.asarray(
                self.output_ids[start - prompt_len : end - prompt_len], dtype=np.int32
            )
        return self.fill_ids[start:end]

    @property
    def fill_len(self) -> int:
        """Tokens of the request so far, the pending one included."""
        return len(self.prompt_ids) + self.num_output_tokens

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - self.num_output_tokens

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), self.cached_tokens, len(self.output_ids))


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """A request's outputs of consecutive steps as one: one message and one SSE event for the
    chunk instead of one per step."""
    if len(outputs) == 1:
        return outputs[0]
    return outputs[-1]._replace(
        new_token_ids=tuple(t for out in outputs for t in out.new_token_ids),
        text="".join(out.text for out in outputs),
        logprobs=tuple(lp for out in outputs for lp in out.logprobs),
        top_logprobs=tuple(top for out in outputs for top in out.top_logprobs),
        token_texts=tuple(t for out in outputs for t in out.token_texts),
        top_token_texts=tuple(top for out in outputs for top in out.top_token_texts))
