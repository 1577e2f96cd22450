"""Incremental detokenization and stop strings.

Text is decoded over a short window of recent tokens (``prefix_offset .. read_offset`` is what
was already shown), so that a multi-byte character split across tokens is only emitted once it
is whole (the decoder yields U+FFFD until then). Stop strings are matched on the text, not on
token boundaries; an end of the text that a stop string could still complete is held back, so
text past a stop string is never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens, for spacing


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer that detokenization needs."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        decoder: TokenDecoder | None,
        prompt_ids: Sequence[int],
        stop_strings: Sequence[str] = (),
    ) -> None:
        self._decoder = decoder
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop_strings = tuple(stop_strings)
        self._hold = max((len(s) for s in self._stop_strings), default=1) - 1
        self.text = ""  # all output text decoded so far
        self._emitted = 0  # characters of ``text`` already handed out

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take one output token; return (text safe to emit now, whether a stop string hit).

        After a stop string hit ``text`` ends right before the stop string.
        """
        if self._decoder is None:
            return "", False
        self._ids.append(token_id)
        shown = self._decoder.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = self._decoder.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(shown) and not full.endswith(_REPLACEMENT):
            self.text += full[len(shown) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        if self._stop_strings:
            hit = self._find_stop()
            if hit is not None:
                self.text = self.text[:hit]
                return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._partial_stop_len()), False

    def flush(self) -> str:
        """Everything not yet emitted (call when the request finishes)."""
        return self._emit(len(self.text))

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that a stop string could still complete."""
        for num in range(min(self._hold, len(self.text)), 0, -1):
            tail = self.text[-num:]
            if any(stop.startswith(tail) for stop in self._stop_strings):
                return num
        return 0

    def _find_stop(self) -> int | None:
        start = max(0, self._emitted - self._hold)
        found = [i for s in self._stop_strings if (i := self.text.find(s, start)) >= 0]
        return min(found) if found else None

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
