"""Cache events: every change to what a prefix cache holds, for mirrors such as the router.

An event names a path from the root of the ``extra_key`` namespace. ``token_ids`` is the whole
path; its last ``num_tokens`` tokens are what was inserted or evicted. A mirror that applies
the events in ``seq`` order holds exactly what the cache holds. A gap in ``seq`` means events
were lost, and the mirror should be rebuilt (a ``CLEARED`` event also starts over).

``INSERTED`` / ``EVICTED`` follow the device tier. With a host tier, ``HOST_INSERTED`` /
``HOST_EVICTED`` follow the host copies the same way (a run of one node, named by its whole
path); a reader that knows only the device tier ignores them.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Hashable
from typing import NamedTuple

import numpy as np
import numpy.typing as npt


class EventKind(enum.Enum):
    INSERTED = "inserted"  # now on the device
    EVICTED = "evicted"  # gone from the device (a host copy may stay)
    CLEARED = "cleared"
    HOST_INSERTED = "host_inserted"  # a copy now in the host tier (hiradix.py)
    HOST_EVICTED = "host_evicted"  # the host copy is gone


class CacheEvent(NamedTuple):
    seq: int
    kind: EventKind
    extra_key: Hashable
    token_ids: npt.NDArray[np.int32]
    num_tokens: int

    @property
    def prefix_len(self) -> int:
        """Length of the path above the inserted or evicted tokens."""
        return len(self.token_ids) - self.num_tokens


EventSink = Callable[[CacheEvent], None]


class EventBuffer:
    """Collects events until they are drained in a batch, keeping at most ``max_events``.

    When the buffer overflows the oldest events are dropped; the gap in ``seq`` tells the
    reader to resynchronise.
    """

    def __init__(self, max_events: int = 65536) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._events: deque[CacheEvent] = deque(maxlen=max_events)

    def __call__(self, event: CacheEvent) -> None:
        self._events.append(event)

    def __len__(self) -> int:
        return len(self._events)

    def drain(self) -> list[CacheEvent]:
        """Every buffered event, oldest first. Safe while another thread appends: an event
        appended meanwhile is either returned now or left for the next drain, never lost."""
        events = []
        while True:
            try:
                events.append(self._events.popleft())
            except IndexError:
                return events
