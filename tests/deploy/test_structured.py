"""Structured output through the real app and the official `openai` client.

The app serves a tiny random Llama with the default model's tokenizer: unconstrained it writes
garbage, so every valid output below is the grammar's doing.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from raydix.deploy.config import AppConfig
from tests.serve_apps import delete_apps

from .conftest import MODEL_NAME, NO_DECODE_GRAPH, ServeCluster, uncompiled_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, tiny_llama: Path) -> Iterator[ServeCluster]:
    from ray import serve

    config = AppConfig(model=str(tiny_llama), served_model_name=MODEL_NAME, device="cpu",
                       max_total_tokens=8192, max_running_requests=16, max_context_len=512,
                       disable_cpu_decode_graph=NO_DECODE_GRAPH)
    serve.run(uncompiled_app(config), name="structured", route_prefix="/")
    yield serve_cluster
    delete_apps("structured")


@pytest.fixture(scope="module")
def client(server: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    scores: list[float] = Field(max_length=3)


def test_parse_returns_a_pydantic_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        reply = client.beta.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Person, max_tokens=120,
            temperature=1.0, seed=seed)  # type: ignore[arg-type]
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        assert choice.message.parsed == Person.model_validate_json(choice.message.content or "")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Objects (some fields required), arrays, enums, bounded numbers, short strings."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 2:
        kinds += ["object", "array"] * 2
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "kind", "size", "tags", "meta", "x", "y"],
                           rng.randint(1, 4))
        props = {n: random_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": required}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10.5, "maximum": rng.choice([0, 3.25, 99])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "\"q\""], 3)}
    return {"type": "boolean"}


def _complete(client: openai.OpenAI, schema: dict[str, Any], seed: int, stream: bool) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=MESSAGES, response_format=fmt,
                                  max_tokens=200, temperature=1.0, seed=seed)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""
    text, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    return text


def test_random_schemas_validate_sampled_and_streamed(client: openai.OpenAI) -> None:
    rng = random.Random(20)
    schemas = []
    while len(schemas) < 12:
        schema = random_schema(rng)
        if schema.get("type") in ("object", "array"):
            schemas.append(schema)
    with ThreadPoolExecutor(6) as pool:  # run together: batched, chunked, prefix hits
        texts = list(pool.map(lambda i: _complete(client, schemas[i], i, stream=i % 2 == 1),
                              range(len(schemas))))
    for schema, text in zip(schemas, texts, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_guided_json_on_completions(client: openai.OpenAI) -> None:
    # biases towards '"' and '}' let the object close within the budget; any JSON object goes
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, response_format={"type": "json_object"},
        max_tokens=60, logit_bias={"18": 20, "109": 20})
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
                                                     "maximum": 9}}, "required": ["n"]}
    done = client.completions.create(model=MODEL_NAME, prompt="x =", max_tokens=30, n=2,
                                     temperature=1.0, extra_body={"guided_json": schema})
    for choice in done.choices:
        jsonschema.validate(json.loads(choice.text), schema)


def test_regex_choice_and_ebnf(client: openai.OpenAI) -> None:
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{2}"
    for field in ("guided_regex", "regex"):
        reply = client.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=20,
                                          temperature=1.0, n=3, extra_body={field: pattern})
        for choice in reply.choices:
            assert re.fullmatch(pattern, choice.text), choice.text
    choices = ["yes", "no", "it depends"]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20,
                                           temperature=1.0, n=4,
                                           extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in reply.choices)
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num ("+" | "*") num\nnum ::= [1-9]'
    reply = client.completions.create(model=MODEL_NAME, prompt="sum:", max_tokens=20, n=3,
                                      temperature=1.0, extra_body={"guided_grammar": grammar})
    for choice in reply.choices:
        assert re.fullmatch(r"\([1-9]([+*][1-9])?\)", choice.text), choice.text


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(abc"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "EBNF"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "grammar"),
])
def test_bad_grammars_are_refused_by_name(client: openai.OpenAI, extra: dict[str, Any],
                                          param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                       extra_body=extra)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and words in error["message"], error


# ------------------------------------------------------------------------------- tool calls
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_forced_call_streams_its_arguments_in_pieces(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=120,
                                  temperature=1.0, seed=4, tool_choice={
                                      "type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    [call] = reply.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            deltas += c.delta.tool_calls or []
    # the first delta opens the call; its arguments follow in pieces as they are written
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.id.startswith("call_")
    assert first.type == "function" and first.function and first.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function and d.function.name is None
               for d in rest)
    pieces = [d.function.arguments for d in deltas if d.function and d.function.arguments]
    assert len(pieces) > 1
    assert "".join(pieces) == call.function.arguments
    assert reasons[-1] == "tool_calls"


def test_required_calls_use_the_offered_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=4,
        parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=9)
    names = set()
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        _check_call(call.function.name, call.function.arguments)
        names.add(call.function.name)
    assert names <= set(SCHEMAS)


def test_auto_choice_and_a_tool_result_round_trip(client: openai.OpenAI) -> None:
    bare = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4,
                                          tools=TOOLS, tool_choice="none")
    offered = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4,
                                             tools=TOOLS)
    assert bare.usage and offered.usage
    assert offered.usage.prompt_tokens > bare.usage.prompt_tokens + 40  # the tools are shown
    assert bare.choices[0].message.tool_calls is None
    forced = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0].message
    [call] = forced.tool_calls or []
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS,
                                            tool_choice="auto", max_tokens=24, temperature=1.0)
    assert answer.usage and answer.usage.prompt_tokens > offered.usage.prompt_tokens
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for c in choice.message.tool_calls or []:  # a call, once opened, follows its schema
        if choice.finish_reason == "tool_calls":
            _check_call(c.function.name, c.function.arguments)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_refused_by_name(client: openai.OpenAI, extra: dict[str, Any],
                                               param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8,
                                       extra_body=extra)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
