"""The per-token layer operations of the decoder, in two implementations with one interface.

- TorchOps: plain torch with the reference's rounding points (the CPU path; exact parity with
  transformers in float32). In float32 on the CPU the add + norm and the rotary run as one C pass
  each with the same bits (kernels/cpu/elementwise.py), where the engine's CpuPaths take them.
- TritonOps: the project's fused Triton kernels (kernels/): RMSNorm with the residual add fused,
  rotary in place on the fused QKV output, SiLU-and-mul in one pass. Used on CUDA, where each saved
  launch and memory round trip counts; on a CPU it only runs under the Triton interpreter (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.layers import RotaryEmbedding, apply_rotary, rms_norm, silu_and_mul
from tokenmill.kernels.cpu import elementwise


@dataclass
class RopeInputs:
    """Rotary inputs of one forward, shared by all layers."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None  # torch path: [T, 1, head_dim // 2]
    sin: torch.Tensor | None = None


class TorchOps:
    name = "torch"

    def __init__(self, rotary: RotaryEmbedding, c_elementwise: bool = False):
        """c_elementwise: float32 CPU tensors through the C passes (CpuPaths.elementwise)."""
        self.rotary = rotary
        self.c_elementwise = c_elementwise

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        cos, sin = self.rotary.cos_sin(positions, dtype)
        return RopeInputs(positions, cos, sin)

    def add_rms_norm(self, x, residual, weight, eps):
        """(rms_norm(x + residual) * weight, x + residual); residual None means x alone.

        float32 on the CPU: one C pass with the same bits (kernels/cpu/elementwise.py)."""
        if self.c_elementwise:
            fused = elementwise.add_rms_norm(x, residual, weight, eps)
            if fused is not None:
                return fused
        residual = x if residual is None else x + residual
        return rms_norm(residual, weight, eps), residual

    def rotary_qk(self, rope: RopeInputs, q: torch.Tensor, k: torch.Tensor):
        """Rotated (q, k); inputs may be strided views, outputs are new contiguous tensors."""
        assert rope.cos is not None and rope.sin is not None  # set by rope_inputs
        if self.c_elementwise:
            fused = elementwise.rotary_qk(q, k, rope.cos, rope.sin)
            if fused is not None:
                return fused
        return apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)

    def rotary_write_kv(self, rope: RopeInputs, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                        key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor):
        """The rotated q [T, num_heads, head_dim] after writing the rotated k and v of the fused
        projection qkv into their cache slots, or None (nothing written) where there is no fused
        pass: float32 on the CPU, one C pass over the rows (kernels/cpu/elementwise.py)."""
        if not self.c_elementwise:
            return None
        assert rope.cos is not None and rope.sin is not None  # set by rope_inputs
        return elementwise.rotary_write_kv(qkv, num_heads, num_kv_heads, rope.cos, rope.sin, key_cache,
                                           value_cache, slot_mapping)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class TritonOps:
    name = "triton"

    def __init__(self, rotary: RotaryEmbedding, max_positions: int):
        from tokenmill.kernels.rmsnorm import rms_norm as fused_rms_norm
        from tokenmill.kernels.rotary import rope_cos_sin_cache, rotary_embedding
        from tokenmill.kernels.silu_mul import silu_mul

        self._rms_norm = fused_rms_norm
        self._rotary = rotary_embedding
        self._silu_mul = silu_mul
        # [max_positions, head_dim] float32: cos | sin, the same values as the torch table.
        self.cos_sin_cache = rope_cos_sin_cache(rotary.inv_freq, max_positions)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        return RopeInputs(positions)

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self._rms_norm(x, weight, eps), x
        return self._rms_norm(x, weight, eps, residual=residual)

    def rotary_qk(self, rope: RopeInputs, q: torch.Tensor, k: torch.Tensor):
        return self._rotary(rope.positions, q, k, self.cos_sin_cache)  # in place on the views

    def rotary_write_kv(self, rope, qkv, num_heads, num_kv_heads, key_cache, value_cache, slot_mapping):
        return None  # the rotary runs in place on qkv and the backend's kernel writes the cache

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(x)


def make_ops(kind: str, rotary: RotaryEmbedding, max_positions: int, device: torch.device,
             c_elementwise: bool = False):
    """kind: "auto" (Triton kernels on CUDA when importable, else torch), "torch" or "triton".
    c_elementwise: the torch ops take the C passes for float32 CPU tensors (CpuPaths.elementwise)."""
    if kind == "auto":
        if device.type != "cuda":
            return TorchOps(rotary, c_elementwise)
        try:
            return TritonOps(rotary, max_positions)
        except ImportError:
            return TorchOps(rotary, c_elementwise)
    if kind == "torch":
        return TorchOps(rotary, c_elementwise)
    if kind == "triton":
        try:
            return TritonOps(rotary, max_positions)
        except ImportError as exc:
            raise ValueError(f"fused Triton layer ops are not available: {exc}") from exc
    raise ValueError(f"unknown layer ops {kind!r}; choose auto, torch or triton")
