"""A small C kernel for decode attention on the CPU, read straight from the paged KV cache (fp32).

Each row is one query token with the number of keys it sees; the torch backend also hands it the
tokens of short prefill rows this way (worker/engine/attention/torch_backend.py, KERNEL_PREFILL_MAX_LEN).

Why: in plain torch a decode step must first gather every row's K and V out of the paged cache (a full
copy, per layer, per step) before a matmul can read them again; at 256 sequences this gather plus the
small batched GEMMs was ~80% of a tiny model's forward. This kernel walks each row's block table and
reads every K and V vector once, computing all query heads of a GQA group against it, so a step moves
each cached byte once. Measured on one core it is several times faster than the torch path.

It is C (csrc/decode_attention.c), built with the system compiler on first use and cached (build.py).
Without a compiler, or if the build fails, available() is False and the caller keeps the plain torch
path, which is also the reference the tests compare this kernel against; the engine's
`cpu_attention_kernel` setting turns it off (paths.py).

Its rows are split over OpenMP threads, and those are torch's own: the library links libgomp.so.1,
which in a process that has loaded torch is torch's copy, so the kernel runs on the threads that ran
the step's GEMMs. With threads of its own (pthreads, still the build without OpenMP) it competed
with torch's workers, which spin on the other cores after each GEMM: 0.9x from 1 to 2 threads.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.cpu.build import OnDemandLibrary


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64, i64]
    fn.restype = ctypes.c_int


_library = OnDemandLibrary("decode_attention.c", "CPU decode attention kernel", _declare)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first call; None where it cannot be built."""
    return _library.get()


def available() -> bool:
    return load() is not None


def paged_decode_attention(
    query: torch.Tensor,  # [T, H, D] float32, CPU; rows token_index of it are read
    key_cache: torch.Tensor,  # [num_blocks, bs, Hkv, D] float32, contiguous
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W], contiguous
    token_index: torch.Tensor,  # int64 [n]
    table_row: torch.Tensor,  # int64 [n]: row of block_tables for each decode row
    seq_lens: torch.Tensor,  # int32 [n]
    max_len: int,
    out: torch.Tensor,  # [T, H, D] float32: rows token_index are written
    scale: float,
    num_threads: int | None = None,
) -> None:
    """Caller guarantees the indices are in range (the torch backend's plan checks them).

    num_threads: worker threads (default: torch's intra-op thread count, so `--threads` applies).
    """
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU decode attention kernel is not available")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if query.shape[2] != head_dim or num_heads % num_kv_heads or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        )
    if query.stride(2) != 1 or query.stride(1) != head_dim or out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError("query and out must be contiguous within each token row")
    rc = lib.paged_decode_attention_f32(
        query.data_ptr(), query.stride(0),
        key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0),
        token_index.data_ptr(), table_row.data_ptr(), seq_lens.data_ptr(), token_index.numel(),
        out.data_ptr(), out.stride(0),
        num_heads, num_kv_heads, head_dim, block_size, float(scale), max(int(max_len), 1),
        torch.get_num_threads() if num_threads is None else int(num_threads),
    )
    if rc != 0:
        raise MemoryError("CPU decode attention kernel could not allocate its scratch buffer")
