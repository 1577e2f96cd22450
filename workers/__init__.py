"""Per-GPU model worker: model shards, KV pool tensors, attention backends, sampler.

What the engine uses:

- `WorkerConfig` (frozen): model folder, tp_rank / tp_size, device, dtype, attention backend,
  page size, table size, pool sizing settings;
- `TPWorker(config, rendezvous)`: rank 0 calls `step(plan) -> StepResult` per step, other ranks
  call `follow()`; `max_num_tokens` tells the engine how many KV slots (pages * page_size) exist;
- the step protocol in `step` (numpy only, no torch): `StepPlan` (built with `StepPlan.build`
  from `ScheduledRequest`s, `TableWrite`s and freed rows), `SamplingParams`, `StepResult`;
- `default_model_folder()`: SmolLM2-135M-Instruct converted once from its packaged GGUF.

Names are loaded on first use, so importing `raydix.workers.step` (the control plane does)
does not load torch or the model stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "GREEDY": "step",
    "SamplingParams": "step",
    "ScheduledRequest": "step",
    "StepPlan": "step",
    "StepResult": "step",
    "TableWrite": "step",
    "ModelConfig": "config",
    "WorkerConfig": "config",
    "broadcast_plan": "broadcast",
    "convert_gguf": "gguf_convert",
    "default_model_folder": "gguf_convert",
    "profile_max_num_tokens": "pool_sizing",
    "ModelRunner": "runner",
    "TPWorker": "worker",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
