"""The ingress's side of the engine deployment: start one engine request per choice, merge
their streams, and turn engine refusals into API errors.

A choice is one (prompt, sample) pair: `n` samples of `p` prompts make `p * n` engine requests
with ids `<request id>-<index>`. Seeded requests use `seed + sample` so the samples differ and
stay reproducible.

The engine requests go through the handle by value (`serve_env.py`): Serve streams them over
its gRPC channel between replicas instead of as one Ray object per chunk.

Faults: a request whose replica was lost (its actor died, or its engine stopped) before it
produced anything is sent again, for up to `RETRY_WINDOW_S` after its first send, and the
router picks a replica again. The window outlasts a failed replica's grace before it ends
(`server.EXIT_GRACE_S`), during which routers still send it requests that it refuses at once,
and Serve's notice of its end. Once outputs have been sent on, a lost replica ends the
request with a 503 `engine_unavailable` error, never a hang and never a bare internal error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, cast

import grpc  # type: ignore[import-untyped]
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from raydix.engine.engine_errors import EngineDeadError, EngineOverloadedError
from raydix.engine.request import GenerationParams, RequestOutput

from .errors import ApiError, bad_request, engine_unavailable, overloaded

if TYPE_CHECKING:
    from .server import EngineServer

_Stream = DeploymentResponseGenerator[list[RequestOutput]]

logger = logging.getLogger(__name__)

RETRY_WINDOW_S = 10.0  # an engine request whose replica is lost is sent again for this long
RETRY_DELAY_S = 0.2  # before the second send; doubled for each later one, up to the next
MAX_RETRY_DELAY_S = 1.0


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


def _replica_lost(error: BaseException) -> bool:
    """The replica's actor died or is unreachable (over gRPC: its call broke), or its engine
    stopped."""
    cause = getattr(error, "cause", None) or error
    return (isinstance(error, RayActorError | grpc.aio.AioRpcError)
            or isinstance(cause, EngineDeadError))


def _api_error(error: BaseException) -> ApiError | None:
    if isinstance(error, ApiError):
        return error
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, EngineOverloadedError):
        return overloaded(str(cause), cause.retry_after_s)
    if isinstance(cause, EngineDeadError):
        return engine_unavailable(str(cause))
    if isinstance(error, RayActorError | grpc.aio.AioRpcError):
        return engine_unavailable(f"the engine replica serving this request was lost "
                                  f"({type(error).__name__}); retry the request")
    if isinstance(cause, ValueError):
        return bad_request(str(cause), "prompt")
    return None


class ChoiceStreams:
    """The running engine requests of one API request."""

    def __init__(self, handle: DeploymentHandle[EngineServer], choices: list[Choice]) -> None:
        self.choices = choices
        self._handle = handle.options(stream=True)
        self._gens: list[_Stream] = [self._send(c) for c in choices]
        self._first: list[list[RequestOutput]] = []
        self._done = [False] * len(choices)

    def _send(self, choice: Choice) -> _Stream:
        return cast(_Stream, self._handle.generate.remote(choice.prompt_ids, choice.params,
                                                          choice.rid))

    async def start(self) -> None:
        """Wait for each request's first outputs, so refusals become errors before any byte
        of the response is sent. A request whose replica was lost meanwhile is sent again."""
        try:
            self._first = list(await asyncio.gather(*(self._first_outputs(i)
                                                      for i in range(len(self._gens)))))
        except BaseException as e:
            self.cancel()
            error = _api_error(e)
            if error is not None:
                raise error from e
            raise

    async def _first_outputs(self, i: int) -> list[RequestOutput]:
        deadline = time.monotonic() + RETRY_WINDOW_S
        delay = RETRY_DELAY_S
        while True:
            try:
                return await self._gens[i].__anext__()
            except Exception as e:
                if not _replica_lost(e) or time.monotonic() + delay > deadline:
                    raise
                logger.warning("request %s: its replica was lost before it answered (%s); "
                               "sending it again", self.choices[i].rid, type(e).__name__)
                with contextlib.suppress(Exception):
                    self._gens[i].cancel()
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_DELAY_S)
                self._gens[i] = self._send(self.choices[i])

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice position, output) in arrival order, until every request finishes."""
        if len(self._gens) == 1:  # one request: its stream as it comes, no task between
            try:
                async for out in self._one():
                    yield 0, out
            finally:
                self.cancel()
            return
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
            queue.put_nowait(_api_error(e) or e)

    async def _one(self) -> AsyncIterator[RequestOutput]:
        """The outputs of the only request, with `_pump`'s errors."""
        batch = self._first[0]
        while True:
            for out in batch:
                self._done[0] = out.finished
                yield out
                if out.finished:
                    return
            try:
                batch = await self._gens[0].__anext__()
            except StopAsyncIteration:
                raise RuntimeError(f"the engine ended request {self.choices[0].rid} without a "
                                   "finish reason") from None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                error = _api_error(e)
                if error is None:
                    raise
                raise error from e

    def cancel(self) -> None:
        """Abort every request that has not finished (the engine frees its KV)."""
        for gen, done in zip(self._gens, self._done, strict=True):
            if not done:
                with contextlib.suppress(Exception):
                    gen.cancel()
