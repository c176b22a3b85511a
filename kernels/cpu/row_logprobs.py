"""The sampler's logprob parts on the CPU in C: each float32 logit row's logsumexp and its top-N
logits with their ids, two passes over the row (csrc/row_logprobs.c): the top-N, whose first entry
is the row's maximum, then the sum of e^x while the row is in the cache, the thread's next row asked
into the cache meanwhile.

Why: a step whose rows want logprobs needs every row's normaliser, a pass of e^x over the whole
vocabulary, where a plain greedy row needs only its argmax. torch's exp and sum over 256 rows of
32,000 logits took 14 ms on one core of a 2-core EPYC (AVX2), the top-N another 5: a quarter of a
tiny-llama decode step (`bench --workload features`, `logprobs`); here 5.7 ms, and greedy rows that
all want logprobs take their argmax from the top-N (the sampler), so they make no argmax pass. e^x is
the fixed polynomial the batch-invariant GEMM uses (csrc/fixed_exp.h, within ~2 ulp of expf), and
each row is one thread's, its sum in fixed lanes: a row's result depends on that row alone.

Rows whose maximum is not finite or that hold a NaN come back as NaN; the caller computes them with
torch. The engine's `cpu_sampling` setting turns it off (with the draws of row_sample.py).
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.cpu.build import OnDemandLibrary

# Below this many logits a call runs on one thread.
PARALLEL_MIN_ELEMENTS = 65536


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rl_logprob_parts.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64]
    lib.rl_logprob_parts.restype = None


_library = OnDemandLibrary("row_logprobs.c", "CPU logprob kernel", _declare)


def available() -> bool:
    """True where the kernel is built (a C compiler; checked once per process)."""
    return _library.get() is not None


def logprob_parts(x: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(logsumexp of each row [R] (NaN where the row's maximum is not finite or it holds a NaN), its
    top_n logits [R, top_n] largest first, their ids) of float32 CPU logits x [R, V] with unit column
    stride, or None where the kernel does not apply (then the caller's torch path)."""
    lib = _library.get()
    if (lib is None or not x.is_cpu or x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1
            or top_n < 0 or top_n > x.shape[1]):
        return None
    rows, vocab = x.shape
    log_total = torch.empty(rows, dtype=torch.float32)
    top_vals = torch.empty(rows, top_n, dtype=torch.float32)
    top_ids = torch.empty(rows, top_n, dtype=torch.int64)
    threads = torch.get_num_threads() if rows * vocab >= PARALLEL_MIN_ELEMENTS else 1
    lib.rl_logprob_parts(x.data_ptr(), x.stride(0), rows, vocab, top_n, log_total.data_ptr(),
                         top_vals.data_ptr(), top_ids.data_ptr(), threads)
    return log_total, top_vals, top_ids
