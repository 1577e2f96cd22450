"""The engine in a process of its own: `ProcessEngine`, `AsyncEngine`'s face over it.

`AsyncEngine` steps the engine on a thread of the caller's process, so the step shares the
GIL with the event loop that streams the outputs: each chunk the event loop sends (Serve's
generator, its serialization, gRPC's write) holds the step back, and on a small step, where
nearly all of the step is host work, the step and the stream take turns. Here the engine runs
in a child process (as vLLM's engine core): it steps without waiting on the stream, the outputs
of the steps a slow reader missed go out as one chunk, and the event loop's work per chunk runs
on another core.

The child (`engine_core.py`) builds the engine from a picklable factory, then applies the
commands sent down one pipe between steps and sends each step's outputs up another. A reader
thread here hands each step's outputs to their callers (one wake-up of each caller's event
loop per step, as `AsyncEngine` does), keeps a copy of the engine's figures (`EngineState`, at
most `STATE_INTERVAL_S` old while the engine steps) for reads that must not wait for a step,
passes the cache's events to `event_sink`, and logs the child's raydix log records here.
Output processing (text, stop strings) stays on the callers' event loops, with the engine's
tokenizer sent over once.

`call(fn)` runs `fn(engine)` in the child between steps. The factory and each `fn` go over by
`dumps` (`pickle.dumps`: by reference, a function of a module the child can import; the
replica passes Ray's cloudpickle, which sends a test's factory or a lambda by value), the
results and outputs by pickle. When
the child dies or a step raises, every request in flight and every later one fails with
`EngineDeadError` and `on_error` is called once, as with `AsyncEngine`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Pipe
from typing import cast

from raydix.cache import EventSink

from .async_engine import (
    MAX_WAITING_REQUESTS,
    EngineClient,
    _Abort,
    _Add,
    _Call,
    _Sink,
    deliver,
    fail_command,
    hand_out,
)
from .config import EngineConfig
from .detokenizer import TokenDecoder
from .engine import CacheStats, Engine, RankFacts
from .engine_core import (
    ENTRY,
    AbortRequest,
    AddRequest,
    BuiltFacts,
    CallEngine,
    Command,
    CoreSpec,
    StopEngine,
)
from .engine_errors import EngineDeadError
from .executor import RankLocation, UnhealthyRanksError
from .metrics import EngineMetrics
from .output_processor import RequestOutputProcessor
from .request import GenerationParams

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long `shutdown` waits for the child before killing it


class EngineMirror:
    """The engine's figures as the child last sent them (`EngineView`)."""

    def __init__(self, facts: BuiltFacts, alive: Callable[[], bool]) -> None:
        self.config = cast(EngineConfig, facts.config)
        self.tokenizer = cast(TokenDecoder | None, facts.tokenizer)
        self.state = facts.state
        self._rank_facts = facts.rank_facts
        self._ranks = facts.ranks
        self._alive = alive

    @property
    def num_running(self) -> int:
        return self.state.num_running

    @property
    def num_steps(self) -> int:
        return self.state.num_steps

    def metrics(self) -> EngineMetrics:
        return self.state.metrics

    def cache_stats(self) -> CacheStats:
        return self.state.cache

    def rank_facts(self) -> RankFacts:
        return self._rank_facts

    def ranks(self) -> tuple[RankLocation, ...]:
        return self._ranks

    def output_processor(self, prompt_ids: Sequence[int],
                         params: GenerationParams) -> RequestOutputProcessor:
        return RequestOutputProcessor(self.tokenizer, prompt_ids, params)

    async def check_health_async(self) -> None:
        if not self._alive():
            raise UnhealthyRanksError("the engine process is not running", permanent=True)


