"""An asyncio face for the synchronous engine: one loop thread owns the engine.

The loop thread builds the engine (given a function that makes one) and steps it, so a rank
that runs in this process does all its torch work on that one thread. torch's CPU kernels run
on GNU OpenMP, which keeps a team of worker threads for every thread that starts a parallel
region; once the process holds more of them than it has CPUs (an engine loaded and warmed up on
one thread and stepped on another: two teams), every team spins only briefly before sleeping,
and each parallel region waits for its workers to wake. The default model on 2 cores, built on
the main thread: one stream 44-48 tokens/s stepped there, 30-32 stepped on another thread (1.3
of the 2 cores busy); built and stepped on one thread, 42-45. Through `AsyncEngine`: 24.6-24.8
tokens/s with the engine built on the main thread, 44.2-45.4 built on its loop thread (README,
"Serving speed", session 14).

Only the loop thread touches the engine. Callers on the event loop hand it commands (add a
request, abort one, run a function) through a locked list; the thread applies them between
steps, runs ``engine.step()`` while there is work and sleeps on a condition otherwise. Each
request's outputs travel back through its own ``asyncio.Queue``, as token ids; the loop thread
fills the queues with one ``loop.call_soon_threadsafe`` per step for all the requests of a
caller's event loop, and a caller that fell behind takes the steps it missed as one chunk (no
timer: the first token goes at once), their outputs merged into one. The request's output
processor turns them into text and checks stop strings on the caller's event loop, off the
step thread, and aborts the request in the engine when a stop string ends it. With a
``stream_interval`` above 1 the loop thread holds a request's outputs until that many tokens
are due (its first token and its end go at once): fewer wake-ups and messages per token.

Admission is bounded: at most ``max_running_requests + max_waiting_requests`` requests are in
flight; one more raises `EngineOverloadedError` at once instead of queueing without end.
A caller that stops iterating (a client went away, the task was cancelled) aborts its request,
which frees its KV in the engine.

When a step raises (e.g. a rank died), the loop ends: every request in flight, and every later
one, fails with `EngineDeadError`, and ``on_error`` (if given) is called once with the cause,
from the loop thread, after the callers were told.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar, cast

from .config import EngineConfig
from .engine import CacheStats, Engine, RankFacts
from .engine_errors import EngineDeadError, EngineOverloadedError
from .executor import RankLocation
from .metrics import EngineMetrics
from .output_processor import RequestOutputProcessor
from .request import GenerationParams, RequestOutput, merge_outputs
from .stream_hold import StreamHold

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Item = list[RequestOutput] | BaseException


class _Sink(NamedTuple):
    """Where one request's outputs go: its caller's queue, on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]


@dataclass(frozen=True)
class _Add:
    rid: str
    prompt_ids: Sequence[int]
    params: GenerationParams
    sink: _Sink


@dataclass(frozen=True)
class _Abort:
    rid: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], object]
    future: concurrent.futures.Future[object]


MAX_WAITING_REQUESTS = 256  # the default admission bound beyond the running requests


