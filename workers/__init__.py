"""Per-GPU model worker: model shards, KV pool tensors, attention backends, sampler.

What the engine uses:

- `WorkerConfig` (frozen): model folder, tp_rank / tp_size, device, dtype, attention backend,
  page size, table size, pool sizing settings;
- `TPWorker(config, rendezvous)`: rank 0 calls `step(plan) -> StepResult` per step, other ranks
  call `follow()`; `max_num_tokens` tells the engine how many KV slots (pages * page_size) exist;
- the step protocol in `step`: `StepPlan` (built with `StepPlan.build` from `ScheduledRequest`s,
  `TableWrite`s and freed rows), `SamplingParams`, `StepResult`;
- `default_model_folder()`: SmolLM2-135M-Instruct converted once from its packaged GGUF.
"""

from .config import ModelConfig, WorkerConfig
from .gguf_convert import convert_gguf, default_model_folder
from .pool_sizing import profile_max_num_tokens
from .runner import ModelRunner
from .step import (
    GREEDY,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TableWrite,
    broadcast_plan,
)
from .worker import TPWorker

__all__ = [
    "GREEDY",
    "ModelConfig",
    "ModelRunner",
    "SamplingParams",
    "ScheduledRequest",
    "StepPlan",
    "StepResult",
    "TPWorker",
    "TableWrite",
    "WorkerConfig",
    "broadcast_plan",
    "convert_gguf",
    "default_model_folder",
    "profile_max_num_tokens",
]
