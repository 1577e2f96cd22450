"""Random request lifecycles through the manager, against a model of the physical KV.

A fake KV memory records, for every slot, which token prefix its K/V was computed for. Each
prefix hit must point at slots that still hold exactly that prefix's K/V (a slot freed and
reused while still in the tree would break this). A mirror built from the cache's events must
equal the tree, and every match must be as long as the mirror says. ``check_integrity()`` runs
after every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raydix.cache import CacheConfig, EventBuffer, EventKind, KVCacheManager


@dataclass
class Req:
    tokens: list[int]
    prompt_len: int
    row: int
    computed: int  # tokens whose K/V is written


class Mirror:
    """The set of cached page paths, rebuilt only from the cache's events."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.paths: set[tuple[int, ...]] = set()

    def apply(self, buffer: EventBuffer) -> None:
        for event in buffer.drain():
            path = tuple(event.token_ids.tolist())
            pages = [
                path[:end]
                for end in range(event.prefix_len + self.page_size, len(path) + 1, self.page_size)
            ]
            if event.kind is EventKind.INSERTED:
                assert event.prefix_len == 0 or path[: event.prefix_len] in self.paths
                assert not any(p in self.paths for p in pages)
                self.paths.update(pages)
            elif event.kind is EventKind.EVICTED:
                assert all(p in self.paths for p in pages)
                assert not any(q[: len(path)] == path and len(q) > len(path) for q in self.paths)
                self.paths.difference_update(pages)
            else:
                self.paths.clear()

    def longest(self, tokens: list[int]) -> int:
        n = 0
        while (
            n + self.page_size <= len(tokens) and tuple(tokens[: n + self.page_size]) in self.paths
        ):
            n += self.page_size
        return n


def _tree_paths(m: KVCacheManager) -> set[tuple[int, ...]]:
    paths = set()
    for prefix in m.prefix_cache.iter_prefixes():
        above = prefix.prefix_ids.tolist()
        for end in range(m.page_size, len(prefix.token_ids) + 1, m.page_size):
            paths.add(tuple(above + prefix.token_ids[:end].tolist()))
    return paths


@st.composite
def prompts(draw: st.DrawFn, page_size: int) -> list[int]:
    pages = draw(st.lists(st.integers(0, 1), min_size=0, max_size=3))
    tokens = [10 * p + i % 2 for p in pages for i in range(page_size)]
    return tokens + draw(st.lists(st.integers(0, 1), min_size=1, max_size=page_size + 2))


def _run(data: st.DataObject, page_size: int) -> None:
    buffer = EventBuffer()
    config = CacheConfig(
        num_pages=12 if page_size == 1 else 7,
        max_running_requests=3,
        max_context_len=8 * page_size,
        page_size=page_size,
    )
    m = KVCacheManager(config, event_sink=buffer)
    mirror = Mirror(page_size)
    memory: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose K/V it holds
    running: list[Req] = []

    def compute(req: Req, num: int, slots: np.ndarray) -> None:
        for i, slot in enumerate(slots.tolist()):
            memory[slot] = tuple(req.tokens[: req.computed + i + 1])
        req.computed += num

    ops = ["admit"] * 3 + ["extend"] * 4 + ["decode"] * 3 + ["finish"] * 2 + ["abort", "evict"]
    for _ in range(data.draw(st.integers(10, 60), label="steps")):
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "admit" and len(running) < config.max_running_requests:
            tokens = data.draw(prompts(page_size), label="prompt")
            match = m.match_prefix(tokens)
            mirror.apply(buffer)
            assert match.cached_len == mirror.longest(tokens)
            for i, slot in enumerate(match.slots.tolist()):
                assert memory[slot] == tuple(tokens[: i + 1]), "a hit points at stale K/V"
            row = m.alloc_req(match)
            assert row is not None
            running.append(Req(tokens, len(tokens), row, match.cached_len))
        elif op == "extend" and running:
            req = data.draw(st.sampled_from(running), label="req")
            if req.computed < req.prompt_len:
                chunk = data.draw(st.integers(1, req.prompt_len - req.computed), label="chunk")
                slots = m.alloc_slots(req.row, chunk)
                if slots is not None:
                    compute(req, chunk, slots)
                    m.cache_unfinished_req(req.row, req.tokens[: req.computed])
        elif op == "decode" and running:
            batch = [
                r
                for r in running
                if r.computed == len(r.tokens) and r.computed < config.max_context_len
            ]
            slots = m.alloc_decode_slots([r.row for r in batch])
            if slots is not None:
                for req, slot in zip(batch, slots.tolist(), strict=True):
                    req.tokens.append(data.draw(st.integers(0, 3), label="sampled"))
                    compute(req, 1, np.array([slot]))
        elif op in ("finish", "abort") and running:
            req = data.draw(st.sampled_from(running), label="req")
            running.remove(req)
            if op == "finish":
                # a request may end with K/V not yet written for its last tokens
                keep = data.draw(st.integers(max(0, req.computed - 2), req.computed), label="keep")
                m.cache_finished_req(req.row, req.tokens[:keep])
            else:
                m.free_req(req.row)
        elif op == "evict":
            m.evict(data.draw(st.integers(0, 3 * page_size), label="evict"))
        m.check_integrity()
        mirror.apply(buffer)
        assert mirror.paths == _tree_paths(m)
        for req in running:
            held = m.req_to_token.read(req.row, 0, req.computed).tolist()
            for i, slot in enumerate(held):
                assert memory[slot] == tuple(req.tokens[: i + 1]), "a row lost its K/V"


@pytest.mark.parametrize("page_size", [1, 16])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_request_lifecycles_keep_kv_and_ownership_exact(
    page_size: int, data: st.DataObject
) -> None:
    _run(data, page_size)
