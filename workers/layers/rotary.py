"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama/Qwen), with the
scalings real checkpoints use: linear, dynamic (NTK), yarn, longrope and llama3.

Every position gets its own cos/sin row, computed once. Dynamic and longrope change their
frequencies with the sequence length; transformers recomputes them per forward from the
longest position in it, so the same token is rotated differently depending on how the prompt
was split. Here a token at position p is rotated as transformers rotates it when the sequence
is fed one token at a time (sequence length p + 1). The key of a position then depends on that
position alone, which the radix cache and chunked prefill need. Equal to transformers' greedy
`generate` whenever the prompt fits the original length; past it, equal to transformers fed
token by token.
"""

from __future__ import annotations

import math

import torch

from ..config import RopeConfig
from .fused import TORCH_OPS, FusedOps


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def rope_inv_freq(head_dim: int, rope: RopeConfig, seq_len: int = 0) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] for a sequence of `seq_len` tokens (dynamic and
    longrope depend on it; the other types do not)."""
    dim = rotary_dim(head_dim, rope)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    kind = rope.rope_type
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope.factor
    if kind == "dynamic":
        seq_len = max(seq_len, rope.original_max_position_embeddings)
        base = rope.theta * ((rope.factor * seq_len / rope.original_max_position_embeddings)
                             - (rope.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents)
    if kind == "longrope":
        long = seq_len > rope.original_max_position_embeddings
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (ext * rope.theta ** exponents)
    if kind == "llama3":
        return _llama3(inv_freq, rope)
    if kind == "yarn":
        return _yarn(dim, rope)
    raise ValueError(f"rope_type {kind!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, blend in between."""
    orig = rope.original_max_position_embeddings
    low_wavelen = orig / rope.low_freq_factor
    high_wavelen = orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                        - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled).float()


def _yarn(dim: int, rope: RopeConfig) -> torch.Tensor:
    """Interpolate the low frequencies by `factor`, keep the high ones, ramp in between."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_angles(head_dim: int, rope: RopeConfig, max_position: int) -> torch.Tensor:
    """Angles [max_position, rotary_dim / 2]: position p times its inverse frequencies."""
    t = torch.arange(max_position, dtype=torch.float32)
    if rope.rope_type == "dynamic":
        # one base per sequence length p + 1; below the original length it is the plain one
        dim = rotary_dim(head_dim, rope)
        orig = rope.original_max_position_embeddings
        seq_len = torch.clamp(t + 1, min=orig)
        base = rope.theta * ((rope.factor * seq_len / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return t[:, None] / (base[:, None] ** exponents[None, :])
    if rope.rope_type == "longrope":
        orig = rope.original_max_position_embeddings
        short = torch.outer(t, rope_inv_freq(head_dim, rope, orig))
        long = torch.outer(t, rope_inv_freq(head_dim, rope, orig + 1))
        return torch.where((t >= orig)[:, None], long, short)
    return torch.outer(t, rope_inv_freq(head_dim, rope))


class RotaryEmbedding:
    """cos/sin table for positions [0, max_position), applied through the fused-op seam. Not a
    module: the model builds it on the real device after the meta build (`init_buffers`)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position: int,
                 device: torch.device | str = "cpu", ops: FusedOps = TORCH_OPS) -> None:
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, rope)
        self.max_position = max_position
        self.rope = rope
        self.ops = ops
        freqs = rope_angles(head_dim, rope, max_position).to(device)
        # [max_position, rotary_dim]: each row [cos | sin], float32 (flashinfer's cache layout)
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * rope.attention_factor

    def apply(self, positions: torch.Tensor, q: torch.Tensor,
              k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns both rotated, in their input dtype (q and k
        may be rotated in place)."""
        return self.ops.rope(positions, q, k, self.cos_sin)
