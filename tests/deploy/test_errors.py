"""Bad requests get OpenAI error bodies with the right status, and the server keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from raydix.deploy.config import AppConfig
from tests.serve_apps import delete_apps

from .conftest import MODEL_NAME, NO_DECODE_GRAPH, ServeCluster, uncompiled_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

API_KEY = "sk-test-raydix"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_CONTEXT_LEN = 64
MAX_REQUEST_BYTES = 4096


@pytest.fixture(scope="module")
def server(serve_cluster: ServeCluster, smollm2: Path) -> Iterator[str]:
    """Two apps: a guarded one at / (API key, short context, small body limit) and one at
    /tiny that admits a single request at a time."""
    from ray import serve
    from ray.serve.api import RunTarget

    common = dict(model=str(smollm2), served_model_name=MODEL_NAME, device="cpu",
                  max_total_tokens=2048, cpu_threads=1,  # two apps on the 2 CPUs
                  disable_cpu_decode_graph=NO_DECODE_GRAPH)
    guarded = AppConfig(api_key=API_KEY, max_context_len=MAX_CONTEXT_LEN,
                        max_request_bytes=MAX_REQUEST_BYTES, max_running_requests=4,
                        **common)  # type: ignore[arg-type]
    tiny = AppConfig(max_running_requests=1, max_waiting_requests=0, max_context_len=512,
                     **common)  # type: ignore[arg-type]
    serve.run_many([RunTarget(uncompiled_app(guarded), name="guarded", route_prefix="/"),
                    RunTarget(uncompiled_app(tiny), name="tiny", route_prefix="/tiny")])
    yield serve_cluster.base_url
    delete_apps("guarded", "tiny")


def post(url: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH if headers is None
                      else headers, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]


def assert_healthy(url: str) -> None:
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    ok = post(url, {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2,
                    "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


GOOD = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
BAD_FIELDS = [
    ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ({k: v for k, v in GOOD.items() if k != "prompt"}, "prompt"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": -5}, "max_tokens"),
    ({**GOOD, "max_tokens": MAX_CONTEXT_LEN}, "max_tokens"),  # prompt + max_tokens > context
    ({**GOOD, "prompt": "word " * MAX_CONTEXT_LEN}, "prompt"),  # the prompt alone is too long
    ({**GOOD, "model": "gpt-17"}, "model"),
    ({**GOOD, "temperature": -0.5}, "temperature"),
    ({**GOOD, "top_p": 0}, "top_p"),
    ({**GOOD, "top_p": 1.5}, "top_p"),
    ({**GOOD, "prompt": ""}, "prompt"),
    ({**GOOD, "prompt": []}, "prompt"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "stop": [""]}, "stop"),
    ({**GOOD, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({**GOOD, "presence_penalty": -3}, "presence_penalty"),
    ({**GOOD, "repetition_penalty": 0}, "repetition_penalty"),
    ({**GOOD, "logit_bias": {"hello": 5}}, "logit_bias"),
    ({**GOOD, "logit_bias": {"7": 101}}, "logit_bias"),
    ({**GOOD, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({**GOOD, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({**GOOD, "min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({**GOOD, "frobnicate": True}, "frobnicate"),
]


@pytest.mark.parametrize(("body", "param"), BAD_FIELDS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_FIELDS)])
def test_bad_field_is_named(server: str, body: dict[str, object], param: str) -> None:
    error = error_of(post(server, body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_malformed_json_and_chat_errors(server: str) -> None:
    r = httpx.post(server + "/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert error_of(r, 400)["code"] == "invalid_json"
    chat = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": MODEL_NAME, "messages": []})
    assert error_of(chat, 400)["param"] == "messages"
    role = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": MODEL_NAME, "messages": [{"role": "wizard",
                                                               "content": "hi"}]})
    assert str(error_of(role, 400)["param"]).startswith("messages.0.role")
    too_long = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": MODEL_NAME, "max_completion_tokens": MAX_CONTEXT_LEN,
                                "messages": [{"role": "user", "content": "hi"}]})
    error = error_of(too_long, 400)
    assert (error["param"], error["code"]) == ("max_completion_tokens", "context_length_exceeded")
    assert_healthy(server)
    metrics = httpx.get(server + "/metrics", timeout=30).text.splitlines()
    refused = [line for line in metrics
               if line.startswith('raydix_requests_total{endpoint="chat_completions",'
                                  'status="400"}')]
    assert refused and float(refused[0].split()[-1]) >= 2


def test_body_over_limit_is_413(server: str) -> None:
    r = post(server, {**GOOD, "prompt": "x" * (2 * MAX_REQUEST_BYTES)})
    assert error_of(r, 413)["code"] == "request_too_large"
    assert_healthy(server)


def test_api_key_is_checked(server: str) -> None:
    assert error_of(post(server, GOOD, headers={}), 401)["type"] == "authentication_error"
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert error_of(post(server, GOOD, headers=wrong), 401)["code"] == "invalid_api_key"
    models = httpx.get(server + "/v1/models", timeout=30)
    assert models.status_code == 401
    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert_healthy(server)


def test_overloaded_queue_is_503_with_retry_after(server: str) -> None:
    url = server + "/tiny"
    long_body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 400,
                 "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=long_body, timeout=60) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")  # it is running
        r = post(url, GOOD, headers={})
        error = error_of(r, 503)
        assert error["code"] == "overloaded"
        assert int(r.headers["Retry-After"]) >= 1
    # the first stream was dropped: its slot frees up and the app serves again
    deadline = time.monotonic() + 30
    while (r := post(url, GOOD, headers={})).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/health", timeout=30).status_code == 200
