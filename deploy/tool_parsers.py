"""Tool calls parsed out of a model's output, in the formats models are trained on.

- `hermes` (Hermes, Qwen 2.5/3, SmolLM): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
- `llama3_json` (Llama 3.x): `{"name": …, "parameters": {…}}`, optionally after
  `<|python_tag|>`, calls separated by `;`
- `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`

Each parser names the text that opens a call (its trigger) and the begin / end strings of one
call, from which the grammar of a forced call is made (`tool_calls.py`). A call's arguments are
the JSON text the model wrote (normalised only when the call does not open with its name).

`call_prefixes` reads the calls written so far, whole or not: `tool_stream.py` streams them.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import NamedTuple

_DECODER = json.JSONDecoder()
# what opens a call object: its name, then its arguments' key (the arguments' text follows)
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


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


def _call_at(text: str, pos: int, obj: object, args_key: str) -> ParsedCall | None:
    """The call of `obj`, decoded from the text at `pos`, with its arguments as written there
    (what a stream sends piece by piece) when the object opens with its name."""
    call = _call(obj, args_key)
    head = _HEAD.match(text, pos)
    if call is None or head is None:
        return call
    try:
        args, end = _DECODER.raw_decode(text, head.end())
    except json.JSONDecodeError:
        return call
    written = text[head.end():end]
    if json.loads(head.group(1)) != call.name or args != json.loads(call.arguments):
        return call
    return ParsedCall(call.name, written)


class CallPrefix(NamedTuple):
    name: str
    arguments: str  # the arguments' JSON text written so far
    complete: bool  # the arguments are all written


def call_prefixes(text: str, start: int) -> list[CallPrefix]:
    """The calls written in `text` from `start` on, each as far as it goes: a call appears once
    its head (`{"name": …, "arguments": `) is written, and its arguments grow with the text.
    Each call's arguments here are a prefix of its arguments in any longer text."""
    out: list[CallPrefix] = []
    pos = start
    while (head := _HEAD.search(text, pos)) is not None:
        name, begin = json.loads(head.group(1)), head.end()
        try:
            args, end = _DECODER.raw_decode(text, begin)
        except json.JSONDecodeError:
            opened = begin < len(text) and text[begin] in '{["'
            out.append(CallPrefix(name, text[begin:] if opened else "", False))
            break
        if isinstance(args, int | float) and end == len(text):  # a number may go on
            out.append(CallPrefix(name, "", False))
            break
        out.append(CallPrefix(name, text[begin:end], True))
        pos = end
    return out


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
                call = _call_at(text, m.start(1), json.loads(m.group(1)), self.args_key)
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
            call = _call_at(text, pos, obj, self.args_key)
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
        pos = _skip(text, start + len(self.trigger))
        if text.startswith("{", pos):  # one call without its list
            try:
                obj, _ = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return ParseResult(content, [], False)
            call = _call_at(text, pos, obj, self.args_key)
            return ParseResult(content, [call] if call is not None else [], True)
        if not text.startswith("[", pos):
            return ParseResult(content, [], False)
        calls: list[ParsedCall] = []
        pos = _skip(text, pos + 1)
        while not text.startswith("]", pos):
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return ParseResult(content, [], False)
            call = _call_at(text, pos, obj, self.args_key)
            if call is not None:
                calls.append(call)
            pos = _skip(text, end)
            if text.startswith(",", pos):
                pos = _skip(text, pos + 1)
            elif not text.startswith("]", pos):
                return ParseResult(content, [], False)
        return ParseResult(content, calls, True)


def _skip(text: str, pos: int) -> int:
    """The position of the first non-whitespace character from `pos` on."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


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
