"""/metrics in the Prometheus text format.

Request-level series (requests, tokens, time to first token, time per output token) are
measured at the ingress, as clients see them. Engine-level series (queue, KV usage, cache hit
rate, engine token counters) come from each engine replica's `ReplicaStats`, labelled with
the replica id. With the cache-aware router, the router actor's series follow: its decision
latency and, per replica, the share of routed prompt tokens that replica already held.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from raydix.engine.request import RequestOutput

from .errors import ApiError
from .replica_stats import ReplicaStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class IngressMetrics:
    """Counters and histograms of one ingress replica (its own registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("raydix_requests", "finished API requests", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("raydix_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.cached_tokens = Counter("raydix_cached_prompt_tokens", "prompt tokens served from "
                                     "the prefix cache", registry=r)
        self.generation_tokens = Counter("raydix_generation_tokens", "output tokens", registry=r)
        self.ttft = Histogram("raydix_time_to_first_token_seconds", "time to the first output "
                              "token", buckets=_LATENCY_BUCKETS, registry=r)
        # the time to the first token split where the engine replica's part is known: from its
        # receipt of the request to the first output, and the rest (the ingress, the routing
        # decision, the calls between processes both ways)
        self.engine_ttft = Histogram("raydix_engine_time_to_first_token_seconds",
                                     "time to the first output token inside the engine replica",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.path_ttft = Histogram("raydix_path_time_to_first_token_seconds",
                                   "time to the first output token outside the engine replica",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("raydix_time_per_output_token_seconds", "mean time between output "
                              "tokens of a request", buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("raydix_request_latency_seconds", "request start to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)

    @contextlib.contextmanager
    def count_errors(self, endpoint: str) -> Iterator[None]:
        """Count a refused or failed request under its HTTP status."""
        try:
            yield
        except ApiError as e:
            self.requests.labels(endpoint, str(e.status)).inc()
            raise
        except Exception:
            self.requests.labels(endpoint, "500").inc()
            raise

    def track(self, chat: bool, start: float | None = None) -> RequestTracker:
        """A tracker of one request whose clock started at `start` (`time.perf_counter()`;
        None: now). The ingress starts it as its handler is entered, so the time to the first
        token includes parsing, the chat template and a grammar's compilation, as the client
        waits for them."""
        return RequestTracker(self, "chat_completions" if chat else "completions", start)


class RequestTracker:
    """Times one API request from its start to its last output."""

    def __init__(self, metrics: IngressMetrics, endpoint: str,
                 start: float | None = None) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.start = time.perf_counter() if start is None else start
        self._recorded = False

    def done(self, status: int | str) -> None:
        if not self._recorded:
            self._recorded = True
            self.metrics.requests.labels(self.endpoint, str(status)).inc()

    async def watch(self, events: AsyncIterator[tuple[int, RequestOutput]]
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        first: float | None = None
        num_tokens = 0
        seen_prompt: set[int] = set()
        m = self.metrics
        try:
            async for i, out in events:
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
                    m.ttft.observe(first - self.start)
                    if out.engine_ttft_s is not None:
                        m.engine_ttft.observe(out.engine_ttft_s)
                        m.path_ttft.observe(max(first - self.start - out.engine_ttft_s, 0.0))
                num_tokens += len(out.new_token_ids)
                m.generation_tokens.inc(len(out.new_token_ids))
                if out.finished and i not in seen_prompt:
                    seen_prompt.add(i)
                    m.prompt_tokens.inc(out.usage.prompt_tokens)
                    m.cached_tokens.inc(out.usage.cached_tokens)
                yield i, out
            end = time.perf_counter()
            m.latency.observe(end - self.start)
            if first is not None and num_tokens > 1:
                m.tpot.observe((end - first) / (num_tokens - 1))
            self.done(200)
        finally:
            self.done("cancelled")


_ENGINE_GAUGES = (
    ("raydix_num_running_requests", "requests in the running batch", "num_running"),
    ("raydix_num_waiting_requests", "requests queued in the scheduler", "num_waiting"),
    ("raydix_kv_usage_ratio", "share of the KV pool in use", "token_usage"),
    ("raydix_cache_hit_rate", "cached prompt tokens / prompt tokens", "cache_hit_rate"),
    ("raydix_generation_throughput", "output tokens per second since start",
     "generation_throughput"),
    ("raydix_host_kv_tokens", "tokens with a copy in the host KV tier", "num_host_tokens"),
    ("raydix_host_kv_usage_ratio", "share of the host KV tier in use", "host_token_usage"),
    ("raydix_host_hit_rate", "prompt tokens loaded back from the host tier / prompt tokens",
     "host_hit_rate"),
    ("raydix_host_load_throughput", "tokens loaded back from the host tier per second since "
     "start", "load_throughput"),
    ("raydix_host_write_throughput", "tokens written to the host tier per second since start",
     "write_throughput"),
)
_ENGINE_COUNTERS = (
    ("raydix_engine_generated_tokens", "output tokens of the engine", "num_generated_tokens"),
    ("raydix_engine_prompt_tokens", "prompt tokens admitted", "num_prompt_tokens"),
    ("raydix_engine_cached_tokens", "prompt tokens served from the prefix cache",
     "num_cached_tokens"),
    ("raydix_engine_retractions", "requests sent back to the queue for memory",
     "num_retractions"),
    ("raydix_engine_finished_requests", "requests finished", "num_finished"),
    ("raydix_engine_steps", "engine steps run (each one batch of prompt chunks and decode rows)",
     "num_steps"),
    ("raydix_engine_host_hit_tokens", "prompt tokens loaded back from the host KV tier",
     "num_host_hit_tokens"),
    ("raydix_engine_host_loaded_tokens", "tokens copied from the host KV tier to the device",
     "num_loaded_tokens"),
    ("raydix_engine_host_written_tokens", "tokens copied from the device to the host KV tier",
     "num_written_tokens"),
)

_REPLICA_GAUGES = (
    ("raydix_requests_in_flight", "requests handed to the replica and not finished",
     "num_in_flight"),
    ("raydix_kv_capacity_tokens", "KV pool capacity of the replica, in tokens", "kv_capacity"),
    ("raydix_kv_used_tokens", "KV pool tokens held by requests and the prefixes they use",
     "num_kv_used_tokens"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_engine(stats: Sequence[ReplicaStats]) -> str:
    """Per-replica engine series, written in the exposition format by hand."""
    lines: list[str] = []
    for name, help_text, field in _ENGINE_GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{replica="{_label(s.replica_id)}"}} {float(getattr(s.metrics, field))}'
                  for s in stats]
    for name, help_text, field in _ENGINE_COUNTERS:
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        lines += [f'{name}_total{{replica="{_label(s.replica_id)}"}} '
                  f"{float(getattr(s.metrics, field))}" for s in stats]
    for name, help_text, field in _REPLICA_GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{replica="{_label(s.replica_id)}"}} {float(getattr(s, field))}'
                  for s in stats]
    name = "raydix_engine_replicas"
    lines += [f"# HELP {name} engine replicas reporting their stats", f"# TYPE {name} gauge",
              f"{name} {float(len(stats))}"]
    return "\n".join(lines) + "\n"


def render_router(stats: Mapping[str, float]) -> str:
    """The router actor's series (`RouterActor.stats`): decision latency quantiles, the size of
    its tree, the requests on their way to a replica, and per replica the requests sent to it and the share of their prompt tokens it
    already held."""
    name = "raydix_router_decision_latency_us"
    lines = [f"# HELP {name} time of one routing decision in the router actor",
             f"# TYPE {name} summary"]
    for quantile, key in (("0.5", "decision_p50_us"), ("0.99", "decision_p99_us")):
        lines.append(f'{name}{{quantile="{quantile}"}} {float(stats.get(key, 0.0))}')
    name = "raydix_router_tree_tokens"
    lines += [f"# HELP {name} tokens in the router's global prefix tree", f"# TYPE {name} gauge",
              f"{name} {float(stats.get('tree_tokens', 0.0))}"]
    name = "raydix_router_requests_in_transit"
    lines += [f"# HELP {name} requests routed that no replica has reported receiving yet",
              f"# TYPE {name} gauge", f"{name} {float(stats.get('in_transit', 0.0))}"]
    for name, kind, key, help_text in (
            ("raydix_router_hit_rate", "gauge", "hit_rate",
             "prompt tokens the chosen replica held / prompt tokens routed to it"),
            ("raydix_router_decisions_total", "counter", "decisions",
             "requests the router actor sent to each replica")):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{_label(k.split(":", 1)[1])}"}} {float(value)}'
                  for k, value in sorted(stats.items()) if k.startswith(f"{key}:")]
    return "\n".join(lines) + "\n"


def render_metrics(ingress: IngressMetrics, stats: Sequence[ReplicaStats],
                   router_stats: Mapping[str, float] | None = None) -> str:
    text = generate_latest(ingress.registry).decode() + render_engine(stats)
    return text + render_router(router_stats) if router_stats is not None else text
