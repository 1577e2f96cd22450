"""Random request lifecycles through the manager with a host tier, against plain models of both
memories, step by step as the engine runs them.

Each step: requests are admitted (a host hit is loaded back), extended, decoded, finished or
aborted, and the pool is evicted from; then the step runs as a rank runs it: the drained copies
(device->host writes, then host->device loads) and then the forward's K/V writes. A fake memory
per tier records which token prefix each slot's K/V belongs to. After every step:

- every running request's row and every device node point at slots holding exactly their
  prefix's K/V; every host copy holds its node's K/V;
- a mirror rebuilt only from the cache's events (per tier) equals the tree, and each match's
  device and host lengths are what the mirror says;
- ``check_integrity()`` (both tiers: every slot owned once, sizes exact) holds after every
  operation, and nothing is held on either tier once every request is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from raydix.cache import (
    WRITE_POLICIES,
    CacheConfig,
    EventBuffer,
    EventKind,
    HiRadixCache,
    KVCacheManager,
)

Path = tuple[int, ...]


@st.composite
def prompts(draw: st.DrawFn, page_size: int) -> list[int]:
    """Up to four pages from three, so that prompts share prefixes often, and a short tail."""
    pages = draw(st.lists(st.integers(0, 2), min_size=0, max_size=4))
    tokens = [10 * p + i % 2 for p in pages for i in range(page_size)]
    return tokens + draw(st.lists(st.integers(0, 1), min_size=1, max_size=page_size + 2))


@dataclass
class Req:
    tokens: list[int]
    prompt_len: int
    row: int
    computed: int  # tokens whose K/V the row's slots will hold after this step


class TierMirror:
    """The cached page paths of each tier, rebuilt only from the cache's events."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.device: set[Path] = set()
        self.host: set[Path] = set()
        self.num_host_evicted = 0

    def apply(self, buffer: EventBuffer) -> None:
        for event in buffer.drain():
            path = tuple(event.token_ids.tolist())
            ps = self.page_size
            pages = [path[:end] for end in range(event.prefix_len + ps, len(path) + 1, ps)]
            kind = event.kind
            if kind is EventKind.CLEARED:
                self.device.clear()
                self.host.clear()
            elif kind in (EventKind.INSERTED, EventKind.HOST_INSERTED):
                tier = self.device if kind is EventKind.INSERTED else self.host
                assert not tier & set(pages), "inserted twice"
                if kind is EventKind.INSERTED and event.prefix_len:
                    assert path[: event.prefix_len] in self.device
                tier.update(pages)
            else:
                tier = self.device if kind is EventKind.EVICTED else self.host
                self.num_host_evicted += kind is EventKind.HOST_EVICTED
                assert set(pages) <= tier, "evicted what the tier does not hold"
                tier.difference_update(pages)

    def longest(self, tokens: list[int]) -> tuple[int, int]:
        """(device length, host-only length beyond it) of the longest cached prefix."""
        ps, n = self.page_size, 0
        while n + ps <= len(tokens) and tuple(tokens[: n + ps]) in self.device:
            n += ps
        h = n
        while h + ps <= len(tokens) and tuple(tokens[: h + ps]) in self.host:
            h += ps
        return n, h - n


def _tiers(m: KVCacheManager) -> tuple[dict[Path, list[int]], dict[Path, list[int]]]:
    """Each tier's page paths and their slots, read from the tree."""
    device: dict[Path, list[int]] = {}
    host: dict[Path, list[int]] = {}
    cache = m.host_cache
    assert cache is not None
    for node in cache.iter_nodes():
        path = cache.node_tokens(node).tolist()
        start = len(path) - len(node.key) // 4
        for lo in range(start, len(path), m.page_size):
            page = tuple(path[: lo + m.page_size])
            if len(node.value):
                device[page] = node.value[lo - start : lo - start + m.page_size].tolist()
            if node.host_value is not None:
                host[page] = node.host_value[lo - start : lo - start + m.page_size].tolist()
    return device, host


def cache_of(m: KVCacheManager) -> HiRadixCache:
    assert m.host_cache is not None
    return m.host_cache


def _run_step(m: KVCacheManager, device_kv: dict[int, Path], host_kv: dict[int, Path],
              forward: dict[int, Path]) -> None:
    """The step as every rank runs it: the drained writes, then loads, then the forward."""
    copies = m.drain_copies()
    assert copies is not None
    for d, h in zip(copies.write_device_slots.tolist(), copies.write_host_slots.tolist(),
                    strict=True):
        host_kv[h] = device_kv.get(d, ())
    for h, d in zip(copies.load_host_slots.tolist(), copies.load_device_slots.tolist(),
                    strict=True):
        device_kv[d] = host_kv.get(h, ())
    device_kv.update(forward)


