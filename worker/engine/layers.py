"""Small layers of the decoder: RMSNorm, rotary embedding, SiLU-and-mul.

Each follows the arithmetic of the Hugging Face reference (same dtype casts, same operation order), so
fp32 logits match transformers to rounding and bf16/fp16 runs round the way the reference does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.engine.model_config import RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), statistics in float32, rounded back before the scale."""
    dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(dtype)
    if normed.dtype != weight.dtype:
        return weight * normed
    return normed.mul_(weight)  # normed is always a fresh tensor: in place saves one [T, hidden] buffer


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [.., 2 * intermediate] gate/up projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate).mul_(up)


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, with Llama-3 style scaling when configured."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    if old_len is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (first half / second half of head_dim rotate together).

    cos/sin come from a float32 table indexed by position. On the CPU the table grows on demand
    (doubling), so a long max_model_len costs nothing until such positions are used; on an accelerator
    it is built for all max_positions at once, so a step never waits on reading the largest position.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.head_dim = head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, rope).to(device), persistent=False)
        self._cos = torch.empty(0, head_dim // 2, device=device)
        self._sin = torch.empty(0, head_dim // 2, device=device)
        self._grow_on_demand = device.type == "cpu"
        if not self._grow_on_demand:
            self._grow(max_positions)

    def _grow(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = max(needed, 2 * self._cos.shape[0], 256)
        pos = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        self._cos, self._sin = cos, sin
        return cos, sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim // 2] cos and sin in `dtype`, shared by every layer of one forward."""
        # Both tables read once into locals: the parts of a split CPU step call this from threads
        # of their own, and one may grow the tables between another's two reads.
        cos_table, sin_table = self._cos, self._sin
        if self._grow_on_demand and positions.numel():
            top = int(positions.max()) + 1
            if top > cos_table.shape[0] or top > sin_table.shape[0]:
                cos_table, sin_table = self._grow(top)
        cos = cos_table.index_select(0, positions).to(dtype)
        sin = sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (may be a strided view); returns a new contiguous tensor.

    Same values as the reference's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
