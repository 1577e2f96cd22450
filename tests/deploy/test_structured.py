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

from .conftest import MODEL_NAME, ServeCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, tiny_llama: Path) -> Iterator[ServeCluster]:
    from ray import serve

    from raydix.deploy.app import build_app

    config = AppConfig(model=str(tiny_llama), served_model_name=MODEL_NAME, device="cpu",
                       max_total_tokens=8192, max_running_requests=16, max_context_len=512)
    serve.run(build_app(config), name="structured", route_prefix="/")
    yield serve_cluster
    serve.delete("structured")


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