def _run(data: st.DataObject, page_size: int, write_policy: str) -> None:
    buffer = EventBuffer()
    config = CacheConfig(
        num_pages=9 if page_size == 1 else 5, max_running_requests=3,
        max_context_len=8 * page_size, page_size=page_size,
        num_host_pages=7 if page_size == 1 else 4, write_policy=write_policy,
    )
    m = KVCacheManager(config, event_sink=buffer)
    mirror = TierMirror(page_size)
    device_kv: dict[int, Path] = {}  # device slot -> the prefix whose K/V it holds
    host_kv: dict[int, Path] = {}
    running: list[Req] = []

    def check() -> None:
        m.check_integrity()
        mirror.apply(buffer)

    for _ in range(data.draw(st.integers(4, 20), label="steps")):
        forward: dict[int, Path] = {}  # this step's K/V writes
        to_cache: list[Req] = []
        busy: list[Req] = []  # computed this step: they finish after the forward
        for _ in range(data.draw(st.integers(1, 5), label="ops")):
            op = data.draw(st.sampled_from(["admit"] * 3 + ["extend", "decode"] + ["finish"] * 2
                                           + ["abort", "evict", "evict"]), label="op")
            idle = [r for r in running if r not in busy]
            if op == "admit" and len(running) < config.max_running_requests:
                tokens = data.draw(prompts(page_size), label="prompt")
                if len(tokens) > m.capacity:  # the engine refuses it at admission: it could
                    continue  # never hold its K/V (the allocator raises for such a chunk)
                match = m.match_prefix(tokens)
                mirror.apply(buffer)
                device_len, host_len = mirror.longest(tokens)
                assert (match.cached_len, match.host_len) == (device_len, host_len)
                room = m.available_size() - m.prefix_cache.evictable_len(match.handle)
                row = m.alloc_req(match)
                assert row is not None
                if room >= host_len:
                    assert match.cached_len == device_len + host_len, "a host hit not loaded"
                else:
                    assert match.cached_len in (device_len, device_len + host_len)
                running.append(Req(tokens, len(tokens), row, match.cached_len))
            elif op == "extend" and idle:
                req = data.draw(st.sampled_from(idle), label="req")
                if req.computed < req.prompt_len:
                    chunk = data.draw(st.integers(1, req.prompt_len - req.computed), label="n")
                    slots = m.alloc_slots(req.row, chunk)
                    if slots is not None:
                        for i, slot in enumerate(slots.tolist()):
                            forward[slot] = tuple(req.tokens[: req.computed + i + 1])
                        req.computed += chunk
                        busy.append(req)
                        to_cache.append(req)
            elif op == "decode" and idle:
                batch = [r for r in idle if r.computed == len(r.tokens) < 8 * page_size]
                slots = m.alloc_decode_slots([r.row for r in batch])
                if slots is not None:
                    for req, slot in zip(batch, slots.tolist(), strict=True):
                        req.tokens.append(data.draw(st.integers(0, 3), label="sampled"))
                        forward[slot] = tuple(req.tokens[: req.computed + 1])
                        req.computed += 1
                        busy.append(req)
            elif op in ("finish", "abort") and idle:
                req = data.draw(st.sampled_from(idle), label="req")
                running.remove(req)
                if op == "finish":
                    m.cache_finished_req(req.row, req.tokens[: req.computed])
                else:
                    m.free_req(req.row)
            elif op == "evict":
                m.evict(data.draw(st.integers(0, 3 * page_size), label="evict"))
            check()
        _run_step(m, device_kv, host_kv, forward)
        # before process(): copies queued from here on are made in the next step
        device, host = _tiers(m)
        for tier, kv in ((device, device_kv), (host, host_kv)):
            for path, slots in tier.items():
                for i, slot in enumerate(slots):
                    assert kv.get(slot) == path[: len(path) - len(slots) + i + 1], "stale K/V"
        for req in to_cache:  # the engine's process(): computed chunks go into the tree
            m.cache_unfinished_req(req.row, req.tokens[: req.computed])
        check()
        device, host = _tiers(m)
        assert set(device) == mirror.device and set(host) == mirror.host
        for req in running:
            held = m.req_to_token.read(req.row, 0, req.computed).tolist()
            for i, slot in enumerate(held):
                assert device_kv.get(slot) == tuple(req.tokens[: i + 1]), "a row lost its K/V"
    note_event(f"host tier used: loaded {bool(cache_of(m).num_loaded_tokens)}, "
          f"written {bool(cache_of(m).num_written_tokens)}, host evicted {mirror.num_host_evicted > 0}")
    for req in running:
        m.free_req(req.row)
    _run_step(m, device_kv, host_kv, {})
    check()
    cache = m.host_cache
    assert cache is not None
    assert m.size_info.protected_size == 0
    assert m.allocator.available_size() + m.size_info.evictable_size == m.capacity
    assert cache.host_allocator.available_size() + cache.host_size == cache.host_capacity


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", [1, 16])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_two_tier_lifecycles_keep_kv_and_ownership_exact(
    page_size: int, write_policy: str, data: st.DataObject
) -> None:
    _run(data, page_size, write_policy)
