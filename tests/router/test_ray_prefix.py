"""Ray's prefix router as a baseline: it sees one character per token id, so its character
tree matches prompts exactly token by token."""

from __future__ import annotations

import numpy as np
import pytest
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from raydix.deploy.app import request_router_options
from raydix.deploy.config import AppConfig
from raydix.router.ray_prefix import MAX_TOKEN_ID, RayPrefixAffinityRouter, token_text


def test_shared_text_is_the_shared_token_prefix() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        shared = rng.integers(0, 49_152, rng.integers(0, 40)).tolist()
        a = shared + rng.integers(0, 49_152, 10).tolist()
        b = shared + [x + 1 for x in a[len(shared):]]  # differ from the first token past it
        assert len(token_text(a)) == len(a)
        ta, tb = token_text(a), token_text(b)
        common = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
                      min(len(ta), len(tb)))
        assert common == len(shared) and ta[:common] == token_text(shared)


def test_ids_on_either_side_of_the_surrogates_stay_distinct() -> None:
    ids = [0, 0xD7FF, 0xD800, 0xDFFF, 0xE000, 49_151, MAX_TOKEN_ID]
    text = token_text(ids)
    assert len(set(text)) == len(ids)
    text.encode("utf-8")  # no lone surrogate: pickles and prints as any text
    with pytest.raises(ValueError, match="token ids"):
        token_text([MAX_TOKEN_ID + 1])
    with pytest.raises(ValueError, match="token ids"):
        token_text([-1])


def test_ray_tree_fed_token_text_matches_token_prefixes() -> None:
    """Ray's own tree, given the text of two replicas' prompts, matches a third prompt to the
    replica holding its longer token prefix, with that many characters."""
    tree = PrefixTree()
    tree.add_tenants(["r0", "r1"], 0.0)
    tree.insert(token_text([5, 6, 7, 8, 9]), "r0", 1.0)
    tree.insert(token_text([5, 6, 70, 80]), "r1", 2.0)
    matched, tenants = tree.prefix_match(token_text([5, 6, 7, 8, 100]))
    assert matched == token_text([5, 6, 7, 8]) and tenants == ["r0"]


class _Pending:
    def __init__(self, *args: object) -> None:
        self.args = args


def test_the_router_reads_the_prompt_ids_of_generate() -> None:
    router = RayPrefixAffinityRouter(deployment_id=DeploymentID(name="E", app_name="unit"),
                                     handle_source=DeploymentHandleSource.UNKNOWN)
    assert router._extract_text_from_request(_Pending([3, 4], None)) == token_text([3, 4])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no prompt token ids"):
        router._extract_text_from_request(_Pending("text", None))  # type: ignore[arg-type]


def test_the_app_config_selects_it_with_its_threshold() -> None:
    options = request_router_options(AppConfig(router="ray_prefix", ray_imbalanced_threshold=10))
    config = options["request_router_config"]
    assert config.request_router_kwargs == {"imbalanced_threshold": 10}
    assert "RayPrefixAffinityRouter" in str(config.request_router_class)
    with pytest.raises(ValueError, match="ray_imbalanced_threshold applies to router ray_prefix"):
        AppConfig(router="cache_aware", ray_imbalanced_threshold=10)
