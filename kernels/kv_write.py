"""Write the step's new keys and values into the paged K/V cache by slot mapping.

slot = block_id * block_size + offset_in_block; a negative slot means "padding token, write
nothing" (a decode batch padded up to a captured CUDA-graph size carries such tokens).
One program per token copies all of its KV heads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def _check(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must both be [tokens, kv_heads, head_dim]; got {tuple(key.shape)}, {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key/value caches must both be [blocks, block_size, kv_heads, head_dim]")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"new K/V heads x dim {tuple(key.shape[1:])} do not match the cache {tuple(key_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must have one slot per token ({key.shape[0]}), got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the head_dim axis of new K/V and of the caches must be contiguous")


def kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [tokens, kv_heads, head_dim] -> caches[slot // bs, slot % bs] (in place)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def kv_write_ref(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Plain-torch reference (in place); negative slots are skipped."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, kv_heads, head_dim)[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, kv_heads, head_dim)[slots] = value[keep].to(value_cache.dtype)
