"""The engine process's side of `ProcessEngine` (`engine_process.py`): build the engine, then
apply commands and step, sending each step's outputs back.

Started as ``python -c ENTRY CMD_FD OUT_FD``: commands arrive on one pipe,
and everything the process says goes out on the other. The first command is the parent's
``sys.path`` (so that a factory the parent can import, a test's included, unpickles here), the
second the `CoreSpec` (pickled: its factory, like the functions of calls, goes by reference and
must be importable here). Then:

- `AddRequest`, `AbortRequest`, `CallEngine` and `StopEngine` from the parent, applied between
  steps;
- ``("built", facts)`` or ``("failed", error)`` once, then ``("step", items, events, state)``
  per step with outputs due, ``("error", rid, error)`` for a refused request, ``("result", id,
  ok, value)`` per call, ``("state", state)`` when idle, ``("log", level, name, message)`` for
  raydix's log records, and ``("dead", reason)`` when a step raised.

The engine's figures (`EngineState`) travel with a step's outputs at most every
`STATE_INTERVAL_S`, and always with a step that ended a request or left the engine idle (the
parent takes them before it hands the outputs on), so what the replica reads of them is never
older than that while it steps, and a caller whose stream ended reads the figures of its end.
The process ends when the parent's pipe closes, as it does when the parent dies in any way: the
next command it waits for or looks for between steps is the end of the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import NamedTuple

from raydix.cache import EventBuffer, EventSink
from raydix.workers.gc_heap import collection_paused, freeze_start_up_heap

from .engine import CacheStats, Engine, RankFacts
from .executor import RankLocation
from .metrics import EngineMetrics
from .request import GenerationParams, RequestOutput
from .stream_hold import StreamHold

STATE_INTERVAL_S = 0.02  # the longest the replica's copy of the engine's figures lags a step

logger = logging.getLogger(__name__)


class AddRequest(NamedTuple):
    rid: str
    prompt_ids: Sequence[int]
    params: GenerationParams


class AbortRequest(NamedTuple):
    rid: str


class CallEngine(NamedTuple):
    call_id: int
    fn: bytes  # a pickled `Callable[[Engine], object]`


class StopEngine(NamedTuple):
    pass


Command = AddRequest | AbortRequest | CallEngine | StopEngine


@dataclass(frozen=True)
class CoreSpec:
    """What the engine process runs: the engine from `factory` (given where its cache events
    go, when `events`), after `setup` (e.g. the CPU threads), streaming every
    `stream_interval` tokens."""

    factory: Callable[[EventSink | None], Engine]
    events: bool = False
    setup: Callable[[], object] | None = None
    stream_interval: int = 1


class EngineState(NamedTuple):
    """The engine's figures as of a step, for reads on the replica's event loop."""

    num_running: int
    num_steps: int
    metrics: EngineMetrics
    cache: CacheStats


class BuiltFacts(NamedTuple):
    """What the parent keeps of the built engine."""

    config: object  # EngineConfig
    tokenizer: object  # the engine's tokenizer, for the parent's output processors
    rank_facts: RankFacts
    ranks: tuple[RankLocation, ...]
    state: EngineState


def state_of(engine: Engine) -> EngineState:
    return EngineState(engine.num_running, engine.num_steps, engine.metrics(),
                       engine.cache_stats())


class _Forward(logging.Handler):
    """raydix's log records of INFO and above go to the parent, which logs them again."""

    def __init__(self, out: Connection) -> None:
        super().__init__(logging.INFO)
        self._out = out

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # the parent is gone: nothing to tell
            self._out.send(("log", record.levelno, record.name, record.getMessage()))


class _Core:
    def __init__(self, engine: Engine, out: Connection, events: EventBuffer | None,
                 stream_interval: int) -> None:
        self.engine = engine
        self.out = out
        self.events = events
        self.hold = StreamHold(stream_interval)
        self.live: set[str] = set()
        self.stopped = False
        self._state_sent = 0.0

    def apply(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            try:
                self.engine.add_request(command.prompt_ids, command.params, command.rid,
                                        process_outputs=False)
            except ValueError as e:
                self.out.send(("error", command.rid, e))
                return
            self.live.add(command.rid)
        elif isinstance(command, AbortRequest):
            self.hold.drop(command.rid)
            if command.rid in self.live:
                self.live.discard(command.rid)
                self.engine.abort(command.rid)
        elif isinstance(command, CallEngine):
            try:
                result = (command.call_id, True, pickle.loads(command.fn)(self.engine))
            except Exception as e:
                result = (command.call_id, False, e)
            self.out.send(("result", *result))
        elif isinstance(command, StopEngine):
            self.stopped = True
        else:
            raise ValueError(f"unknown engine-process command {command!r}")

    def step(self) -> None:
        outputs = self.engine.step()
        by_rid: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            by_rid.setdefault(out.rid, []).append(out)
        items = []
        for rid, outs in by_rid.items():
            if rid not in self.live:
                continue  # aborted meanwhile
            finished = any(out.finished for out in outs)
            if finished:
                self.live.discard(rid)
            due = self.hold.due(rid, outs, finished)
            if due is not None:
                items.append((rid, due))
        events = self.events.drain() if self.events is not None else []
        now = time.perf_counter()
        state = None
        ended = any(out.finished for out in outputs)  # its caller may read the figures next
        if ended or not self.engine.has_work or now - self._state_sent >= STATE_INTERVAL_S:
            state, self._state_sent = state_of(self.engine), now
        if items or events or state is not None:
            self.out.send(("step", items, events, state))

    def send_state(self) -> None:
        self._state_sent = time.perf_counter()
        self.out.send(("state", state_of(self.engine)))


def serve(commands: Connection, out: Connection) -> None:
    """Build the engine, then step it until told to stop or the parent goes."""
    sys.path[:] = commands.recv()
    raydix_logger = logging.getLogger("raydix")
    raydix_logger.addHandler(_Forward(out))
    raydix_logger.setLevel(logging.INFO)
    raydix_logger.propagate = False
    try:
        with collection_paused():  # the freeze collects once, after the build
            spec: CoreSpec = pickle.loads(commands.recv_bytes())
            if spec.setup is not None:
                spec.setup()
            events = EventBuffer() if spec.events else None
            engine = spec.factory(events)
        freeze_start_up_heap("the engine process")
    except BaseException as e:
        out.send(("failed", _picklable(e)))
        return
    out.send(("built", BuiltFacts(engine.config, engine.tokenizer, engine.rank_facts(),
                                  engine.ranks(), state_of(engine))))
    core = _Core(engine, out, events, spec.stream_interval)
    try:
        _loop(core, commands)
    except EOFError:  # the parent closed its end: nobody is waiting
        pass
    except BaseException as e:
        logger.exception("the engine loop stopped")
        out.send(("dead", repr(e)))
    finally:
        engine.shutdown()


def _loop(core: _Core, commands: Connection) -> None:
    engine = core.engine
    while not core.stopped:
        if not engine.has_work:
            core.send_state()
            while not commands.poll() and engine.idle_work():
                pass  # idle: the engine's own idle work, a piece at a time, then wait
            core.apply(commands.recv())
        while commands.poll():
            core.apply(commands.recv())
        if engine.has_work and not core.stopped:
            core.step()


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(repr(error))


def main() -> None:
    """The engine process's entry (`ENTRY`): the two pipes' descriptors are its arguments."""
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))


# run as `python -c ENTRY CMD_FD OUT_FD`: this module imported by its name (not as __main__,
# whose classes would pickle under another name)
ENTRY = "from raydix.engine.engine_core import main; main()"
