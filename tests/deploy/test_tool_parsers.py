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
    StreamingToolParser,
    ToolParser,
    parser_for,
)

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


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_reassemble_the_same_calls(name: str, seed: int) -> None:
    text, rng = TEXTS[name], random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = StreamingToolParser(PARSERS[name])
    content, calls = "", []
    for k, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=k == len(pieces) - 1)
        content += c
        calls += new
    assert calls == CALLS
    assert content.strip() == "Let me check."


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
