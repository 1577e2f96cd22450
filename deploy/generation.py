"""The ingress's side of the engine deployment: start one engine request per choice, merge
their streams, and turn engine refusals into API errors.

A choice is one (prompt, sample) pair: `n` samples of `p` prompts make `p * n` engine requests
with ids `<request id>-<index>`. Seeded requests use `seed + sample` so the samples differ and
stay reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import NamedTuple

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from raydix.cluster.async_engine import EngineDeadError, EngineOverloadedError
from raydix.cluster.request import GenerationParams, RequestOutput

from .errors import ApiError, bad_request, overloaded


class Choice(NamedTuple):
    choice_idx: int  # position in the response: prompt_idx * n + sample
    prompt_ids: list[int]
    params: GenerationParams
    rid: str


def make_choices(request_id: str, prompts: Sequence[list[int]], params: GenerationParams,
                 n: int) -> list[Choice]:
    choices = []
    for p, prompt_ids in enumerate(prompts):
        for i in range(n):
            seed = params.sampling.seed
            sampling = params.sampling if seed is None else replace(params.sampling, seed=seed + i)
            choice_idx = p * n + i
            choices.append(Choice(choice_idx, prompt_ids, replace(params, sampling=sampling),
                                  f"{request_id}-{choice_idx}"))
    return choices


def _api_error(error: BaseException) -> ApiError | None:
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, EngineOverloadedError):
        return overloaded(str(cause), cause.retry_after_s)
    if isinstance(cause, EngineDeadError):
        return ApiError(503, str(cause), type="server_error", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(cause, ValueError):
        return bad_request(str(cause), "prompt")
    return None


class ChoiceStreams:
    """The running engine requests of one API request."""

    def __init__(self, handle: DeploymentHandle, choices: list[Choice]) -> None:
        self.choices = choices
        self._gens: list[DeploymentResponseGenerator] = [
            handle.options(stream=True).generate.remote(c.prompt_ids, c.params, c.rid)
            for c in choices
        ]
        self._first: list[list[RequestOutput]] = []
        self._done = [False] * len(choices)

    async def start(self) -> None:
        """Wait for each request's first outputs, so refusals become errors before any byte
        of the response is sent."""
        try:
            self._first = list(await asyncio.gather(*(g.__anext__() for g in self._gens)))
        except BaseException as e:
            self.cancel()
            error = _api_error(e)
            if error is not None:
                raise error from e
            raise

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice position, output) in arrival order, until every request finishes."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self._gens))]
        try:
            num_open = len(self._gens)
            while num_open:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[1].finished:
                    num_open -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()

    async def _pump(self, i: int, queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException]
                    ) -> None:
        try:
            batch: list[RequestOutput] | None = self._first[i]
            while batch is not None:
                for out in batch:
                    queue.put_nowait((i, out))
                    if out.finished:
                        self._done[i] = True
                        return
                batch = await self._gens[i].__anext__()
        except StopAsyncIteration:
            queue.put_nowait(RuntimeError(f"the engine ended request {self.choices[i].rid} "
                                          "without a finish reason"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            queue.put_nowait(e)

    def cancel(self) -> None:
        """Abort every request that has not finished (the engine frees its KV)."""
        for gen, done in zip(self._gens, self._done, strict=True):
            if not done:
                with contextlib.suppress(Exception):
                    gen.cancel()
