"""The physical KV pool of one rank: K and V of this rank's KV heads, indexed by slot.

Slot layout (shared with the engine's allocator):

    slots 0 .. page_size-1        page 0, padding: padded batch entries write here, never read
    slots p*page_size .. +page_size-1   page p, for p in 1 .. num_pages

so each layer holds `(num_pages + 1) * page_size` slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_memory import zeroed
from .layers.fused import TORCH_OPS, FusedOps


def zero_buffer(shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
    """A pool buffer of zeros; on the CPU from the kernel's zero pages (`host_memory.zeroed`),
    so that a large pool costs nothing to make and only the slots used are ever touched."""
    if torch.device(device).type == "cpu":
        return zeroed(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class KVPoolConfig:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int  # heads on this rank
    head_dim: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return (self.num_pages + 1) * self.page_size

    @property
    def max_num_tokens(self) -> int:
        """Usable slots (padding page excluded)."""
        return self.num_pages * self.page_size


class KVPool:
    """`k_buffers[layer]` / `v_buffers[layer]`: `[num_slots, num_kv_heads, head_dim]`. New
    tokens are written through the fused-op seam's `store_kv` (`ops`: the runner's choice)."""

    def __init__(self, config: KVPoolConfig, device: torch.device | str) -> None:
        if config.num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {config.num_pages}")
        self.config = config
        self.ops: FusedOps = TORCH_OPS
        shape = (config.num_slots, config.num_kv_heads, config.head_dim)
        self.k_buffers = [zero_buffer(shape, config.dtype, device)
                          for _ in range(config.num_layers)]
        self.v_buffers = [zero_buffer(shape, config.dtype, device)
                          for _ in range(config.num_layers)]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every slot-indexed buffer (dim 0 is the slot), for the host tier to mirror."""
        return self.k_buffers + self.v_buffers

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_buffers + self.v_buffers)

    def set_kv(self, layer_id: int, out_cache_loc: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Write the new tokens' K/V ([T, heads, head_dim]) at slots `out_cache_loc` ([T],
        int32 or int64)."""
        self.ops.store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], out_cache_loc,
                          k, v, self.config.page_size)


class MLAKVPool:
    """The latent pool of multi-head latent attention (SGLang's `MLATokenToKVPool`):
    `kv_buffers[layer]`: `[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`, each row one token's
    [normed c_kv | rotated k_pe], shared by every head. Not head-sharded: every rank holds all of
    it. `config.num_kv_heads` is 1 and `config.head_dim` the latent width."""

    def __init__(self, config: KVPoolConfig, device: torch.device | str) -> None:
        if config.num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {config.num_pages}")
        if config.num_kv_heads != 1:
            raise ValueError(f"the latent pool holds one latent per token, not "
                             f"{config.num_kv_heads} heads")
        self.config = config
        shape = (config.num_slots, 1, config.head_dim)
        self.kv_buffers = [zero_buffer(shape, config.dtype, device)
                           for _ in range(config.num_layers)]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every slot-indexed buffer (dim 0 is the slot), for the host tier to mirror."""
        return list(self.kv_buffers)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_buffers)

    def set_kv(self, layer_id: int, out_cache_loc: torch.Tensor, latent: torch.Tensor) -> None:
        """Write the new tokens' latents ([T, latent_dim]) at slots `out_cache_loc` ([T])."""
        self.kv_buffers[layer_id][out_cache_loc, 0] = latent.to(self.config.dtype)


class DoubleSparseKVPool(KVPool):
    """K/V plus SGLang's `DoubleSparseTokenToKVPool` label buffer: `label_buffers[layer]`:
    `[num_slots, num_kv_heads, heavy_channel_num]`, each token's key on its head's heavy
    channels (`heavy_channels[layer]`: `[num_kv_heads, heavy_channel_num]`, set before the
    first token is written)."""

    def __init__(self, config: KVPoolConfig, device: torch.device | str,
                 heavy_channel_num: int) -> None:
        super().__init__(config, device)
        if not 0 < heavy_channel_num <= config.head_dim:
            raise ValueError(f"heavy_channel_num must be in [1, head_dim={config.head_dim}], "
                             f"got {heavy_channel_num}")
        shape = (config.num_slots, config.num_kv_heads, heavy_channel_num)
        self.label_buffers = [zero_buffer(shape, config.dtype, device)
                              for _ in range(config.num_layers)]
        self.heavy_channels = torch.zeros(config.num_layers, config.num_kv_heads,
                                          heavy_channel_num, dtype=torch.long, device=device)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return super().buffers + self.label_buffers

    @property
    def num_bytes(self) -> int:
        return super().num_bytes + sum(t.numel() * t.element_size() for t in self.label_buffers)

    def set_kv(self, layer_id: int, out_cache_loc: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        super().set_kv(layer_id, out_cache_loc, k, v)
        channels = self.heavy_channels[layer_id][None].expand(k.shape[0], -1, -1)
        self.label_buffers[layer_id][out_cache_loc] = k.gather(-1, channels).to(self.config.dtype)
