"""Ray Serve LLM's own prefix router, as a baseline to raydix's cache-aware one.

Ray's ``PrefixCacheAffinityRouter`` keeps a character tree of the prompts it routed (its own
history, not the replicas' caches) and reads the prompt's text from a ``prompt`` or ``messages``
field of the request. raydix's engine deployment is called with the prompt's token ids instead,
so this subclass hands Ray's tree one character per token id: its matches are then exact token by
token, as raydix's tree, and nothing else of Ray's policy changes (its load check, its match-rate
threshold, its smallest-tenant choice for cold prompts, and its never-evicting default); only
which waiting request gets the chosen replica is raydix's, as for the cache-aware router.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest

from .request_matching import OwnRequestRouter

# token id t becomes chr(t + OFFSET): above the basic plane, so no id lands on a surrogate
OFFSET = 0x10000
MAX_TOKEN_ID = 0x10FFFF - OFFSET


def token_text(token_ids: Sequence[int]) -> str:
    """One character per token id, so that two prompts share a text prefix exactly as long as
    their shared token prefix."""
    if any(not 0 <= t <= MAX_TOKEN_ID for t in token_ids):
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}] to be spelled as text")
    return "".join(chr(int(t) + OFFSET) for t in token_ids)


class RayPrefixAffinityRouter(OwnRequestRouter, PrefixCacheAffinityRouter):
    """Ray's policy, with each request given the replica chosen for it (`request_matching.py`):
    with Serve's default matching the second engine call of an n=2 request waited for ever."""

    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        """The prompt's token ids (the first argument of ``EngineServer.generate``) as text."""
        args = pending_request.args
        if not args or not isinstance(args[0], (list, tuple)) or not args[0]:
            raise ValueError("the request carries no prompt token ids to route by")
        return token_text(args[0])
