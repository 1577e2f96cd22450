"""`collection_paused`: no automatic collection inside, the collector's state restored after."""

from __future__ import annotations

import gc

import pytest

from raydix.workers.gc_heap import collection_paused


def test_the_collector_is_off_inside_and_on_again_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="build failed"), collection_paused():
        assert not gc.isenabled()
        raise RuntimeError("build failed")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
