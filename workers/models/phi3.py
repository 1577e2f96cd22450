"""Phi-3: the Llama block, with q/k/v and gate/up stored fused in the checkpoint
(`qkv_proj` = [q; k; v], `gate_up_proj` = [gate; up]). They are split into their parts on load,
so every rank still reads only its own shard of each."""

from __future__ import annotations

from collections.abc import Iterator

from ..layers.source import CheckpointTensor
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_parts(self, name: str,
                         tensor: CheckpointTensor) -> Iterator[tuple[str, CheckpointTensor]]:
        c = self.config
        prefix, _, leaf = name.rpartition(".")
        module_path, _, module = prefix.rpartition(".")
        if module == "qkv_proj":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            parts = [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
        elif module == "gate_up_proj":
            size = c.intermediate_size
            parts = [("gate_proj", 0, size), ("up_proj", size, size)]
        else:
            yield name, tensor
            return
        for part, start, length in parts:
            yield f"{module_path}.{part}.{leaf}", tensor.part(start, length)
