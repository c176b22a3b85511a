"""Rotary position embedding, NeoX style (as Llama and Qwen use), applied in place to Q and K.

NeoX style rotates the two halves of the first rot_dim dims of each head: with x = [x1, x2],
out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]. The cos/sin table is [max_position, rot_dim]
fp32 (cos in the first half, sin in the second), built once from the model's inv_freq, so any
frequency scaling (Llama 3, linear, ...) is the caller's choice of inv_freq and attention factor.
One program per token rotates all of its query and key heads (cos/sin loaded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, token, num_heads, cos, sin,
                  HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HALF_P)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    base = ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base, o1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, o2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, Q_HEADS_P: tl.constexpr, K_HEADS_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_P)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, num_heads, cos, sin, HALF, Q_HEADS_P, HALF_P)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, cos, sin, HALF, K_HEADS_P, HALF_P)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, attention_scaling: float = 1.0) -> torch.Tensor:
    """[max_position, 2 * len(inv_freq)] fp32 table: cos | sin of position * inv_freq (times scaling)."""
    t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling


def _check(positions, query, key, cos_sin_cache) -> int:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query/key must be [tokens, heads, head_dim]; got {tuple(query.shape)}, {tuple(key.shape)}")
    if positions.shape != (query.shape[0],):
        raise ValueError(f"positions must be [tokens] = [{query.shape[0]}], got {tuple(positions.shape)}")
    rot_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot_dim % 2 or rot_dim > query.shape[2]:
        raise ValueError(f"cos_sin_cache must be [max_position, rot_dim] with even rot_dim <= head_dim; got {tuple(cos_sin_cache.shape)}")
    if query.stride(2) != 1 or key.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("the head_dim axis of query/key and the table's last axis must be contiguous")
    return rot_dim


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, KVH, D] in place by positions [T]; returns them.

    query and key may be strided views (e.g. slices of a fused QKV output).
    """
    rot_dim = _check(positions, query, key, cos_sin_cache)
    if query.shape[0]:
        half = rot_dim // 2
        _rotary_kernel[(query.shape[0],)](
            query, key, positions, cos_sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
            query.shape[1], key.shape[1],
            HALF=half, HALF_P=triton.next_power_of_2(half),
            Q_HEADS_P=triton.next_power_of_2(query.shape[1]), K_HEADS_P=triton.next_power_of_2(key.shape[1]),
            num_warps=4,
        )
    return query, key


def rotary_embedding_ref(positions, query, key, cos_sin_cache):
    """Plain-torch reference; returns new tensors (inputs untouched)."""
    rot_dim = _check(positions, query, key, cos_sin_cache)
    half = rot_dim // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:rot_dim], xf[..., rot_dim:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)
