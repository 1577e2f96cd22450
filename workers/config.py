"""Frozen configs: what the model looks like (`ModelConfig`) and how a rank runs it (`WorkerConfig`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the model stack, not with the control plane's configs
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face `config.json` that the worker needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = str(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope parameters must be a mapping, got {rope!r}")
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        return cls.from_dict(json.loads(path.read_text()))


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
    page_size: int = 1
    max_running_requests: int = 64  # rows of the request->token table
    max_context_len: int = 4096  # columns of the request->token table
    max_prefill_tokens: int = 8192  # most prompt tokens in one step (sizes the activations)
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None  # cap on KV pool slots (excluding padding)
    cpu_memory_budget_bytes: int = 2 << 30  # stands in for free device memory on CPU
    cuda_graph: bool = False  # capture decode under CUDA graphs (CUDA only)
    cuda_graph_max_batch: int | None = None  # largest captured batch; None: max_running_requests
    warm_up: bool = True  # run every kernel the first requests need once, before serving
    cpu_packed_linear: bool = True  # CPU: linear layers through oneDNN-packed weights
    cpu_keep_freed_memory: bool = True  # CPU: glibc keeps freed activations (host_memory.py)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.attention_backend not in ("torch", "flashinfer"):
            raise ValueError(f"attention_backend must be 'torch' or 'flashinfer', "
                             f"got {self.attention_backend!r}")
        if self.max_running_requests < 1 or self.max_context_len < 1:
            raise ValueError("max_running_requests and max_context_len must be >= 1")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 1:
            raise ValueError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")

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
