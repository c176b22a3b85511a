"""Draws for sampled rows on the CPU in C: temperature and top_p without sorting the row
(csrc/row_sample.c).

Why: a row sampled at a temperature with top_p needs the smallest logit whose preceding mass (in
descending order) is below top_p. Where the distribution is flat (a random model's, a high
temperature's) that cut lies deep in the row, and the torch path sorts the whole row: 256 rows of
32,000 logits took 120 ms more a step than plain greedy rows on one core of a 2-core EPYC (AVX2),
where the whole step was 79 ms (`bench --workload features`, `top_p`). Here a sample of the row
brackets where the mass crosses top_p; one pass sums the mass above the bracket and packs its ids;
only those tokens are gathered by logit into fine buckets, and only the bucket where the mass
crosses is sorted (where the sample misses, the mass of every token by buckets of 1/256 nat decides);
the draw sums blocks of 256 ids until it passes its target. 8.5 ms for those 256 rows. One thread
per row, its sums in a fixed order, every choice made from the row: a row's draw depends on that
row, its seed's uniform and its settings alone.

The rule is the sampler's (worker/engine/sampler.py): the same kept set (ties with the last kept
token kept), the same inverse-CDF draw in id order; sums are in double where the torch path sums in
float32, so a draw on the edge of a token can differ between the two paths. Rows with top_k or
min_p, and rows the kernel cannot take (a NaN, no finite maximum: it returns -1), take the torch
path. The engine's `cpu_sampling` setting turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.cpu.build import OnDemandLibrary

# Below this many logits a call runs on one thread.
PARALLEL_MIN_ELEMENTS = 65536


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rs_sample_rows.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64]
    lib.rs_sample_rows.restype = None


_library = OnDemandLibrary("row_sample.c", "CPU sampling kernel", _declare)


def available() -> bool:
    """True where the kernel is built (a C compiler; checked once per process)."""
    return _library.get() is not None


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor | None:
    """int64 [len(rows)]: the draw of each of `rows` of float32 CPU logits [N, V] (unit column stride)
    at its temperature (> 0) and top_p (1 keeps all), from its uniform in [0, 1); -1 where the row
    is not finite. None where the kernel does not apply (then the caller's torch path)."""
    lib = _library.get()
    if lib is None or not logits.is_cpu or logits.dtype is not torch.float32 or logits.dim() != 2 \
            or logits.stride(1) != 1:
        return None
    count = rows.numel()
    rows = rows.to(torch.int64).contiguous()
    temperatures = temperatures.to(torch.float32).contiguous()
    top_ps = top_ps.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(count, dtype=torch.int64)
    vocab = logits.shape[1]
    threads = torch.get_num_threads() if count * vocab >= PARALLEL_MIN_ELEMENTS else 1
    lib.rs_sample_rows(logits.data_ptr(), logits.stride(0), rows.data_ptr(), count, vocab, temperatures.data_ptr(),
                       top_ps.data_ptr(), uniforms.data_ptr(), out.data_ptr(), threads)
    return out
