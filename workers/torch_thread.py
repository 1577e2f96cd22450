"""The one thread that does a rank's torch work: building its `TPWorker`, and every step.

Why one thread: torch's CPU kernels run on GNU OpenMP (libgomp), which gives each thread that
starts a parallel region a team of worker threads of its own, kept for that thread's life. Once
the process has more OpenMP threads than CPUs, libgomp throttles every team (about 100 spins
before a worker sleeps), so each parallel region pays a futex wake-up. A rank built (model load,
warm-up) on one thread and stepped on another has two teams, and on 2 cores its step ran about
35% slower: SmolLM2-135M, 1 stream 29.7-31.6 tok/s against 43.8-48.2, 16 streams 141-144
against 192-200, the team on 1.3-1.5 cores instead of 2 (README, "Serving speed", session 14).
Built and stepped on one thread, any one, the rank ran at full speed.

`TorchThread` runs the calls given to it one at a time, in the order given. It is a daemon: a
follower's loop blocked in a collective must not hold its process open at exit. It ends when
shut down, or once nothing refers to it (an engine dropped without `shutdown`, as tests do): a
thread that ends frees its OpenMP team.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


_Calls = queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]


class TorchThread:
    def __init__(self, name: str) -> None:
        self._calls: _Calls = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        # the thread holds the queue only, not this object, so that dropping it ends the thread
        self._thread = threading.Thread(target=_run, args=(self._calls,), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._calls.put, None)

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue `fn(*args, **kwargs)` behind the calls queued before it; its future holds the
        result, or what it raised."""
        future: Future[T] = Future()
        with self._lock:  # nothing is queued behind the shutdown: it would never run
            if self._closed:
                raise RuntimeError(f"{self._thread.name} is shut down")
            self._calls.put((functools.partial(fn, *args, **kwargs), future))
        return future

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on the thread, waited for (run at once when already on it)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self, wait: bool = True) -> None:
        """End the thread after the calls already queued (`wait`: and wait for them)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._calls.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


def _run(calls: _Calls) -> None:
    while (item := calls.get()) is not None:
        fn, future = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
        del fn, future  # drop the call's arguments and result before waiting again
