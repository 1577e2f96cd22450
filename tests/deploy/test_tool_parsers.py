"""Tool-call parsers on written outputs, whole and streamed in random pieces."""

from __future__ import annotations

import json
import random

import pytest

from raydix.deploy.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    ToolParser,
    parser_for,
)
from raydix.deploy.tool_stream import StreamingToolParser

CALLS = [ParsedCall("get_weather", '{"city": "Paris", "unit": "c"}'),
         ParsedCall("lookup", '{"q": "a <b> \\"c\\""}')]
TEXTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "c"}}\n</tool_call>\n<tool_call>{"name": "lookup", "arguments": '
               '{"q": "a <b> \\"c\\""}}</tool_call>'),
    "llama3_json": ('Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": '
                    '"Paris", "unit": "c"}}; {"name": "lookup", "parameters": {"q": "a <b> '
                    '\\"c\\""}}'),
    "mistral": ('Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                '"Paris", "unit": "c"}}, {"name": "lookup", "arguments": {"q": "a <b> '
                '\\"c\\""}}]'),
}
PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                  "mistral": MistralParser()}


@pytest.mark.parametrize("name", list(TEXTS))
def test_whole_outputs_parse_into_calls_and_content(name: str) -> None:
    result = PARSERS[name].parse(TEXTS[name])
    assert result.calls == CALLS
    assert result.content == "Let me check."
    assert result.complete


@pytest.mark.parametrize("name", list(TEXTS))
def test_rendered_calls_parse_back(name: str) -> None:
    parser = PARSERS[name]
    assert parser.parse(parser.render(CALLS[:1])).calls == CALLS[:1]


def _reassemble(stream: StreamingToolParser, pieces: list[str]
                ) -> tuple[str, list[ParsedCall], list[int]]:
    """(content, the calls the deltas build, argument deltas per call); every delta of a call
    after its first carries no name, and the first comes before any other of that call."""
    content, names, args, counts = "", [], [], []
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.call_index == len(names)
                names.append(d.name)
                args.append("")
                counts.append(0)
            else:
                assert d.call_index < len(names) and d.arguments
            args[d.call_index] += d.arguments
            counts[d.call_index] += bool(d.arguments)
    return content, [ParsedCall(n, a) for n, a in zip(names, args, strict=True)], counts


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_reassemble_the_same_calls(name: str, seed: int) -> None:
    text, rng = TEXTS[name], random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls, _ = _reassemble(StreamingToolParser(PARSERS[name]), pieces)
    assert calls == CALLS == PARSERS[name].parse(text).calls
    assert content.strip() == "Let me check."


@pytest.mark.parametrize("name", list(TEXTS))
def test_arguments_stream_as_they_are_written(name: str) -> None:
    """Fed a few characters at a time, a call's arguments arrive in many pieces, each sent as
    soon as it is written: the name once the call's head is out, before any argument."""
    text = TEXTS[name]
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    stream = StreamingToolParser(PARSERS[name])
    _, calls, counts = _reassemble(stream, pieces)
    assert calls == CALLS
    assert all(n >= len(c.arguments) // 3 - 1 for n, c in zip(counts, CALLS, strict=True))
    # the arguments sent so far are always the start of the call's arguments
    stream = StreamingToolParser(PARSERS[name])
    head = text.index(CALLS[0].arguments)
    stream.feed(text[:head + 10])
    assert stream.feed("")[1] == []  # nothing new, nothing sent
    _, rest = stream.feed(text[head + 10:head + 20])
    assert rest == [(0, None, CALLS[0].arguments[10:20])]


def test_a_number_at_the_end_of_the_text_is_held_until_it_ends() -> None:
    stream = StreamingToolParser(Llama3JsonParser())
    assert stream.feed('{"name": "f", "parameters": 12') == ("", [(0, "f", "")])
    assert stream.feed("3}") == ("", [(0, None, "123")])


def test_arguments_keep_the_model_s_own_spacing() -> None:
    [call] = HermesParser().parse('<tool_call>{"name":"f","arguments":{"a":[1,2]}}</tool_call>'
                                  ).calls
    assert call.arguments == '{"a":[1,2]}'  # what a stream sends piece by piece


def test_text_without_calls_streams_as_it_comes_holding_back_a_possible_trigger() -> None:
    stream = StreamingToolParser(HermesParser())
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed(" no call") == ("<tool no call", [])
    assert stream.feed(" <tool_call>{bad json}</tool_call>", final=True) == (
        " <tool_call>{bad json}</tool_call>", [])


def test_a_broken_call_stays_content() -> None:
    result = HermesParser().parse('<tool_call>{"nom": 1}</tool_call> hi')
    assert result.calls == [] and "nom" in result.content
    assert json.loads(Llama3JsonParser().parse('{"name": "f"}').calls[0].arguments) == {}


def test_the_parser_follows_the_chat_template() -> None:
    assert parser_for("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for("auto", "<|python_tag|>").name == "llama3_json"
    assert parser_for("auto", "<tool_call>").name == "hermes"
    assert parser_for("auto", None).name == "hermes"
    assert parser_for("mistral", "<tool_call>").name == "mistral"


def test_tools_reach_the_template_or_the_system_message() -> None:
    from raydix.deploy.openai_schema import ChatCompletionRequest
    from raydix.deploy.tool_calls import chat_messages, plan_tools

    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}}}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": 2}'}}
    body = ChatCompletionRequest(model="m", tools=[tool], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    plan = plan_tools(body, HermesParser())
    assert plan is not None and plan.grammar is not None
    # a template that reads `tools` gets them, and the calls as structured messages
    messages, tools = chat_messages(body.messages, plan, "{% for t in tools %}{% endfor %}")
    assert tools == [tool] and messages[0]["content"] == "Be brief."
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"zone": 2}
    assert messages[3]["tool_call_id"] == "call_1"
    # one that does not: the system message shows them, and the call is written out
    messages, tools = chat_messages(body.messages, plan, "{{ messages }}")
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.") and "get_time" in messages[0]["content"]
    assert HermesParser().parse(messages[2]["content"]).calls == [
        ParsedCall("get_time", '{"zone": 2}')]
    # tool_choice none: nothing offered
    body = body.model_copy(update={"tool_choice": "none"})
    assert plan_tools(body, HermesParser()) is None
