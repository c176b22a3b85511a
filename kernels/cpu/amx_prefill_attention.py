"""Prefill attention on the CPU's AMX tiles: a sequence's new tokens against all its keys, float32.

Why: a prompt's attention is two GEMMs per head (scores Q.K^T, then P.V), quadratic in its length.
The C kernel of decode_attention.py takes a short prompt token by token, each token a row that
rereads the row's keys: on SmolLM2's `mixed` set (prompts of 50-500 tokens) that was 11% of a step
at two threads, at a few tens of GFLOP/s. Here the two GEMMs run on the tiles with the exact
three-part bfloat16 split of amx_gemm.py (float32's accuracy; that module's
docstring has the argument), 32 query rows by 32 keys at a time, and only the key blocks a row
block can see (causal).

One call per layer for all of a step's prefill rows, one parallel region:
1. Each row's K and V of each kv head come out of the paged cache once, split into their parts and
   packed in the tiles' order: K as the columns of Q.K^T, V as the columns of P.V.
2. Per block of 32 tokens of one query head of one row (threads take blocks as they come, row by
   row and within a row those that read the most keys first, so a row's packed keys stay in cache
   and no long block starts last): the scores, then a softmax in float32 (max, exp within 1 ulp,
   sum; keys past a token's position are zero), the unnormalised probabilities split into parts
   for P.V, and the output divided by the row's sum.

Applies to float32 rows of at least MIN_TOKENS new tokens with a head size that is a multiple of
32, where amx_gemm.available() (AMX, its self-check) and this kernel's own self-check against
float64 hold, and the engine takes the AMX GEMM (its `amx_gemm` setting turns both off) and the C
decode attention (paths.py). Shorter rows (chunks after a long context) keep the token-row kernel,
which reads each key once per token anyway.

The kernel is csrc/amx_prefill_attention.c, on the tiles' helpers of csrc/amx_tiles.h.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from tokenmill.kernels.cpu import amx_gemm
from tokenmill.kernels.cpu.build import OnDemandLibrary

log = logging.getLogger(__name__)

# Fewer new tokens than this: packing the row's keys costs more than the tiles save.
MIN_TOKENS = 32
# Largest error of the self-check's outputs against float64, relative to sum_j p_j |v_j|.
SELF_CHECK_BOUND = 2e-6


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_prefill_attention.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_float,
                                          ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.amx_prefill_attention.restype = ctypes.c_int


_library = OnDemandLibrary("amx_prefill_attention.c", "AMX prefill attention", _declare)
_lock = threading.Lock()
_ready: bool | None = None
_workspaces = threading.local()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def applies(head_dim: int) -> bool:
    """Whether rows of this head size can take the kernel here (it is built and checked once)."""
    return head_dim % 32 == 0 and available()


def available() -> bool:
    global _ready
    if not amx_gemm.available():
        return False
    if _ready is not None:  # settled: every layer of every step asks, so no lock then
        return _ready
    with _lock:
        if _ready is None:
            ready = _library.get() is not None
            if ready:
                with torch.inference_mode():
                    ready = _self_check()
                if not ready:
                    log.warning("the AMX prefill attention failed its self-check: prefills keep the other kernels")
            _ready = ready  # only the final answer: read without the lock above
        return _ready


def _buffer(name: str, elems: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_workspaces, name, None)
    if buf is None or buf.numel() < elems:
        buf = torch.empty(elems, dtype=dtype)
        setattr(_workspaces, name, buf)
    return buf


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, token_start: int, tokens: int, context: int,
                      out: torch.Tensor, scale: float) -> None:
    """out[token_start : token_start + tokens] = attention of those query tokens (positions context ..
    context + tokens - 1 of the sequence whose blocks are `block_table`, int32 contiguous) over the
    sequence's keys. query and out: float32 [T, heads, head_dim], heads contiguous."""
    rows = torch.tensor([[token_start, 0, tokens, context]], dtype=torch.int64)
    prefill_attention_rows(query, key_cache, value_cache, block_table.view(1, -1), rows, out, scale)


