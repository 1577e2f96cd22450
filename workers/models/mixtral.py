"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama block (llama.py) with a mixture of experts
(layers/moe.py) in place of the MLP on the layers `MoEConfig.sparse_layers` names; the other
layers keep the dense MLP (Qwen's `mlp_only_layers`, `decoder_sparse_step`).

Mixtral's checkpoints call the block `block_sparse_moe` and an expert's projections `w1`
(gate), `w3` (up) and `w2` (down); they are renamed to the module names used here (`mlp`,
`gate_proj`, `up_proj`, `down_proj`) as they are read.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..config import ModelConfig
from ..layers.moe import SparseMoE
from ..layers.source import CheckpointTensor
from ..parallel import TPGroup
from .llama import LlamaForCausalLM


class LlamaMoEForCausalLM(LlamaForCausalLM):
    """The Llama model with `SparseMoE` blocks (Qwen2-MoE, Qwen3-MoE)."""

    def __init__(self, config: ModelConfig, group: TPGroup) -> None:
        super().__init__(config, group)
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture} needs a mixture-of-experts config")
        for layer, sparse in zip(self.model.layers, moe.sparse_layers, strict=True):
            if sparse:  # built on the meta device: the dense MLP it replaces cost nothing
                layer.mlp = SparseMoE(config.hidden_size, moe, config.hidden_act, group)


_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj",
                  "w2": "down_proj"}


class MixtralForCausalLM(LlamaMoEForCausalLM):
    def checkpoint_parts(self, name: str,
                         tensor: CheckpointTensor) -> Iterator[tuple[str, CheckpointTensor]]:
        yield ".".join(_MIXTRAL_NAMES.get(p, p) for p in name.split(".")), tensor
