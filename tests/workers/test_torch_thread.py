"""`TorchThread` runs its calls on one thread, in the order given; a call's error reaches its
caller; a shut down or dropped one ends its thread."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from raydix.workers.torch_thread import TorchThread


def test_calls_run_on_one_thread_in_order() -> None:
    rank = TorchThread("raydix-test")
    seen: list[tuple[int, int]] = []
    futures = [rank.submit(lambda i=i: seen.append((i, threading.get_ident())) or i)
               for i in range(50)]
    assert [f.result(timeout=10) for f in futures] == list(range(50))
    assert [i for i, _ in seen] == list(range(50))
    (ident,) = {t for _, t in seen}
    assert ident != threading.get_ident()
    assert rank.call(threading.get_ident) == ident
    # a call made on the thread runs there at once instead of waiting behind itself
    assert rank.call(rank.call, threading.get_ident) == ident
    rank.shutdown()


def test_an_error_reaches_the_caller_and_the_thread_goes_on() -> None:
    rank = TorchThread("raydix-test")

    def fail() -> None:
        raise ValueError("bad plan")

    with pytest.raises(ValueError, match="bad plan"):
        rank.call(fail)
    assert rank.call(lambda: 3) == 3
    rank.shutdown()


def test_shutdown_runs_what_was_queued_then_refuses() -> None:
    rank = TorchThread("raydix-test")
    gate = threading.Event()
    first = rank.submit(gate.wait, 10)
    second = rank.submit(lambda: "ran")
    rank.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="shut down"):
        rank.submit(lambda: None)
    gate.set()
    assert first.result(timeout=10) and second.result(timeout=10) == "ran"
    rank.shutdown()
    assert not any(t.name == "raydix-test" for t in threading.enumerate())


def test_a_dropped_one_ends_its_thread() -> None:
    rank = TorchThread("raydix-dropped")
    rank.call(lambda: None)
    thread = next(t for t in threading.enumerate() if t.name == "raydix-dropped")
    del rank
    gc.collect()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread.is_alive()
