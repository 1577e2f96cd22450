"""Build the model on the meta device, then fill each rank's shard from safetensors.

Each layer that owns parameters has a `weight_loader(param, CheckpointTensor, shard_id)` that
reads only the slice this rank owns (`safe_open(...).get_slice`), so a rank never holds the full checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .config import ModelConfig
from .layers.source import CheckpointTensor
from .models import LlamaForCausalLM, build_model
from .parallel import TPGroup

logger = logging.getLogger(__name__)

# checkpoint tensors that carry no weights of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def load_model(folder: str | Path, config: ModelConfig, group: TPGroup, dtype: torch.dtype,
               device: torch.device | str, show_progress: bool = True) -> LlamaForCausalLM:
    """The model of `folder`, with this rank's shard of every weight, in eval mode.

    Rank 0 shows a progress bar over the checkpoint's tensors (`show_progress`)."""
    with torch.device("meta"):
        model = build_model(config, group)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.init_buffers(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = safetensors_files(folder)
    num_tensors = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            num_tensors += len(f.keys())
    progress = tqdm(total=num_tensors, desc=f"loading {Path(folder).name}", unit="tensor",
                    disable=not show_progress or group.tp_rank != 0)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                progress.update()
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                whole = CheckpointTensor(f.get_slice(name))
                for part, source in model.checkpoint_parts(name, whole):
                    for target in [part, *model.checkpoint_aliases(part)]:
                        param_name, shard_id = _map_name(target, model)
                        if param_name not in params:
                            raise ValueError(f"checkpoint tensor {name!r} ({path.name}) has no "
                                             f"matching parameter {param_name!r} in the model")
                        module = model.get_submodule(param_name.rpartition(".")[0])
                        module.weight_loader(  # type: ignore[operator]
                            params[param_name], source, shard_id)
                        loaded.add(f"{param_name}/{shard_id}")
    progress.close()
    _check_complete(model, loaded)
    return model.eval()


def _map_name(name: str, model: LlamaForCausalLM) -> tuple[str, str | int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.packed_modules:
            merged, shard_id = model.packed_modules[part]
            return ".".join([*parts[:i], merged, *parts[i + 1:]]), shard_id
    return name, None


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    missing = []
    packed_parts: dict[str, list[str | int]] = {}
    for merged, shard_id in model.packed_modules.values():
        packed_parts.setdefault(merged, []).append(shard_id)
    for name, _ in model.named_parameters():
        module = name.split(".")[-2]
        shard_ids: list[str | int | None] = list(packed_parts.get(module, [None]))
        missing += [f"{name}/{s}" for s in shard_ids if f"{name}/{s}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:4]}")
