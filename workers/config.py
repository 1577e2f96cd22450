"""Frozen configs: what the model looks like (`ModelConfig`), how a rank runs it (`WorkerConfig`),
and the replica's table shape that every rank and the scheduler share (`TableShape`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the model stack, not with the control plane's configs
    import torch


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one kind of layer, with its scaling (`rope_type`, as transformers
    names it): default, linear, dynamic, yarn, longrope or llama3. Fields a type does not use
    keep their defaults; `factor` and `original_max_position_embeddings` are resolved."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # rotate only the first fraction of each head
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # dynamic, yarn, longrope, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek)
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # yarn, longrope: scales cos and sin
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (layers/moe.py) and which layers have it."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (False)
    scoring: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    renormalize: bool = False  # the top-k weights are divided by their sum
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # grouped top-k: experts in `num_groups` groups, the best
    topk_group: int = 1  # `topk_group` groups kept per token (DeepSeek)
    correction_bias: bool = False  # DeepSeek-V3's `e_score_correction_bias`
    shared_intermediate_size: int = 0  # shared experts, 0 = none
    shared_expert_gate: bool = False  # the shared expert is scaled by a sigmoid gate (Qwen2-MoE)
    router_fp32: bool = False  # router logits in float32 (DeepSeek)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.num_groups or not 0 < self.topk_group <= self.num_groups:
            raise ValueError(f"{self.num_experts} experts cannot be split into {self.num_groups} "
                             f"groups with {self.topk_group} kept")
        if self.top_k > self.topk_group * self.num_experts // self.num_groups:
            raise ValueError(f"top_k={self.top_k} is more than the experts of {self.topk_group} "
                             "kept groups")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Per token and layer the KV pool holds one
    latent of `kv_lora_rank + qk_rope_head_dim` values, shared by every head."""

    q_lora_rank: int | None  # None: q is projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rotary pairs are (x0, x1), (x2, x3), ...

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """What the worker needs of a Hugging Face `config.json`, read through transformers' own
    config class and checked field by field (`models/registry.py`): a field that changes the
    forward is either here or refused at load."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str  # the MLP's activation: "silu" or "gelu_pytorch_tanh"
    rope: RopeConfig  # every layer's rotary embedding, or the full-attention layers' (Gemma 3)
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # per layer: how many positions a query sees (itself and window - 1 before it); 0 = all
    layer_windows: tuple[int, ...]
    qkv_bias: bool = False  # bias on q/k/v (Qwen2, Llama's attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias)
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma 3)
    local_rope: RopeConfig | None = None  # the windowed layers' own rotary embedding (Gemma 3)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float = 0.0  # cap * tanh(score / cap) before the softmax; 0 = off
    final_logit_softcap: float = 0.0  # the same on the output logits; 0 = off
    moe: MoEConfig | None = None  # mixture-of-experts MLP (Mixtral, Qwen2-MoE, DeepSeek)
    mla: MLAConfig | None = None  # latent attention and the latent KV pool (DeepSeek)

    def __post_init__(self) -> None:
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} "
                             "layers")

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_rope(self, layer_id: int) -> RopeConfig:
        if self.local_rope is not None and self.layer_windows[layer_id]:
            return self.local_rope
        return self.rope

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> ModelConfig:
        """Parse a `config.json` mapping; refuses what the models do not implement."""
        from .models.registry import parse_model_config  # models/ imports this module

        return parse_model_config(raw)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        return cls.from_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class TableShape:
    """The request→token table's shape and the page size, with the step size the ranks' buffers
    are sized for: one per replica. The scheduler's copy is the source (`SchedulerConfig`); the
    ranks' (`WorkerConfig`) and the cache manager's (`CacheConfig`) are derived from it, and the
    engine config refuses a mismatch by name. Its defaults are the only ones written."""

    page_size: int = 1
    max_running_requests: int = 64  # rows of the request→token table
    max_context_len: int = 4096  # columns of the request→token table
    max_prefill_tokens: int = 8192  # most prompt tokens in one step (sizes the activations)

    def __post_init__(self) -> None:
        for name in TABLE_SHAPE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, config: object) -> TableShape:
        """The shape a config carries (its fields of these names), checked."""
        return cls(**{name: getattr(config, name) for name in TABLE_SHAPE_FIELDS})


TABLE_SHAPE_FIELDS = tuple(f.name for f in fields(TableShape))
DEFAULT_SHAPE = TableShape()


@dataclass(frozen=True)
class WorkerConfig:
    """How one rank runs its shard. The engine builds one per rank (only `tp_rank` differs)."""

    model_path: str  # a local Hugging Face folder (config.json + *.safetensors)
    tp_rank: int = 0
    tp_size: int = 1
    device: str = "cpu"  # "cpu" or "cuda" / "cuda:N"
    # "float32", "bfloat16", "float16"; None: bf16 on CUDA, fp32 on CPU; "auto": bf16 on CUDA, on
    # CPU the faster of packed fp32 and bf16, measured at start (layers/packed.py)
    dtype: str | None = None
    attention_backend: str = "torch"  # "torch" or "flashinfer" (CUDA only)
    # the table shape (`TableShape`): the engine derives these from its scheduler config
    page_size: int = DEFAULT_SHAPE.page_size
    max_running_requests: int = DEFAULT_SHAPE.max_running_requests
    max_context_len: int = DEFAULT_SHAPE.max_context_len
    max_prefill_tokens: int = DEFAULT_SHAPE.max_prefill_tokens
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None  # cap on KV pool slots (excluding padding)
    cpu_memory_budget_bytes: int = 2 << 30  # stands in for free device memory on CPU
    cuda_graph: bool = False  # capture decode under CUDA graphs (CUDA only)
    cuda_graph_max_batch: int | None = None  # largest captured batch; None: max_running_requests
    # "once": each graph's flashinfer decode planned once, KV split off; "every_step": planned
    # before each replay, flashinfer's split on (attention/flashinfer_backend.py says when)
    cuda_graph_plan: str = "once"
    warm_up: bool = True  # run every kernel the first requests need once, before serving
    cpu_packed_linear: bool = True  # CPU: linear layers through oneDNN-packed weights
    cpu_keep_freed_memory: bool = True  # CPU: glibc keeps freed activations (host_memory.py)
    # CPU: the engine process and the ranks' actors start with malloc on 2 MiB pages
    # (huge_pages.py)
    cpu_huge_pages: bool = True
    # CPU: an idle engine populates the KV pool's next pages ahead of their first use
    # (kv_prefault.py)
    cpu_prefault_kv: bool = True
    # "auto": the model's pool (K and V per head; one latent per token for MLA models);
    # "double-sparse": K and V plus heavy-channel labels, and decode attends over the best
    # `ds_heavy_token_num` tokens only (an approximation for long contexts; double_sparse.py)
    kv_pool: str = "auto"
    ds_heavy_channel_num: int = 16  # key channels per head that score tokens
    ds_heavy_token_num: int = 256  # tokens each query head attends over
    ds_sparse_decode_threshold: int = 1024  # shorter contexts decode densely
    ds_channel_config: str | None = None  # heavy channels file; None: a calibration prompt
    # the host KV tier (host_kv_pool.py): host tokens per device token (>= 2), or GB per rank;
    # both 0: no host tier
    hicache_ratio: float = 0.0
    hicache_size_gb: float = 0.0
    cpu_compiled_attention: bool = True  # CPU: decode attention on the pages, compiled at start
    # CPU: a lone decode token runs one compiled graph (cpu_decode_graph.py), with the weights
    # kept plain rather than packed; models it does not cover run as without it
    cpu_decode_graph: bool = False
    # CPU, with the decode graph: the other steps (prompts) run their layers compiled too
    # (cpu_step_graph.py)
    cpu_step_graph: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be in [0, tp_size={self.tp_size})")
        TableShape.of(self)  # each field >= 1
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.attention_backend not in ("torch", "flashinfer"):
            raise ValueError(f"attention_backend must be 'torch' or 'flashinfer', "
                             f"got {self.attention_backend!r}")
        if self.kv_pool not in ("auto", "double-sparse"):
            raise ValueError(f"kv_pool must be 'auto' or 'double-sparse', got {self.kv_pool!r}")
        if min(self.ds_heavy_channel_num, self.ds_heavy_token_num) < 1:
            raise ValueError("ds_heavy_channel_num and ds_heavy_token_num must be >= 1")
        if self.hicache_ratio < 0 or self.hicache_size_gb < 0:
            raise ValueError("hicache_ratio and hicache_size must be >= 0")
        if self.hicache_ratio and self.hicache_ratio < 2:
            raise ValueError(f"hicache_ratio must be >= 2 (host tokens per device token), got "
                             f"{self.hicache_ratio:g}")
        if self.hicache_ratio and self.hicache_size_gb:
            raise ValueError("set hicache_ratio or hicache_size, not both")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.cuda_graph_plan not in ("once", "every_step"):
            raise ValueError(f"cuda_graph_plan must be 'once' or 'every_step', got "
                             f"{self.cuda_graph_plan!r}")

    @property
    def host_tier(self) -> bool:
        """Whether each rank keeps a host KV pool (the host tier of the prefix cache)."""
        return bool(self.hicache_ratio or self.hicache_size_gb)

    @property
    def graph_max_batch(self) -> int:
        """The largest decode batch captured under a CUDA graph (0 without graphs). By default
        it covers every batch the request table allows, so no decode step falls back to eager."""
        if not self.cuda_graph:
            return 0
        return self.cuda_graph_max_batch or self.max_running_requests

    @property
    def dtype_measured(self) -> bool:
        """The dtype is picked on the rank by measuring (`dtype="auto"` on CPU)."""
        return self.dtype == "auto" and not self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype, except for `dtype_measured` (the runner measures it; fp32 here)."""
        import torch

        if self.dtype is None or self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be one of {[*sorted(dtypes), 'auto']}, "
                             f"got {self.dtype!r}")
        return dtypes[self.dtype]