def prefill_rows(rows: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """The int64 [n, 4] table prefill_attention_rows reads: (first token, block table row, new tokens,
    context) per sequence."""
    return torch.tensor(rows, dtype=torch.int64).view(-1, 4)


def prefill_attention_rows(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Every sequence of `rows` (int64 [n, 4], prefill_rows) in one call: out[first : first + tokens] =
    attention of those query tokens (positions context .. context + tokens - 1 of the sequence whose
    blocks are row `table row` of block_tables, int32 [B, W] contiguous) over the sequence's keys.

    One parallel region for all of them: the threads pack every sequence's keys, then take the
    blocks of 32 tokens of every sequence and head, sequence by sequence and within one longest
    first, so a step's prompts of unequal length keep both threads busy to the end (one call per
    sequence waited at its end for the thread with the longest block). A row's bits do not depend
    on the other rows or the order."""
    _, block_size, kv_heads, head_dim = key_cache.shape
    heads = query.shape[1]
    n = rows.shape[0]
    if n == 0:
        return
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 4 or not rows.is_contiguous():
        raise ValueError("rows must be int64 [n, 4] contiguous (prefill_rows)")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 [B, W] with contiguous rows")
    keys_pad = [_round_up(tokens + context, 32) for _, _, tokens, context in rows.tolist()]
    total_pad, max_pad = sum(keys_pad), max(keys_pad)
    d_blocks, key_blocks = head_dim // 32, max_pad // 32
    block_bytes = 3 * 2 * 512 * 2
    per_thread = _round_up(d_blocks * block_bytes + 32 * max_pad * 4 + key_blocks * block_bytes + 32 * head_dim * 4, 64)
    threads = torch.get_num_threads()
    packed_elems = kv_heads * total_pad * head_dim * 3
    k_ws, v_ws = _buffer("k", packed_elems, torch.int16), _buffer("v", packed_elems, torch.int16)
    thread_ws = _buffer("threads", threads * per_thread + 64, torch.uint8)
    base = thread_ws.data_ptr()
    aligned = base + (-base % 64)
    rc = _library.get().amx_prefill_attention(
        query.data_ptr(), query.stride(0), n, rows.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        key_cache.data_ptr(), value_cache.data_ptr(), block_size, kv_heads, heads // kv_heads, head_dim, scale,
        out.data_ptr(), out.stride(0), k_ws.data_ptr(), v_ws.data_ptr(), aligned, per_thread, threads,
    )
    if rc != 0:
        raise MemoryError("AMX prefill attention could not allocate its task list")


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int, scale: float) -> torch.Tensor:
    """float64 attention of query [T, heads, d] at positions context.. over keys/values [L, kv_heads, d]."""
    tokens, heads, _ = query.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, d]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, T, L]
    seen = torch.arange(keys.shape[0])[None, :] <= (context + torch.arange(tokens))[:, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return (probs @ v).transpose(0, 1)  # [T, heads, d]


def _self_check() -> bool:
    """A chunk after context and a fresh prompt, blocks out of order, against float64."""
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, d = 16, 2, 6, 64
    for context, tokens in ((0, 45), (70, 33)):
        keys_n = context + tokens
        n_blocks = -(-keys_n // block_size)
        table = torch.randperm(n_blocks + 3, generator=gen)[:n_blocks].to(torch.int32)
        key_cache = torch.randn(n_blocks + 3, block_size, kv_heads, d, generator=gen)
        value_cache = torch.randn(n_blocks + 3, block_size, kv_heads, d, generator=gen)
        query = torch.randn(tokens + 5, heads, d, generator=gen) * 3
        out = torch.zeros(tokens + 5, heads, d)
        prefill_attention(query, key_cache, value_cache, table, 5, tokens, context, out, d**-0.5)
        slots = (table.long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:keys_n]
        keys = key_cache.view(-1, kv_heads, d)[slots]
        values = value_cache.view(-1, kv_heads, d)[slots]
        want = reference(query[5:], keys, values, context, d**-0.5)
        bound = SELF_CHECK_BOUND * values.abs().max().item()
        if not bool(((out[5:].double() - want).abs() <= bound).all()) or bool(out[:5].any()):
            return False
    return True
