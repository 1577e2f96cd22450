"""The cache's settings, and the one place they pick the prefix cache: radix, radix with a host
tier, or none."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PrefixCache
from .events import EventSink
from .hiradix import HiRadixCache
from .host_tier import DEFAULT_WRITE_POLICY
from .naive import NoPrefixCache
from .radix import RadixCache


@dataclass(frozen=True)
class CacheConfig:
    num_pages: int
    max_running_requests: int
    max_context_len: int
    page_size: int  # the table shape comes from the engine's scheduler config, no default here
    enable_prefix_cache: bool = True
    num_host_pages: int = 0  # > 0: a host tier of this many pages (hiradix.py)
    write_policy: str = DEFAULT_WRITE_POLICY
    write_through_threshold: int = 2

    def __post_init__(self) -> None:
        for name in ("num_pages", "max_running_requests", "max_context_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {self.num_host_pages}")
        if self.num_host_pages and not self.enable_prefix_cache:
            raise ValueError("the host KV tier needs the radix cache (it is turned off)")


def build_prefix_cache(config: CacheConfig, event_sink: EventSink | None = None) -> PrefixCache:
    """The prefix cache ``config`` asks for; its events go to ``event_sink``."""
    if config.num_host_pages:
        return HiRadixCache(
            config.page_size, config.num_host_pages, config.max_context_len, event_sink,
            config.write_policy, config.write_through_threshold)
    if config.enable_prefix_cache:
        return RadixCache(config.page_size, config.max_context_len, event_sink)
    return NoPrefixCache(config.page_size)