class ProcessEngine(EngineClient):
    """Runs the engine that `factory(event_sink or None)` makes in a child process (see the
    module's docstring), with this process's environment and `env`; `generate` streams one
    request's outputs."""

    engine: EngineMirror

    def __init__(self, factory: Callable[[EventSink | None], Engine],
                 event_sink: EventSink | None = None,
                 setup: Callable[[], object] | None = None,
                 max_waiting_requests: int = MAX_WAITING_REQUESTS,
                 retry_after_s: int = 1,
                 on_error: Callable[[BaseException], None] | None = None,
                 stream_interval: int = 1,
                 dumps: Callable[[object], bytes] = pickle.dumps,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(max_waiting_requests, retry_after_s)
        self._dumps = dumps
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._event_sink = event_sink
        self._on_error = on_error
        self._sinks: dict[str, _Sink] = {}
        self._calls: dict[int, concurrent.futures.Future[object]] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._closed = False  # the child is gone; commands are answered at once
        self._closed_reason = ""
        commands_read, self._commands = Pipe(duplex=False)
        self._out, out_write = Pipe(duplex=False)
        self._process = subprocess.Popen(
            [sys.executable, "-c", ENTRY,
             str(commands_read.fileno()), str(out_write.fileno())],
            pass_fds=(commands_read.fileno(), out_write.fileno()),
            env={**os.environ, **(env or {})})
        commands_read.close()
        out_write.close()
        self._commands.send(list(sys.path))
        self._commands.send_bytes(dumps(CoreSpec(
            factory, event_sink is not None, setup, stream_interval)))
        self._built_future: concurrent.futures.Future[EngineMirror] = concurrent.futures.Future()
        self._reader = threading.Thread(target=self._read, name="raydix-engine-process-reader",
                                        daemon=True)
        self._reader.start()
        try:
            self.engine = self._built_future.result()  # the engine's build error raises here
        except BaseException:
            self._stop_process(0.0)
            raise
        self._built(self.engine.config)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def is_alive(self) -> bool:
        return self._process_alive() and self._error is None and not self._closed

    def _process_alive(self) -> bool:
        return self._process.poll() is None

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self._stopped = True
        self._put(StopEngine())
        self._stop_process(timeout_s)

    def _stop_process(self, timeout_s: float) -> None:
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        with self._send_lock:
            self._commands.close()
        self._reader.join(timeout_s)

    # ------------------------------------------------------------------- commands down
    def _send(self, command: _Add | _Abort | _Call) -> None:
        message: Command
        if isinstance(command, _Add):
            self._sinks[command.rid] = command.sink
            message = AddRequest(command.rid, command.prompt_ids, command.params)
        elif isinstance(command, _Abort):
            self._sinks.pop(command.rid, None)  # nothing more goes to the caller
            message = AbortRequest(command.rid)
        else:
            call_id = next(self._call_ids)
            self._calls[call_id] = command.future
            message = CallEngine(call_id, self._dumps(command.fn))
        if not self._put(message):
            if isinstance(command, _Add):
                self._sinks.pop(command.rid, None)
            elif isinstance(command, _Call):
                self._calls.pop(call_id, None)
            fail_command(command, EngineDeadError(self._closed_reason))

    def _put(self, message: Command) -> bool:
        with self._send_lock:
            if self._closed:
                return False
            try:
                self._commands.send(message)
                return True
            except (OSError, ValueError, BrokenPipeError):  # the child is gone (or the pipe closed)
                return False

    # ------------------------------------------------------------------- outputs up
    def _read(self) -> None:
        reason = "the engine is shut down"
        error: BaseException | None = None
        try:
            while True:
                message = self._out.recv()
                kind = message[0]
                if kind == "step":
                    # the figures and events first: a caller woken by its last output reads
                    # the figures of the step that made it
                    if message[3] is not None:
                        self.engine.state = message[3]
                    if message[2] and self._event_sink is not None:
                        for event in message[2]:
                            self._event_sink(event)
                    hand_out(self._sinks, message[1])  # the child held back what's not due
                elif kind == "state":
                    self.engine.state = message[1]
                elif kind == "error":
                    sink = self._sinks.pop(message[1], None)
                    if sink is not None:
                        deliver(sink, message[2])
                elif kind == "result":
                    future = self._calls.pop(message[1], None)
                    if future is not None:
                        if message[2]:
                            future.set_result(message[3])
                        else:
                            future.set_exception(message[3])
                elif kind == "log":
                    logging.getLogger(message[2]).log(message[1], "%s", message[3])
                elif kind == "built":  # the mirror is made here, before any later message
                    self.engine = EngineMirror(message[1], self._process_alive)
                    self._built_future.set_result(self.engine)
                elif kind == "failed":
                    self._built_future.set_exception(message[1])
                    return
                elif kind == "dead":
                    reason = f"the engine loop stopped: {message[1]}"
                    error = RuntimeError(message[1])
                    break
        except (EOFError, OSError):
            if not self._stopped:
                reason = "the engine process ended"
                error = RuntimeError(f"the engine process ended (exit code {self._process.wait()})")
        if not self._built_future.done():
            self._built_future.set_exception(EngineDeadError(reason))
            return
        if error is not None:  # the child exits after a broken step: reap it
            self._reap()
        self._close(reason, error)

    def _reap(self) -> None:
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _close(self, reason: str, error: BaseException | None) -> None:
        with self._send_lock:
            self._closed = True
            self._closed_reason = reason
        if error is not None:
            logger.error("%s", reason)
            self._error = error
        dead = EngineDeadError(reason)
        for sink in list(self._sinks.values()):
            deliver(sink, dead)
        self._sinks.clear()
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(dead)
        self._calls.clear()
        if error is not None and self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:
                logger.exception("the engine's on_error callback failed")

def engine_process_pid(engine: EngineClient) -> int | None:
    """The engine process's id (None: the engine steps in this process)."""
    return engine.pid if isinstance(engine, ProcessEngine) else None


__all__ = ["EngineMirror", "ProcessEngine", "engine_process_pid"]
