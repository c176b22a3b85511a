"""Write the step's new keys and values into the paged K/V cache by slot mapping.

slot = block_id * block_size + offset_in_block; a negative slot means "padding token, write
nothing" (a decode batch padded up to a captured CUDA-graph size carries such tokens).
A program copies all KV heads of TOKENS tokens at once: one token on a GPU (a decode step's few
tokens spread over as many programs), a tile of them where the kernel runs in Triton's interpreter
(each program there costs milliseconds of Python whatever its size: the GPU path's tests and the
GPU check's dry run spent most of their kv_write time starting programs).
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
    num_tokens,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    block = slots // BLOCK_SIZE
    offset = slots % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    # [TOKENS, HEADS_P, HEAD_DIM_P]: a token past the end or with a negative slot writes nothing.
    mask = (slots[:, None, None] >= 0) & (offs_h[None, :, None] < NUM_KV_HEADS) & (offs_d[None, None, :] < HEAD_DIM)
    heads = offs_h[None, :, None]
    dims = offs_d[None, None, :]
    k = tl.load(key_ptr + tokens[:, None, None] * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + tokens[:, None, None] * stride_vt + heads * stride_vh + dims, mask=mask)
    cached_k = block[:, None, None] * stride_kcb + offset[:, None, None] * stride_kcs + heads * stride_kch + dims
    cached_v = block[:, None, None] * stride_vcb + offset[:, None, None] * stride_vcs + heads * stride_vch + dims
    tl.store(k_cache_ptr + cached_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cached_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# Tokens per program where the kernel is interpreted (CPU tensors); 1 on a GPU.
INTERPRETED_TOKENS = 64


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
    tokens_per_program: int | None = None,
) -> None:
    """key/value [tokens, kv_heads, head_dim] -> caches[slot // bs, slot % bs] (in place).
    tokens_per_program (a power of two): 1 on a GPU, INTERPRETED_TOKENS for CPU tensors unless given."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    per_program = tokens_per_program or (1 if key.is_cuda else INTERPRETED_TOKENS)
    if per_program & (per_program - 1):
        raise ValueError(f"tokens_per_program must be a power of two, got {per_program}")
    _kv_write_kernel[(triton.cdiv(num_tokens, per_program),)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_tokens,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1], TOKENS=per_program,
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
