"""Paged attention over a mixed batch of decode and prefill/extend rows, in one launch.

Layout (see worker/engine/attention/__init__.py):
  query            [num_tokens, num_heads, head_dim]        all sequences of the step, packed
  key/value cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables     int32 [num_seqs, max_blocks]             physical block of each logical block
  seq_lens         int32 [num_seqs]                         cached context + new tokens
  query_start_loc  int32 [num_seqs + 1]                     row b owns query tokens qsl[b]:qsl[b+1]

Row b has context ctx_b = seq_lens[b] - query_len_b; its query token i sits at position ctx_b + i
and attends to keys 0 .. ctx_b + i (causal among the new tokens, full over the cached context).

How the work is cut (one program = one tile of query tokens x one KV head x one KV split):
- A tile holds BLOCK_Q query tokens of ONE sequence times every query head that shares the KV head
  (the GQA group, padded to a power of two), so each K/V tile loaded from the cache serves the whole
  group and the tl.dot M dimension is BLOCK_Q * GROUP_P >= 16 even for decode rows.
- Sequence b gets the program ids [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1): a strictly
  increasing start per sequence that needs no host-side table, so a program finds its sequence by
  binary search over query_start_loc. A few programs of each sequence may find no query tokens and
  exit at once; the grid is num_tokens // BLOCK_Q + num_seqs along that axis.
- Keys are walked in tiles of BLOCK_N positions; each position is gathered through the block table,
  so BLOCK_N does not have to equal the cache block size.
- Softmax is the online (flash) form in fp32, in base 2. With NUM_SPLITS > 1 each program covers
  only one contiguous share of the keys and writes its unnormalised partial state (acc, max, sum);
  a second small kernel merges the splits, one after the other in split order. That lets a handful
  of decode rows with long contexts occupy the whole GPU instead of a handful of SMs.

Batch invariance (`batch_invariant=True`, the engine's setting of that name): a query token's
output is the same bits whatever else the launch holds, whether it comes in a decode step, a chunk
or a whole prompt. By default the split count follows the GPU's size and the batch, and each split
covers a share of the tile's keys, so a token's keys are cut where the batch says; the tile height
follows the step's longest query. Batch-invariant launches instead cut every token's keys at fixed
multiples of INVARIANT_SPLIT_KEYS (a token with fewer keys is not cut at all) and always use tiles
of INVARIANT_BLOCK_M rows, so a token's keys go through the same tiles of BLOCK_N in the same order
into the same splits. What else differs between two launches only adds exact zeros: keys past a
token's own position are masked (weight 0, its running max and sum unchanged), splits past its
keys are empty, and the merge adds the splits' states in split order, empty ones adding 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= pid (branch-free binary search)."""
    lo = pid * 0
    hi = pid * 0 + num_seqs - 1  # a tensor from the start: the loop re-assigns it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = start <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_P]   (NUM_SPLITS > 1 only)
    part_ml_ptr,  # fp32 [num_tokens, num_heads, NUM_SPLITS, 2]             (max, sum) in base 2
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,  # > 0: split s covers keys [s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS) of every tile
    DOT_PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, pid_q, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid_q - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # a spare program of this sequence: no query tokens left
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_P  # query index inside the sequence
    head_in_group = offs_m % GROUP_P
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    token = (q_start + q_idx).to(tl.int64)
    q_pos = ctx_len + q_idx  # absolute position of each row's query token

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys this tile can see: the context plus the new tokens up to its last query row.
    kv_len = ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    if SPLIT_KEYS > 0:  # fixed cuts, the same for a token whatever its tile or launch (batch invariant)
        kv_start = split * SPLIT_KEYS
        kv_end = tl.minimum(kv_len, kv_start + SPLIT_KEYS)
    elif NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = split * chunk
        kv_end = tl.minimum(kv_len, kv_start + chunk)
    else:
        kv_start = 0
        kv_end = kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_valid = pos < kv_end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)

        k = tl.load(  # [HEAD_DIM_P, BLOCK_N]
            k_cache_ptr + block[None, :] * stride_kb + in_block[None, :] * stride_ks
            + kv_head * stride_kh + offs_d[:, None],
            mask=d_mask[:, None] & n_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = row_valid[:, None] & n_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no visible key yet keep max -inf; subtract 0 there so that
        # exp2(-inf - -inf) never produces NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(  # [BLOCK_N, HEAD_DIM_P]
            v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :],
            mask=n_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split  # index into [tokens, heads, splits]
        tl.store(
            part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_SPLITS_P: tl.constexpr,
):
    """Combine the partial softmax states of one (token, head) into its output row, adding the splits
    one after the other in split order (a tree sum's pairing would change with the split count; in
    order, the empty splits past a token's keys add exact zeros)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    base = (token * num_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m_max = tl.max(m, axis=0)  # finite: every query sees at least its own key
    denom = tl.zeros([1], dtype=tl.float32)
    out = tl.zeros([HEAD_DIM_P], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(part_ml_ptr + (base + s) * 2) - m_max)  # a split that saw no key: m = -inf, weight 0
        denom = denom + tl.load(part_ml_ptr + (base + s) * 2 + 1) * w
        out = out + tl.load(part_acc_ptr + (base + s) * HEAD_DIM_P + offs_d) * w
    out = out / denom
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 256
# Batch-invariant launches: keys cut at multiples of this (a multiple of every BLOCK_N), tiles of
# INVARIANT_BLOCK_M query rows x heads whatever the step holds (prefill tiles' height; decode rows
# waste rows of it but read each K/V tile once, as before).
INVARIANT_SPLIT_KEYS = 512
INVARIANT_BLOCK_M = 64


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """How many KV splits make a launch of `num_programs` tiles fill the GPU (1 = no split).

    Splitting pays only when the tiles alone leave SMs idle and the contexts are long enough that
    each split still walks a few hundred keys; the merge kernel costs one extra small launch.
    """
    if device.type != "cuda" or max_seq_len < 2 * _MIN_KEYS_PER_SPLIT:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    target = 2 * sms  # two resident tiles per SM hide the gather latency
    if num_programs >= target:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(target, num_programs), max_seq_len // _MIN_KEYS_PER_SPLIT)
    return max(1, splits)


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "expected query [tokens, heads, head_dim] and K/V caches [blocks, block_size, kv_heads, "
            f"head_dim] of equal shape; got {tuple(query.shape)}, {tuple(key_cache.shape)}, "
            f"{tuple(value_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, cache {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"dtype mismatch: query {query.dtype}, caches {key_cache.dtype}/{value_cache.dtype}")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the head_dim axis of query and caches must be contiguous")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a row-major [num_seqs, max_blocks] tensor")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"metadata sizes disagree: seq_lens {num_seqs}, query_start_loc {query_start_loc.shape[0]}, "
            f"block_tables {block_tables.shape[0]}"
        )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
    split_keys: int | None = None,
) -> torch.Tensor:
    """Attention of packed query tokens over their paged K/V cache; returns [tokens, heads, head_dim].

    max_query_len / max_seq_len are host-side hints (pass them to avoid a device sync); num_splits
    forces the KV split count (None = choose from the GPU's size); block_m / block_n override the
    tile sizes (query rows x heads, keys), mainly for tests. batch_invariant: every token's output
    the same bits in any launch (module docstring): keys cut at multiples of `split_keys` (default
    INVARIANT_SPLIT_KEYS, a multiple of the key tile), tiles of INVARIANT_BLOCK_M (or `block_m`) rows.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if block_m is None and batch_invariant:
        block_m = INVARIANT_BLOCK_M  # one tile height for every step: a token's tiles never change shape
    if block_m is None:
        # Decode-only steps want few wasted rows; prefill tiles want big M for tensor-core work.
        block_m = 16 if max_query_len <= 16 // min(group_p, 16) else 64
    block_m = max(block_m, group_p, 16)
    block_q = block_m // group_p
    if block_n is None:
        block_n = 64 if head_dim_p <= 64 else 32
    num_q_programs = num_tokens // block_q + num_seqs
    if max_seq_len is not None and max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} needs more blocks than block_tables has columns "
            f"({block_tables.shape[1]} x block_size {block_size})"
        )
    split_keys = (split_keys or INVARIANT_SPLIT_KEYS) if batch_invariant else 0
    if batch_invariant:
        if num_splits is not None:
            raise ValueError("a batch-invariant launch cuts keys at fixed multiples: num_splits cannot be forced")
        if split_keys % block_n:
            raise ValueError(f"split_keys {split_keys} must be a multiple of the key tile {block_n}")
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = max(1, triton.cdiv(max_seq_len, split_keys))
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        # Tiles that do work (the rest of the grid exits at once): one per row for decode steps.
        working = max(num_seqs, triton.cdiv(num_tokens, block_q))
        num_splits = choose_num_splits(working * num_kv_heads, max_seq_len, query.device)
    if not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be in [1, 256], got {num_splits}")

    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_p), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # never touched
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    num_warps = 4 if block_m * head_dim_p <= 64 * 128 else 8
    _paged_attention_kernel[(num_q_programs, num_kv_heads, num_splits)](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        part_acc, part_ml,
        scale * _LOG2E, num_seqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group, GROUP_P=group_p,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, SPLIT_KEYS=split_keys if num_splits > 1 else 0, DOT_PRECISION=dot_precision,
        num_warps=num_warps, num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits, NUM_SPLITS_P=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference: gather each row's keys, causal softmax in fp32, one row at a time."""
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_heads = query.shape[1]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = qsl[b], qsl[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        ctx = seq_len - q_len
        blocks = block_tables[b, : math.ceil(seq_len / block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = ctx + torch.arange(q_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
