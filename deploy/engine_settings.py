"""App settings -> the engine's frozen config: the defaults that depend on the device.

`engine_config` is the only place where `AppConfig` becomes an `EngineConfig`.
"""

from __future__ import annotations

from raydix.engine.config import EngineConfig, SchedulerConfig
from raydix.router.policy import RoutingPolicyConfig
from raydix.workers.config import ModelConfig, WorkerConfig
from raydix.workers.cpu_features import native_bf16

from .config import AppConfig


def resolve_device(config: AppConfig, num_cluster_gpus: float) -> str:
    if config.device != "auto":
        return config.device
    return "cuda" if num_cluster_gpus > 0 else "cpu"


def routing_policy(config: AppConfig) -> RoutingPolicyConfig | None:
    """The cache-aware policy's settings; None for the other routers."""
    if config.router != "cache_aware":
        return None
    return RoutingPolicyConfig(mode=config.routing_policy,
                               request_cost_tokens=config.request_cost_tokens,
                               miss_cost=config.miss_cost,
                               tie_share=config.tie_share,
                               cache_threshold=config.cache_threshold,
                               balance_abs_threshold=config.balance_abs_threshold,
                               balance_rel_threshold=config.balance_rel_threshold,
                               saturated_kv_usage=config.saturated_kv_usage,
                               host_hit_weight=config.host_hit_weight)


# (max_prefill_tokens, chunked_prefill_size) by device. A step's prompt tokens stall every
# running stream until the step ends: 8,192 take tens of milliseconds on a GPU but seconds on a
# CPU, so there a step takes at most about a second: 512 tokens of the default model in fp32,
# 2,048 in bf16 where the CPU has native bf16, AMX tiles or AVX-512-BF16
# (`benchmarks/step_budget_bench.py` measures it; README "The step budget on CPU")
STEP_BUDGETS = {"cuda": (8192, 2048), "cpu": (512, 512), "cpu-bf16": (2048, 2048)}


def step_budget(config: AppConfig, device: str) -> tuple[int, int]:
    """The default (max_prefill_tokens, chunked_prefill_size): `STEP_BUDGETS` for the device;
    on a CPU with native bf16 (read here, where the app is built) and a dtype that may be bf16,
    the larger CPU budget."""
    if device.startswith("cuda"):
        return STEP_BUDGETS["cuda"]
    if config.dtype in ("auto", "bfloat16") and native_bf16():
        return STEP_BUDGETS["cpu-bf16"]
    return STEP_BUDGETS["cpu"]


def attention_backend(config: AppConfig, device: str) -> str:
    """The backend `auto` stands for: flashinfer on CUDA (as SGLang and vLLM), torch on CPU."""
    if config.attention_backend != "auto":
        return config.attention_backend
    return "flashinfer" if device.startswith("cuda") else "torch"


def use_cuda_graph(config: AppConfig, device: str) -> bool:
    """CUDA-graph decode: on with flashinfer on CUDA unless disabled. The graphs need the
    flashinfer backend's static page tables, so a CUDA graph setting with any other backend is
    refused rather than ignored."""
    on_flashinfer = device.startswith("cuda") and attention_backend(config, device) == "flashinfer"
    for name in ("cuda_graph_max_bs", "cuda_graph_plan"):
        if getattr(config, name) is None:
            continue
        if not on_flashinfer:
            raise ValueError(f"{name} needs CUDA graphs, which run with the flashinfer "
                             f"backend on CUDA (here: device {device}, attention_backend "
                             f"{attention_backend(config, device)})")
        if config.disable_cuda_graph:
            raise ValueError(f"{name} is set but disable_cuda_graph turns the graphs off")
    return on_flashinfer and not config.disable_cuda_graph


def use_overlap_schedule(config: AppConfig, device: str) -> bool:
    """`auto`: on with CUDA (the GPU computes while the host forms the next step); off on CPU,
    where the forward's threads and the scheduler share the cores (benchmarks/overlap_bench.py)."""
    if config.overlap_schedule != "auto":
        return config.overlap_schedule == "on"
    return device.startswith("cuda")


def engine_config(config: AppConfig, model_path: str, device: str) -> EngineConfig:
    """The one translation from app settings to the engine's frozen config."""
    model = ModelConfig.from_folder(model_path)
    max_context_len = config.max_context_len or min(model.max_position_embeddings, 8192)
    default_prefill, default_chunk = step_budget(config, device)
    backend, graphs = attention_backend(config, device), use_cuda_graph(config, device)
    if model.mla is not None and backend != "torch":  # latent attention: torch backend only
        if config.attention_backend != "auto":
            raise ValueError(f"{model.architecture} uses latent attention (MLA), which runs on "
                             f"attention_backend torch only, not {backend}")
        backend, graphs = "torch", False
    worker = WorkerConfig(
        model_path=model_path,
        tp_size=config.tp,
        device=device,
        dtype=config.dtype,
        attention_backend=backend,
        cuda_graph=graphs,
        cuda_graph_max_batch=config.cuda_graph_max_bs,
        cuda_graph_plan=config.cuda_graph_plan or "once",
        mem_fraction_static=config.mem_fraction_static,
        max_total_tokens=config.max_total_tokens,
        cpu_memory_budget_bytes=int(config.cpu_memory_budget_gib * (1 << 30)),
        kv_pool=config.kv_pool,
        ds_heavy_channel_num=config.ds_heavy_channel_num,
        ds_heavy_token_num=config.ds_heavy_token_num,
        ds_sparse_decode_threshold=config.ds_sparse_decode_threshold,
        ds_channel_config=config.ds_channel_config,
        hicache_ratio=config.hicache_ratio,
        hicache_size_gb=config.hicache_size,
        cpu_decode_graph=not config.disable_cpu_decode_graph,
        cpu_step_graph=not config.disable_cpu_step_graph,
        cpu_compiled_attention=not config.disable_cpu_compiled_attention,
        cpu_huge_pages=not config.disable_huge_pages,
        cpu_prefault_kv=not config.disable_kv_prefault,
    )
    if worker.kv_pool == "double-sparse" and worker.attention_backend != "torch":
        raise ValueError(f"kv_pool double-sparse needs attention_backend torch (here: "
                         f"{worker.attention_backend}; pass --attention-backend torch)")
    scheduler = SchedulerConfig(
        max_running_requests=config.max_running_requests,
        max_context_len=max_context_len,
        page_size=config.page_size,
        max_prefill_tokens=config.max_prefill_tokens or default_prefill,
        chunked_prefill_size=config.chunked_prefill_size or default_chunk,
        schedule_policy=config.schedule_policy,
        overlap_schedule=use_overlap_schedule(config, device),
        enable_prefix_cache=not config.disable_radix_cache,
        hicache_write_policy=config.hicache_write_policy,
    )
    return EngineConfig.build(worker, scheduler)
