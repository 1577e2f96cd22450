"""The HTTP edge's `priority` and `cache_salt`: validated, and carried into the engine's
`GenerationParams` (the request router reads `extra_key` from there too). No Serve needed."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from raydix.deploy.errors import ApiError
from raydix.deploy.ingress import OpenAIIngress
from raydix.deploy.openai_schema import CompletionRequest
from raydix.engine.request import GenerationParams


class _Vocab:
    def __len__(self) -> int:
        return 100


# the class as written, under Serve's ASGI wrapper (whose instances expect a Serve replica)
_PLAIN_INGRESS = OpenAIIngress.__mro__[1]


def _ingress(schedule_policy: str) -> Any:
    assert _PLAIN_INGRESS.__name__ == "OpenAIIngress"
    ingress = object.__new__(_PLAIN_INGRESS)
    ingress.max_context_len = 64
    ingress.schedule_policy = schedule_policy
    ingress.tokenizer = _Vocab()
    return ingress


def _params(schedule_policy: str, **body: object) -> GenerationParams:
    request = CompletionRequest(model="m", prompt=[1, 2, 3], **body)  # type: ignore[arg-type]
    params = _ingress(schedule_policy)._params(request, [[1, 2, 3]], 4,
                                               ("prompt", "max_tokens"), False, 0)
    assert isinstance(params, GenerationParams)
    return params


def test_priority_reaches_the_engine_under_the_priority_policy() -> None:
    assert _params("priority", priority=5).priority == 5
    assert _params("priority", priority=-3).priority == -3
    assert _params("fcfs").priority == 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_priority_is_refused_when_the_policy_ignores_it(policy: str) -> None:
    with pytest.raises(ApiError) as err:
        _params(policy, priority=1)
    assert err.value.status == 400 and err.value.param == "priority"
    assert policy in err.value.message


def test_cache_salt_becomes_the_cache_namespace() -> None:
    assert _params("fcfs", cache_salt="tenant-a").extra_key == "tenant-a"
    assert _params("fcfs").extra_key is None
    with pytest.raises(ValidationError, match="cache_salt"):
        CompletionRequest(model="m", prompt=[1], cache_salt="")
    with pytest.raises(ValidationError, match="priority"):
        CompletionRequest(model="m", prompt=[1], priority=2**40)
