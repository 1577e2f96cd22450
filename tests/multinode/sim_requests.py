"""Requests for the multinode tests: through the ingress's own request path (`generate`) or over
HTTP with the openai client (`http_generate`), each ending in an `Outcome` that `check_outcome`
judges (a full output, or a clean `engine_unavailable` when a replica was lost)."""

from __future__ import annotations

import asyncio
import uuid
from typing import NamedTuple

import openai
from ray.serve.handle import DeploymentHandle

from raydix.deploy.errors import ApiError
from raydix.deploy.generation import ChoiceStreams, make_choices
from raydix.engine.request import GenerationParams

from .conftest import MODEL_NAME


class Outcome(NamedTuple):
    """How one request ended: the tokens it produced, and the error code it ended with (None
    when it finished)."""

    num_tokens: int
    error_code: str | None = None
    detail: str = ""


def prompt_ids(prompt: str) -> list[int]:
    """One id per byte, as the tiny model's tokenizer has them (0 and 1 are BOS and EOS)."""
    return [2 + b for b in prompt.encode()]


async def generate(engine: DeploymentHandle, prompt: str, max_new_tokens: int,
                   started: asyncio.Event | None = None) -> Outcome:
    """One request through the ingress's own request path (`ChoiceStreams`: retries, error
    mapping), driven from here, for tests that remove nodes: an ingress replica may sit on
    any node. `started` is set once the request's first outputs arrived."""
    params = GenerationParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    choices = make_choices(f"t-{uuid.uuid4().hex[:12]}", [prompt_ids(prompt)], params, 1)
    streams = ChoiceStreams(engine, choices)
    num_tokens = 0
    try:
        await streams.start()
        if started is not None:
            started.set()
        async for _, out in streams.events():
            num_tokens += len(out.new_token_ids)
    except ApiError as e:
        code = e.code if e.status == 503 else f"http {e.status}"
        return Outcome(num_tokens, code, e.message)
    return Outcome(num_tokens)


async def http_generate(client: openai.AsyncOpenAI, prompt: str, max_new_tokens: int,
                        stream: bool = False, started: asyncio.Event | None = None) -> Outcome:
    """One completion over HTTP with the openai client (prompt as token ids)."""
    kwargs = dict(model=MODEL_NAME, prompt=prompt_ids(prompt), max_tokens=max_new_tokens,
                  temperature=0, extra_body={"ignore_eos": True})
    num_tokens = 0
    try:
        if not stream:
            answer = await client.completions.create(**kwargs)  # type: ignore[call-overload]
            return Outcome(answer.usage.completion_tokens)
        chunks = await client.completions.create(  # type: ignore[call-overload]
            stream=True, stream_options={"include_usage": True}, **kwargs)
        async for chunk in chunks:
            if chunk.choices and started is not None:
                started.set()
            if chunk.usage is not None:
                num_tokens = chunk.usage.completion_tokens
            elif chunk.choices and chunk.choices[0].text:
                num_tokens = max(num_tokens, 1)
    except openai.APIStatusError as e:
        code = e.code if e.status_code == 503 else f"http {e.status_code}"
        return Outcome(num_tokens, code, e.message)
    except openai.APIError as e:  # an error event inside a stream that had begun
        return Outcome(num_tokens, e.code, e.message)
    return Outcome(num_tokens)


def check_outcome(outcome: Outcome, max_new_tokens: int) -> bool:
    """True for a full output; False for a clean error (503 `engine_unavailable`: the
    replica was lost). Anything else fails the test."""
    if outcome.error_code is None:
        assert outcome.num_tokens == max_new_tokens
        return True
    assert outcome.error_code == "engine_unavailable", outcome
    return False
