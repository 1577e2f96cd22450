"""Tool calls parsed out of a model's output, in the formats models are trained on.

- `hermes` (Hermes, Qwen 2.5/3, SmolLM): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
- `llama3_json` (Llama 3.x): `{"name": …, "parameters": {…}}`, optionally after
  `<|python_tag|>`, calls separated by `;`
- `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`

Each parser names the text that opens a call (its trigger) and the begin / end strings of one
call, from which the grammar of a forced call is made (`tool_calls.py`). `StreamingToolParser`
splits a stream into content deltas and whole calls: text that may still become a trigger is
held back, and a call is sent once it is complete.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import NamedTuple

_DECODER = json.JSONDecoder()


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text


class ParseResult(NamedTuple):
    content: str  # the text outside the calls
    calls: list[ParsedCall]
    complete: bool  # every opened call is closed (a stream may still add to an open one)


def _call(obj: object, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    name: str
    trigger: str  # the output opens a call with this
    args_key: str

    @property
    def stream_triggers(self) -> tuple[str, ...]:
        """What ends the plain content of a stream (the trigger, and any marker before it)."""
        return (self.trigger,)

    @abstractmethod
    def begin(self, function: str) -> str:
        """The text before one call's arguments."""

    @abstractmethod
    def end(self) -> str:
        """The text after one call's arguments."""

    @abstractmethod
    def parse(self, text: str) -> ParseResult: ...

    def render(self, calls: list[ParsedCall]) -> str:
        """Calls as this model writes them (for an assistant message in the prompt)."""
        return "".join(self.begin(c.name) + c.arguments + self.end() for c in calls)


class HermesParser(ToolParser):
    name = "hermes"
    trigger = "<tool_call>"
    args_key = "arguments"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def begin(self, function: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(function)}, "arguments": '

    def end(self) -> str:
        return "}\n</tool_call>"

    def parse(self, text: str) -> ParseResult:
        calls, content, last = [], [], 0
        for m in self._CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), self.args_key)
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue  # not a call: stays in the content
            content.append(text[last:m.start()])
            calls.append(call)
            last = m.end()
        rest = text[last:]
        opened = rest.rfind(self.trigger)
        complete = opened < 0 or "</tool_call>" in rest[opened:]
        content.append(rest if complete else rest[:opened])
        return ParseResult("".join(content).strip(), calls, complete)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    trigger = '{"name"'
    args_key = "parameters"
    _PYTHON_TAG = "<|python_tag|>"

    @property
    def stream_triggers(self) -> tuple[str, ...]:
        return (self._PYTHON_TAG, self.trigger)

    def begin(self, function: str) -> str:
        return f'{{"name": {json.dumps(function)}, "parameters": '

    def end(self) -> str:
        return "}"

    def render(self, calls: list[ParsedCall]) -> str:
        return "; ".join(self.begin(c.name) + c.arguments + self.end() for c in calls)

    def parse(self, text: str) -> ParseResult:
        start = text.find(self.trigger)
        if start < 0:
            return ParseResult(text.replace(self._PYTHON_TAG, "").strip(), [], True)
        content = text[:start].replace(self._PYTHON_TAG, "").strip()
        calls: list[ParsedCall] = []
        pos = start
        while pos < len(text):
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return ParseResult(content, calls, False)
            call = _call(obj, self.args_key)
            if call is None:
                return ParseResult((content + text[pos:]).strip(), calls, True)
            calls.append(call)
            pos = end
            while pos < len(text) and text[pos] in " \n\t;":
                pos += 1
        return ParseResult(content, calls, True)


class MistralParser(ToolParser):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    args_key = "arguments"

    def begin(self, function: str) -> str:
        return f'[TOOL_CALLS][{{"name": {json.dumps(function)}, "arguments": '

    def end(self) -> str:
        return "}]"

    def parse(self, text: str) -> ParseResult:
        start = text.find(self.trigger)
        if start < 0:
            return ParseResult(text.strip(), [], True)
        content = text[:start].strip()
        body = text[start + len(self.trigger):].lstrip()
        try:
            items, _ = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return ParseResult(content, [], False)
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_call(i, self.args_key) for i in items) if c is not None]
        return ParseResult(content, calls, True)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name`, or for "auto" the one the chat template writes (hermes when it
    shows none)."""
    if name != "auto":
        return PARSERS[name]()
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonParser()
    return HermesParser()


class StreamingToolParser:
    """Feeds one choice's text deltas; returns the content to send now and the new calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent_content = 0
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        """`final`: the stream ended; text that opened no call is content after all."""
        self.text += delta
        found = [i for t in self.parser.stream_triggers if (i := self.text.find(t)) >= 0]
        start = min(found, default=-1)
        if start < 0:  # no call yet: hold back what may still begin a trigger
            keep = 0 if final else max(_partial_suffix(self.text, t)
                                       for t in self.parser.stream_triggers)
            return self._content(len(self.text) - keep), []
        content = self._content(start)
        calls = self.parser.parse(self.text).calls
        new = calls[self.num_calls:]
        self.num_calls = len(calls)
        if final and not calls:  # a trigger that opened no valid call: plain text
            content += self._content(len(self.text))
        return content, new

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
