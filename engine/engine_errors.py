"""The errors an `AsyncEngine` gives its callers (they cross Ray intact)."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full; the caller should retry after ``retry_after_s``."""

    def __init__(self, num_in_flight: int, retry_after_s: int) -> None:
        super().__init__(
            f"the engine is overloaded ({num_in_flight} requests in flight); retry later"
        )
        self.num_in_flight = num_in_flight
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type[EngineOverloadedError], tuple[int, int]]:
        return type(self), (self.num_in_flight, self.retry_after_s)  # crosses Ray intact


class EngineDeadError(RuntimeError):
    """The loop thread stopped (shutdown, or a step raised); no request can run any more."""