class EngineView(Protocol):
    """What the event-loop side reads of an engine: the engine itself (`AsyncEngine`), or the
    copy a `ProcessEngine` keeps of its engine process's figures."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_steps(self) -> int: ...

    def metrics(self) -> EngineMetrics: ...

    def cache_stats(self) -> CacheStats: ...

    def rank_facts(self) -> RankFacts: ...

    def ranks(self) -> tuple[RankLocation, ...]: ...

    def output_processor(self, prompt_ids: Sequence[int],
                         params: GenerationParams) -> RequestOutputProcessor: ...

    async def check_health_async(self) -> None: ...


class EngineClient:
    """The event-loop side of an engine stepped elsewhere (a thread: `AsyncEngine`; a process:
    `ProcessEngine`): `generate` streams one request's outputs. Subclasses deliver the
    commands (`_send`) and each request's outputs to its `_Sink`."""

    engine: EngineView

    def __init__(self, max_waiting_requests: int, retry_after_s: int) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0  # touched on the event loop only
        self.max_in_flight = 0  # set once the engine is built
        self._max_waiting_requests = max_waiting_requests
        self._stopped = False
        self._error: BaseException | None = None

    def _built(self, config: EngineConfig) -> None:
        self.max_in_flight = config.scheduler.max_running_requests + self._max_waiting_requests

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout_s: float = 10.0) -> None:
        raise NotImplementedError

    def _send(self, command: _Add | _Abort | _Call) -> None:
        raise NotImplementedError

    async def generate(self, prompt_ids: Sequence[int], params: GenerationParams,
                       rid: str) -> AsyncIterator[list[RequestOutput]]:
        """Yield lists of outputs for request `rid` until it finishes.

        Raises ValueError (from the engine) for a request it refuses, `EngineOverloadedError`
        when the queue is full. Leaving the iteration early aborts the request.
        """
        self._check_alive()
        if self.num_in_flight >= self.max_in_flight:
            raise EngineOverloadedError(self.num_in_flight, self.retry_after_s)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        prompt = list(prompt_ids)
        processor = self.engine.output_processor(prompt, params)
        self.num_in_flight += 1
        finished = False  # the engine ended the request: nothing to abort
        try:
            self._send(_Add(rid, prompt, params, _Sink(loop, queue)))
            while not processor.finished:
                item = await queue.get()
                error = None
                while not isinstance(item, BaseException) and not queue.empty():
                    # outputs of steps that ran while the last chunk was on its way: one chunk
                    more = queue.get_nowait()
                    if isinstance(more, BaseException):
                        error = more
                        break
                    item = item + more
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = error is not None or any(out.finished for out in item)
                outputs = [o for out in item if (o := processor.process(out)) is not None]
                if outputs:
                    yield [merge_outputs(outputs)]
                if error is not None:
                    raise error
        finally:
            self.num_in_flight -= 1
            if not finished:  # left early, or a stop string ended it before the engine did
                self._send(_Abort(rid))

    def abort(self, rid: str) -> None:
        self._send(_Abort(rid))

    def running_and_waiting(self) -> tuple[int, int]:
        """Requests running, and waiting, as callers see them; read on the event loop.

        Every request in flight that is not running counts as waiting, including those handed
        to the loop thread that the engine has not taken yet: it takes them between steps, and
        a step can last seconds on a CPU. The engine's own waiting list would miss them. A read
        torn by a step in progress is off by that step; the next read corrects it."""
        running = self.engine.num_running
        return running, max(self.num_in_flight - running, 0)

    def metrics(self) -> EngineMetrics:
        """The engine's gauges, read on the event loop while the loop thread steps (a read torn
        by a step is off by that step)."""
        return self.engine.metrics()

    async def check_ranks(self) -> None:
        """Raise `UnhealthyRanksError` when a rank died, hangs or failed; waits on the ranks
        without blocking the event loop or the loop thread."""
        await self.engine.check_health_async()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the loop thread, between steps, and return its result."""
        self._check_alive()
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._send(_Call(fn, future))
        return cast(T, await asyncio.wrap_future(future))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}")
        if self._stopped:
            raise EngineDeadError("the engine is shut down")


class AsyncEngine(EngineClient):
    """Runs `engine` in a daemon thread (given a function that makes it, builds it there first:
    see the module's docstring)."""

    engine: Engine

    def __init__(self, engine: Engine | Callable[[], Engine],
                 max_waiting_requests: int = MAX_WAITING_REQUESTS,
                 retry_after_s: int = 1,
                 on_error: Callable[[BaseException], None] | None = None,
                 stream_interval: int = 1) -> None:
        super().__init__(max_waiting_requests, retry_after_s)
        self._hold = StreamHold(stream_interval)  # loop thread only
        self._commands: list[_Add | _Abort | _Call] = []
        self._wake = threading.Condition()
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._closed = False  # the loop thread has ended; commands are answered at once
        self._closed_reason = ""
        self._on_error = on_error
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built),
                                        name="raydix-engine-loop", daemon=True)
        self._thread.start()
        self.engine = built.result()  # the engine's build error, if any, raises here
        self._built(self.engine.config)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)
        self.engine.shutdown()

    def _send(self, command: _Add | _Abort | _Call) -> None:
        with self._wake:
            if not self._closed:
                self._commands.append(command)
                self._wake.notify()
                return
        fail_command(command, EngineDeadError(self._closed_reason))

    # ------------------------------------------------------------------ loop-thread side
    def _run(self, engine: Engine | Callable[[], Engine],
             built: concurrent.futures.Future[Engine]) -> None:
        try:
            self.engine = engine() if callable(engine) else engine
        except BaseException as e:  # the constructor raises it; there is no loop to end
            self._closed = True
            built.set_exception(e)
            return
        built.set_result(self.engine)
        reason = "the engine is shut down"
        try:
            while True:
                with self._wake:
                    while not self._commands and not self._stopped and not self.engine.has_work:
                        self._wake.wait()
                    if self._stopped:
                        break
                    commands, self._commands = self._commands, []
                for command in commands:
                    self._apply(command)
                if self.engine.has_work:
                    self._dispatch(self.engine.step())
        except BaseException as e:  # a broken step: every waiting caller learns why
            logger.exception("the engine loop stopped")
            self._error = e
            reason = f"the engine loop stopped: {e!r}"
        with self._wake:
            self._closed = True
            self._closed_reason = reason
            pending, self._commands = self._commands, []
        for sink in self._sinks.values():
            deliver(sink, EngineDeadError(reason))
        self._sinks.clear()
        for command in pending:
            fail_command(command, EngineDeadError(reason))
        if self._error is not None and self._on_error is not None:
            try:
                self._on_error(self._error)
            except Exception:
                logger.exception("the engine's on_error callback failed")

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.prompt_ids, command.params, command.rid,
                                        process_outputs=False)
            except ValueError as e:
                deliver(command.sink, e)
                return
            self._sinks[command.rid] = command.sink
        elif isinstance(command, _Abort):
            self._hold.drop(command.rid)
            if self._sinks.pop(command.rid, None) is not None:
                self.engine.abort(command.rid)
        else:
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as e:
                command.future.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_rid: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            by_rid.setdefault(out.rid, []).append(out)
        hand_out(self._sinks, by_rid.items(), self._hold)


def hand_out(sinks: dict[str, _Sink], outputs: Iterable[tuple[str, list[RequestOutput]]],
             hold: StreamHold | None = None) -> None:
    """Hand a step's outputs (each request's, in order) to their callers: one wake-up of each
    caller's event loop per step, however many requests it streams. A finished request's sink
    is dropped; `hold` keeps back what is not due yet (`--stream-interval`)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
    for rid, outs in outputs:
        sink = sinks.get(rid)
        if sink is None:
            continue  # aborted meanwhile
        finished = any(out.finished for out in outs)
        if finished:
            del sinks[rid]
        due = outs if hold is None else hold.due(rid, outs, finished)
        if due is not None:
            by_loop.setdefault(sink.loop, []).append((sink.queue, due))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            loop.call_soon_threadsafe(put_all, items)


def put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def deliver(sink: _Sink, item: _Item) -> None:
    with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody waits
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)


def fail_command(command: _Add | _Abort | _Call, error: EngineDeadError) -> None:
    if isinstance(command, _Add):
        deliver(command.sink, error)
    elif isinstance(command, _Call) and not command.future.done():
        command.future.set_exception(error)
