"""The real app on the default model, over HTTP, through the official `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from raydix.deploy.config import AppConfig
from raydix.deploy.engine_settings import engine_config
from raydix.engine.engine import Engine
from raydix.engine.request import GenerationParams
from raydix.workers.step import SamplingParams
from tests.serve_apps import delete_apps
from tests.uncompiled import uncompiled

from .conftest import MODEL_NAME, NO_DECODE_GRAPH, ServeCluster, uncompiled_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = "The capital of France is"


def app_config(model: Path) -> AppConfig:
    # fp32: the server and the reference compute alike without each timing `--dtype auto`
    return AppConfig(model=str(model), served_model_name=MODEL_NAME, device="cpu", dtype="float32",
                     max_total_tokens=8192, max_running_requests=16, max_context_len=512,
                     disable_cpu_decode_graph=NO_DECODE_GRAPH)


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, smollm2: Path) -> Iterator[ServeCluster]:
    from ray import serve

    serve.run(uncompiled_app(app_config(smollm2)), name="raydix", route_prefix="/")
    yield serve_cluster
    delete_apps("raydix")


@pytest.fixture(scope="module")
def client(server: ServeCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def engine(smollm2: Path) -> Engine:
    """An in-process engine over the same folder and settings, computing as the replica does
    (nothing compiled), as the reference."""
    config = uncompiled(engine_config(app_config(smollm2), str(smollm2), "cpu"))
    return Engine(config, tokenizer=AutoTokenizer.from_pretrained(smollm2))


def test_models_and_health(client: openai.OpenAI, server: ServeCluster) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_completion_equals_engine_greedy(client: openai.OpenAI, engine: Engine) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                    temperature=0)
    ids = engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    expected = engine.generate([ids], GenerationParams(max_new_tokens=8))[0]
    assert out.choices[0].text.startswith(" Paris.")
    assert out.choices[0].text == engine.tokenizer.decode(expected, skip_special_tokens=True)  # type: ignore[union-attr]
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_penalties_equal_the_engines(client: openai.OpenAI, engine: Engine) -> None:
    penalties = dict(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32,
                                    temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.2})
    ids = engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    sampling = SamplingParams(temperature=0.0, **penalties)
    expected, plain = engine.generate([ids, ids], [GenerationParams(sampling, 32),
                                                   GenerationParams(max_new_tokens=32)])
    assert expected != plain
    assert out.choices[0].text == engine.tokenizer.decode(expected, skip_special_tokens=True)  # type: ignore[union-attr]


def test_completion_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10,
                                      temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10,
                                            temperature=0, stream=True))
    assert len(chunks) > 2  # token by token, not one block
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_sse_ends_with_done(server: ServeCluster) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_chat_completion_and_stream(client: openai.OpenAI, engine: Engine) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=12, temperature=0)
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[union-attr]
    ids = tok.encode(text, add_special_tokens=False)  # type: ignore[union-attr]
    expected = engine.generate([ids], GenerationParams(max_new_tokens=12))[0]
    content = whole.choices[0].message.content
    assert content == tok.decode(expected, skip_special_tokens=True)  # type: ignore[union-attr]
    assert "Paris" in (content or "")
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_stop_string_cuts_text(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                    temperature=0, stop=["ris."])
    assert out.choices[0].text == " Pa"
    assert out.choices[0].finish_reason == "stop"


def test_n_choices_and_seeded_sampling(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                        max_tokens=12, temperature=1.0, seed=1234, n=2)
        assert [c.index for c in out.choices] == [0, 1]
        return [c.text for c in out.choices]

    first = sample()
    assert sample() == first  # the same seed gives the same samples
    assert first[0] != first[1]  # the two samples are not copies
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                       temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage is not None
    assert greedy.usage.completion_tokens == 12 or greedy.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                    temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == 4
    assert all(x <= 0.0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True)
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    assert len(content.content) == 3


def test_top_logprobs(client: openai.OpenAI) -> None:
    """The formats; the values are checked against transformers in tests/engine."""
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    assert len(lp.top_logprobs) == 4
    for token, token_lp, top in zip(lp.tokens or [], lp.token_logprobs, lp.top_logprobs,
                                    strict=True):
        assert 3 <= len(top) <= 4  # the three likeliest, and the sampled token
        assert top[token] == pytest.approx(token_lp)
        assert max(top.values()) == pytest.approx(token_lp)  # greedy: the likeliest
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=4)
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    for entry in content.content:
        values = [alt.logprob for alt in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token
        assert values[0] == pytest.approx(entry.logprob)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "Hi"}])


def test_logit_bias_and_stop_token_ids(client: openai.OpenAI, engine: Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    [plain] = engine.generate([ids], GenerationParams(max_new_tokens=6))
    # ban the greedy first token: the next likeliest comes instead
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                       temperature=0, logprobs=2,
                                       logit_bias={str(plain[0]): -100})
    lp = banned.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    first, second = sorted(lp.top_logprobs[0].items(), key=lambda kv: -kv[1])[:2]
    assert banned.choices[0].text == second[0] != first[0]
    # a forced token, then a stop at it
    forced = engine.tokenizer.encode(" banana")[0]  # type: ignore[union-attr]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                    temperature=0, logit_bias={str(forced): 100})
    assert out.choices[0].text == engine.tokenizer.decode([forced] * 5)  # type: ignore[union-attr]
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                        temperature=0, logit_bias={str(forced): 100},
                                        extra_body={"stop_token_ids": [forced]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    # vLLM's min_tokens: the stop token can't come before three tokens are out
    later = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                      temperature=0, logit_bias={str(forced): 100},
                                      extra_body={"stop_token_ids": [forced], "min_tokens": 3})
    assert later.usage is not None and later.usage.completion_tokens == 4
    assert later.choices[0].finish_reason == "stop"


def test_cached_tokens_reported(client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt about geography and capitals of Europe. " * 3
    client.completions.create(model=MODEL_NAME, prompt=prompt + "Q1", max_tokens=2,
                              temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt + "Q2", max_tokens=2,
                                       temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 30


def test_cache_salt_separates_cached_prefixes(client: openai.OpenAI) -> None:
    prompt = "A salted system prompt about rivers, mountains and lakes of South America. " * 3

    def cached(suffix: str, salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        out = client.completions.create(model=MODEL_NAME, prompt=prompt + suffix, max_tokens=2,
                                        temperature=0, extra_body=extra)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("Q1", "tenant-a") == 0
    assert cached("Q2", "tenant-b") == 0  # another tenant's prefix is not shared
    # nor with unsalted requests (earlier tests' unsalted prompts may share a first token)
    assert cached("Q3", None) <= 1
    assert cached("Q4", "tenant-a") >= 30  # the same tenant hits


def test_priority_refused_under_fcfs_and_empty_salt_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                  extra_body={"priority": 3})
    assert "priority" in str(err.value) and "fcfs" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                  extra_body={"cache_salt": ""})
