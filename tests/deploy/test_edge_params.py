"""The HTTP edge's `priority` and `cache_salt`: validated, and carried into the engine's
`GenerationParams` (the request router reads `extra_key` from there too). No Serve needed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from raydix.deploy.errors import ApiError
from raydix.deploy.openai_schema import CompletionRequest
from raydix.deploy.request_params import RequestLimits, generation_params
from raydix.engine.request import GenerationParams


def _params(schedule_policy: str, **body: object) -> GenerationParams:
    request = CompletionRequest(model="m", prompt=[1, 2, 3], **body)  # type: ignore[arg-type]
    return generation_params(request, [[1, 2, 3]], 4, ("prompt", "max_tokens"), False, 0,
                             None, RequestLimits(64, schedule_policy, 100))


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
