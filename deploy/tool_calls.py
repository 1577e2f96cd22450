"""Tools in a chat request: what the prompt offers, the grammar a forced call follows, and the
parser that turns the output back into `tool_calls`.

`tool_choice`: "none" offers no tools; "auto" (the default with tools) lets the model write text
or calls, and a call, once opened, follows its function's parameters; "required" and a named
function allow nothing but calls (xgrammar structural tags over the parser's call format).

The tools go into the chat template as `tools` when the template reads them; a template that
does not gets them in the system message, in the parser's call format, so they are never
dropped without a word.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raydix.workers.step import GrammarSpec

from .errors import bad_request
from .openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from .tool_parsers import ParsedCall, ToolParser
from .tool_stream import StreamingToolParser

_SEPARATORS = {"hermes": "\n", "llama3_json": "; "}
TemplateTools = list[dict[Any, Any] | Callable[..., Any]]  # transformers' `tools` argument


@dataclass(frozen=True)
class ToolPlan:
    tools: list[Tool]  # offered in the prompt
    parser: ToolParser
    grammar: GrammarSpec | None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _tag(parser: ToolParser, tool: Tool) -> Any:
    from xgrammar.structural_tag import JSONSchemaFormat, TagFormat

    return TagFormat(begin=parser.begin(tool.function.name),
                     content=JSONSchemaFormat(json_schema=_parameters(tool), max_whitespace_cnt=1),
                     end=parser.end())


def plan_tools(body: ChatCompletionRequest, parser: ToolParser) -> ToolPlan | None:
    """None when no tools are offered; raises a 400 for a choice that can't be honoured."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    from xgrammar.structural_tag import (  # xgrammar loads torch: only for requests with tools
        StructuralTag,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("response_format can't be combined with tools (unless tool_choice "
                          "is none)", "response_format")
    tools = body.tools
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    single = body.parallel_tool_calls is False
    fmt: Any
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, "
                              "which is not among the tools", "tool_choice")
        fmt = _tag(parser, tools[names.index(choice.function.name)])
    elif choice == "required":
        separator = _SEPARATORS.get(parser.name)
        fmt = TagsWithSeparatorFormat(tags=[_tag(parser, t) for t in tools],
                                      separator=separator or "", at_least_one=True,
                                      stop_after_first=single or separator is None)
    else:
        fmt = TriggeredTagsFormat(triggers=[parser.trigger],
                                  tags=[_tag(parser, t) for t in tools],
                                  stop_after_first=single)
    grammar = GrammarSpec("structural_tag", StructuralTag(format=fmt).model_dump_json())
    return ToolPlan(tools, parser, grammar)


def _tool_prompt(tools: list[Tool], parser: ToolParser) -> str:
    specs = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                      for t in tools)
    example = parser.render([ParsedCall("<function name>", "<arguments as JSON>")])
    return ("You may call one or more functions to answer. The functions are:\n"
            f"{specs}\nTo call a function, write:\n{example}")


def chat_messages(messages: list[ChatMessage], plan: ToolPlan | None, template: str | None
                  ) -> tuple[list[dict[str, Any]], TemplateTools | None]:
    """(the messages for the chat template, the `tools` argument for it or None)."""
    native = plan is not None and template is not None and "tools" in template
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = [ParsedCall(c.function.name, c.function.arguments) for c in m.tool_calls]
            if native:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in m.tool_calls]
            else:
                parser = plan.parser if plan is not None else None
                rendered = parser.render(calls) if parser is not None else json.dumps(
                    [c._asdict() for c in calls])
                entry["content"] = (entry["content"] + "\n" + rendered).strip()
        if m.tool_call_id is not None and native:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    if plan is None:
        return out, None
    if native:
        tools: TemplateTools = [t.model_dump(exclude_none=True) for t in plan.tools]
        return out, tools
    prompt = _tool_prompt(plan.tools, plan.parser)
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _json_or_text(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(parser: ToolParser, text: str, finish_reason: str | None
                 ) -> tuple[ChatResponseMessage, str | None]:
    """A whole answer's message, its calls parsed out; finish_reason "tool_calls" when the
    model stopped after calling."""
    result = parser.parse(text)
    if not result.calls:
        return ChatResponseMessage(content=text), finish_reason
    calls = [ToolCall(id=_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in result.calls]
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return ChatResponseMessage(content=result.content or None, tool_calls=calls), reason


class ToolDeltas:
    """One streamed choice: its text deltas as content deltas and call deltas (a call's first
    delta has its id, type and name; its arguments follow in pieces as they are written)."""

    def __init__(self, parser: ToolParser) -> None:
        self._stream = StreamingToolParser(parser)

    def feed(self, text: str, finish_reason: str | None
             ) -> tuple[str, list[DeltaToolCall] | None, str | None]:
        content, calls = self._stream.feed(text, final=finish_reason is not None)
        deltas = [DeltaToolCall(index=c.call_index, id=_call_id(), type="function",
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  if c.name is not None else
                  DeltaToolCall(index=c.call_index, function=DeltaFunctionCall(arguments=c.arguments))
                  for c in calls]
        if finish_reason == "stop" and self._stream.num_calls:
            finish_reason = "tool_calls"
        return content, deltas or None, finish_reason
