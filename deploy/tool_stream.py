"""Tool calls streamed as they are written: `StreamingToolParser` splits a stream into content
deltas and call deltas, as vLLM and SGLang stream them. Text that may still become a trigger is
held back; a call's first delta carries its name once `{"name": …, "arguments": ` is written,
and its arguments follow in pieces as they are written, which concatenate to the call's
arguments.
"""

from __future__ import annotations

from typing import NamedTuple

from .tool_parsers import ToolParser, call_prefixes


class CallDelta(NamedTuple):
    call_index: int  # the call's place in the choice
    name: str | None  # on the call's first delta only
    arguments: str  # the next piece of its arguments' JSON text (may be empty)


class StreamingToolParser:
    """Feeds one choice's text deltas; returns the content to send now and the call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent_content = 0
        self._sent_args: list[int] = []  # per call: the length of its arguments sent

    @property
    def num_calls(self) -> int:
        return len(self._sent_args)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """`final`: the stream ended; text that opened no call is content after all."""
        self.text += delta
        found = [i for t in self.parser.stream_triggers if (i := self.text.find(t)) >= 0]
        start = min(found, default=-1)
        if start < 0:  # no call yet: hold back what may still begin a trigger
            keep = 0 if final else max(_partial_suffix(self.text, t)
                                       for t in self.parser.stream_triggers)
            return self._content(len(self.text) - keep), []
        content = self._content(start)
        deltas = []
        for i, call in enumerate(call_prefixes(self.text, start)):
            if i == len(self._sent_args):
                deltas.append(CallDelta(i, call.name, call.arguments))
                self._sent_args.append(len(call.arguments))
            elif len(call.arguments) > self._sent_args[i]:
                deltas.append(CallDelta(i, None, call.arguments[self._sent_args[i]:]))
                self._sent_args[i] = len(call.arguments)
        if final and not self._sent_args:  # a trigger that opened no call: plain text
            content += self._content(len(self.text))
        return content, deltas

    def _content(self, upto: int) -> str:
        content = self.text[self._sent_content:upto] if upto > self._sent_content else ""
        self._sent_content = max(self._sent_content, upto)
        return content


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that is a proper start of `trigger`."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0
