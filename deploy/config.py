"""The application's settings: one pydantic model behind the CLI, a YAML file and `build_app`.

`engine_settings.engine_config` is the only place where they become the engine's frozen config.
Reading a YAML file is `config_file`'s job, and finding the model's folder `model_path`'s; both
are re-exported here, where tests and benchmarks import them from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raydix.engine.async_engine import MAX_WAITING_REQUESTS
from raydix.router.state import MAX_APPROX_TOKENS
from raydix.workers.config import DEFAULT_SHAPE, WorkerConfig

from .config_file import describe_error as describe_error
from .config_file import load_yaml as load_yaml
from .model_path import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from .model_path import resolve_model_path as resolve_model_path

STARTUP_TIMEOUT_S = 600.0  # the default bound on a replica's start-up


class AutoscalingSettings(BaseModel):
    """Passed to Serve's autoscaling config of the engine deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="fewest engine replicas")
    max_replicas: int = Field(1, ge=1, description="most engine replicas")
    target_ongoing_requests: float = Field(
        32.0, gt=0, description="requests per replica that Serve aims for"
    )


class AppConfig(BaseModel):
    """Everything `raydix serve` can be told, from flags or from a YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # what to serve
    model: str = Field(
        DEFAULT_MODEL,
        description="'default' (SmolLM2-135M-Instruct, packaged) or a local Hugging Face folder",
    )
    served_model_name: str | None = Field(
        None, description="the name clients pass as `model`; default: derived from the model"
    )
    model_cache_dir: str | None = Field(
        None, description="where the default model is converted to (default ~/.cache/raydix)"
    )
    # where
    address: str | None = Field(
        None, description="join this Ray cluster; without it a local Ray starts embedded"
    )
    host: str = Field("127.0.0.1", description="HTTP host")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    api_key: str | None = Field(
        None, description="clients must send `Authorization: Bearer <key>` (env RAYDIX_API_KEY)"
    )
    # replicas and ranks
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per replica")
    replicas: int = Field(1, ge=1, description="engine replicas (ignored with autoscaling)")
    ingress_replicas: int = Field(1, ge=1, description="HTTP ingress replicas (tokenize, stream)")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="let Serve scale the engine replicas"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where ranks run; auto: cuda when the cluster has GPUs"
    )
    use_gpu_bundles: bool | None = Field(
        None,
        description="reserve one Ray GPU per rank; default: when device is cuda "
        "(true with device cpu runs on fake GPUs, for tests)",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="weights and KV dtype; auto: bf16 on CUDA, on CPU bf16 "
        "where the CPU has native bf16 and it measures clearly faster than fp32 at start on the "
        "model's shape, fp32 otherwise (fp32 is exact against transformers)"
    )
    attention_backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto", description="attention kernels; auto: flashinfer on CUDA, torch on CPU"
    )
    disable_cuda_graph: bool = Field(
        False, description="CUDA: run decode eagerly instead of under CUDA graphs"
    )
    overlap_schedule: Literal["auto", "on", "off"] = Field(
        "auto", description="form each step while the previous one runs; auto: on with CUDA, "
        "off on CPU (where the forward needs the cores the scheduler would use)"
    )
    cuda_graph_max_bs: int | None = Field(
        None, ge=1, description="CUDA: largest decode batch captured under a CUDA graph; "
        "default: max_running_requests"
    )
    cuda_graph_plan: Literal["once", "every_step"] | None = Field(
        None, description="CUDA graphs: once (default): flashinfer's decode is planned once per "
        "captured batch size with its KV split off, and a replay only writes the page table; "
        "every_step: flashinfer splits long contexts across the GPU and plans every replay "
        "(better for a few very long requests, more host work per step)"
    )
    kv_pool: Literal["auto", "double-sparse"] = Field(
        "auto", description="KV pool; auto: the model's (K and V per head, or one latent per "
        "token for latent attention); double-sparse: an approximation for long contexts, decode "
        "attends over the ds_heavy_token_num tokens that score best on ds_heavy_channel_num key "
        "channels (needs attention_backend torch)"
    )
    ds_heavy_channel_num: int = Field(WorkerConfig.ds_heavy_channel_num, ge=1, description="double-sparse: key channels per "
                                      "head that score tokens")
    ds_heavy_token_num: int = Field(WorkerConfig.ds_heavy_token_num, ge=1, description="double-sparse: tokens each query "
                                    "head attends over")
    ds_sparse_decode_threshold: int = Field(WorkerConfig.ds_sparse_decode_threshold, ge=0, description="double-sparse: contexts "
                                            "shorter than this decode densely")
    ds_channel_config: str | None = Field(
        None, description="double-sparse: JSON file of heavy channels per layer and KV head; "
        "default: measured on a calibration prompt at start"
    )
    # memory and scheduling
    mem_fraction_static: float = Field(
        WorkerConfig.mem_fraction_static, gt=0, le=1,
        description="share of device memory for weights and KV pool"
    )
    max_total_tokens: int | None = Field(None, ge=1, description="cap on KV pool slots")
    cpu_memory_budget_gib: float = Field(
        WorkerConfig.cpu_memory_budget_bytes / (1 << 30), gt=0,
        description="on CPU: memory that stands in for free device memory"
    )
    page_size: int = Field(DEFAULT_SHAPE.page_size, ge=1, description="KV slots per page")
    max_running_requests: int = Field(DEFAULT_SHAPE.max_running_requests, ge=1,
                                      description="requests decoded together")
    max_waiting_requests: int = Field(
        MAX_WAITING_REQUESTS, ge=0,
        description="requests queued beyond the running ones before 503"
    )
    max_context_len: int | None = Field(
        None, ge=2, description="prompt + output tokens; default: the model's limit, at most 8192"
    )
    stream_interval: int = Field(1, ge=1, description="a stream's tokens go out every N tokens (the "
                                 "first and the last at once): fewer messages per token")
    chunked_prefill_size: int | None = Field(
        None, ge=1, description="prompt chunk per step; default: 2048 on CUDA and on CPUs "
        "with AMX tiles (dtype auto or bfloat16), else 512 on CPU"
    )
    max_prefill_tokens: int | None = Field(
        None, ge=1, description="new prompt tokens per step; default: 8192 on CUDA, 2048 on CPUs "
        "with AMX tiles (dtype auto or bfloat16), else 512 on CPU"
    )
    schedule_policy: Literal["fcfs", "lpm", "priority"] = Field(
        "fcfs", description="order of waiting requests"
    )
    disable_radix_cache: bool = Field(False, description="turn off prefix caching")
    hicache_ratio: float = Field(
        0.0, ge=0, description="host KV tier: host tokens per device KV slot (at least 2); "
        "evicted prefixes stay in host memory and are loaded back on a hit; 0: off"
    )
    hicache_size: float = Field(
        0.0, ge=0, description="host KV tier: GB of host memory per rank, instead of "
        "hicache_ratio; 0: off"
    )
    hicache_write_policy: Literal["write_through", "write_through_selective", "write_back"] = (
        Field("write_through_selective", description="host KV tier: copy a prefix to host "
              "memory when cached, when it is hit again, or when evicted from the device")
    )
    # routing between engine replicas
    router: Literal["cache_aware", "round_robin", "power_of_two", "ray_prefix"] = Field(
        "cache_aware",
        description="how requests pick an engine replica: the longest cached prefix unless the "
        "load is imbalanced, in turn, the less loaded of two at random, or Ray Serve LLM's "
        "PrefixCacheAffinityRouter (its own routing history; a baseline)",
    )
    ray_imbalanced_threshold: float = Field(
        float("inf"), ge=0, description="ray_prefix: queue-length gap above which Ray's router "
        "routes by load (Ray's default: never)"
    )
    routing_policy: Literal["ttft", "threshold"] = Field(
        "ttft", description="cache_aware: the replica with the least expected time to first "
        "token (its uncached prompt tokens behind its prefill backlog), or the longest match "
        "above cache_threshold unless the holder is overloaded"
    )
    request_cost_tokens: float = Field(
        32.0, ge=0, description="cache_aware, ttft: what each request on a replica adds to a "
        "new one's wait, in prompt tokens"
    )
    miss_cost: float = Field(
        2.0, ge=1, description="cache_aware, ttft: what a prompt token the replica must compute "
        "counts against a token of another request's queue (its own wait and the capacity it "
        "takes from the requests behind it), on an empty KV pool; twice that on a full one"
    )
    tie_share: float = Field(
        0.15, ge=0, lt=1, description="cache_aware, ttft: replicas whose expected waits are "
        "within this share of the shortest are a tie, which the longest cached match wins (the "
        "estimate is no finer: a copy of a prefix made for a few percent of wait stays in a "
        "pool other prefixes need)"
    )
    cache_threshold: float = Field(
        0.5, ge=0, le=1, description="cache_aware, threshold: least share of the prompt a "
        "replica must hold"
    )
    balance_abs_threshold: int = Field(
        32, ge=0, description="cache_aware: load gap (requests) above which load wins over cache"
    )
    balance_rel_threshold: float = Field(
        1.5, ge=1, description="cache_aware: and busiest / idlest load ratio above which too"
    )
    saturated_kv_usage: float = Field(
        0.9, gt=0, le=1, description="cache_aware: a replica with requests waiting and this "
        "share of its KV pool held by running requests is full; the idlest one gets its hits"
    )
    host_hit_weight: float = Field(
        0.5, ge=0, le=1, description="cache_aware: a prefix a replica holds only in its host KV "
        "tier counts this much per token (a device hit 1, a miss 0)"
    )
    router_mode: Literal["exact", "approximate"] = Field(
        "exact",
        description="cache_aware: the router's tree follows the replicas' cache events (exact), "
        "or its own routing decisions, with an LRU cap (approximate: no events are sent)",
    )
    router_approx_tokens: int = Field(
        MAX_APPROX_TOKENS, ge=1, description="cache_aware, approximate: most tokens the router's tree keeps"
    )
    router_decision_timeout_s: float = Field(
        0.05, gt=0, description="cache_aware: wait this long for the router, then route by load"
    )
    # HTTP limits
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="how tool calls are written and parsed; auto: from the chat "
        "template (hermes when it shows none)")
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="larger request bodies get 413"
    )
    startup_timeout_s: float = Field(STARTUP_TIMEOUT_S, gt=0,
                                     description="bound on a replica's start-up")
    autoscaler_timeout_s: float = Field(
        600.0, gt=0, description="when the cluster can't hold every engine replica but its "
        "autoscaler can add nodes that do: how long `raydix serve` waits for them"
    )
    health_check_period_s: float = Field(
        5.0, gt=0, description="how often Serve checks each engine replica (its loop and ranks)"
    )
    rolling_update_percentage: float = Field(
        0.2, gt=0, le=1, description="the share of the engine replicas that a new deployment of "
        "the app replaces at a time (Serve's rolling update; 1: all at once)"
    )
    shutdown_timeout: float = Field(
        5.0, ge=0, description="seconds that requests in flight get to finish after SIGTERM or "
        "Ctrl-C, before they are aborted"
    )
    cpu_threads: int | None = Field(
        None, ge=1, description="on CPU with tp 1: threads of each engine replica, which reserves "
        "as many Ray CPUs; default: the cores minus one when that leaves two, else one, shared "
        "among the replicas"
    )
    disable_direct_ingress: bool = Field(
        False, description="serve HTTP through Serve's proxy, not from the ingress replica "
        "itself (direct ingress: one hop less per stream chunk; used with a local Ray and one "
        "ingress replica, see deploy/direct_ingress.py)"
    )
    separate_ingress: bool = Field(
        False, description="with one fixed engine replica: serve HTTP from an ingress replica "
        "of its own, not from the engine replica itself (by default the one replica is its own "
        "ingress: one process less on each token's path, see deploy/engine_ingress.py)"
    )
    disable_engine_process: bool = Field(
        False, description="with tp 1: step each replica's engine on a thread of the replica "
        "instead of in a process of its own (the default, as vLLM's engine core: the step no "
        "longer shares the GIL with the event loop that streams the tokens; see "
        "engine/engine_process.py); on CUDA the rank then runs in a worker actor in a GPU "
        "bundle, as with tp > 1, instead of in the replica's engine process"
    )
    disable_cpu_decode_graph: bool = Field(
        False, description="on CPU: run a lone decode token eagerly, with oneDNN-packed weights, "
        "instead of through the compiled one-token graph (plain weights; compiled at the first "
        "start on a machine, about 1-2 minutes, then loaded from inductor's cache)"
    )
    disable_cpu_step_graph: bool = Field(
        False, description="on CPU: run prompts' layers eagerly instead of through the compiled "
        "step graph (with the decode graph only; compiled at the first start on a machine, "
        "about 10 s, then loaded from inductor's cache in about 3 s)"
    )
    disable_cpu_compiled_attention: bool = Field(
        False, description="on CPU: decode attention always reads dense K/V copies, never the "
        "paged kernel built at start (a C file: under a second, then loaded from "
        "~/.cache/raydix/kernels)"
    )
    disable_huge_pages: bool = Field(
        False, description="on CPU: keep the weights and activations on 4 KiB pages instead of "
        "starting the engine process (and the ranks' actors) with glibc's malloc on 2 MiB "
        "transparent huge pages (fewer TLB misses as a step streams the weights; see "
        "workers/huge_pages.py)"
    )
    disable_kv_prefault: bool = Field(
        False, description="on CPU: leave the KV pool's pages to fault in at their first K/V "
        "write instead of populating the next ones ahead of use while the engine is idle "
        "(workers/kv_prefault.py)"
    )
    debug_cache_audit: bool = Field(
        False, description="debug: audit each replica's KV cache in stats calls made while it is "
        "idle (walks the whole pool: seconds at millions of slots)"
    )

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if 0 < self.hicache_ratio < 2:
            raise ValueError(f"hicache_ratio must be 0 (off) or at least 2, got "
                             f"{self.hicache_ratio:g}")
        if self.hicache_ratio and self.hicache_size:
            raise ValueError("set hicache_ratio or hicache_size, not both")
        if (self.hicache_ratio or self.hicache_size) and self.disable_radix_cache:
            raise ValueError("the host KV tier (hicache_ratio / hicache_size) needs the radix "
                             "cache, which disable_radix_cache turns off")
        if self.attention_backend == "flashinfer" and self.device == "cpu":
            raise ValueError("attention_backend flashinfer needs device cuda")
        if self.device == "cpu" and self.cuda_graph_max_bs is not None:
            raise ValueError("cuda_graph_max_bs needs device cuda")
        if self.device == "cpu" and self.cuda_graph_plan is not None:
            raise ValueError("cuda_graph_plan needs device cuda")
        if self.router != "ray_prefix" and self.ray_imbalanced_threshold != float("inf"):
            raise ValueError(f"ray_imbalanced_threshold applies to router ray_prefix, not "
                             f"{self.router}")
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == DEFAULT_MODEL:
            return DEFAULT_MODEL_NAME
        return Path(self.model).name or self.model

