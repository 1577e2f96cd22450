"""A stream interval: which of a request's step outputs go to its caller now.

With an interval of N, a request's first output goes at once (its time to first token is the
engine's), then its outputs wait until N tokens are due, and whatever is held goes with its
last output. Each send is one wake-up of the caller's event loop and one message on the way to
the client, so N > 1 trades a smoother stream for less work per token (as SGLang's and vLLM's
``--stream-interval``).
"""

from __future__ import annotations

from .request import RequestOutput


class StreamHold:
    """Outputs held per request id; used from one thread only."""

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {interval}")
        self.interval = interval
        self._held: dict[str, list[RequestOutput]] = {}

    def due(self, rid: str, outs: list[RequestOutput],
            finished: bool) -> list[RequestOutput] | None:
        """The outputs of `rid` to send now, `outs` included; None: hold them."""
        if self.interval == 1:
            return outs
        held = self._held.pop(rid, None)
        if held is None:  # the request's first output
            if not finished:
                self._held[rid] = []
            return outs
        held += outs
        if finished or sum(len(out.new_token_ids) for out in held) >= self.interval:
            if not finished:
                self._held[rid] = []
            return held
        self._held[rid] = held
        return None

    def drop(self, rid: str) -> None:
        """Forget `rid` (aborted): its held outputs are not sent."""
        self._held.pop(rid, None)

    def __len__(self) -> int:
        return len(self._held)
