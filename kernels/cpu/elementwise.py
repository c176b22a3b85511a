"""The decoder's element-wise layers on the CPU (float32) in one C pass each, with torch's bits.

Why: the residual add and RMSNorm, and the rotary embedding of q and k, are each 6-16 torch ops
per call, every one a pass over the step's [T, hidden] tensor and a dispatch: at tiny-llama's
shape one layer's add + norm takes 30 us at 128 rows and 1.2 ms at 2,048, and below 32,768
elements an op runs on one thread, so at two threads these layers did not speed up at all (0.92x
in the profile of docs/engine.md). Here each is one pass over the rows, split over torch's own
OpenMP threads (the library links torch's libgomp, as the decode-attention kernel does). The
K/V write into the paged cache is here too: two index_copy_ calls per layer took 0.16-0.17 s of a
2-thread tiny-llama `mixed` run (0.23 s on one thread), one pass over the rows 0.08 (0.12). Where
the model has no q/k norm, the rotary and the K/V write are one pass over the fused projection
(rotary_write_kv): k goes rotated straight into its cache slot, with no tensor between.

Same bits as the torch layers (tokenmill.engine.layers), so greedy output does not move:
- The add, the squares, the scales and the rotation are single float32 operations, rounded once
  each, in the reference's order; the build keeps the compiler from fusing them (fp-contract off).
- The mean of the squares is torch's CPU sum then a division by the size. The sum's order is
  torch's vectorised inner reduction: vectors of `lanes` floats summed in four interleaved
  accumulators (with torch's cascade for long rows), the four combined, the scalar tail added to
  zero, then the lanes one by one.
- 1 / sqrt(x), rounded twice, is torch's rsqrt on the CPU.
The lane count is torch's vector width (16 on AVX-512 builds, 8 on AVX2): each hidden size is
checked against torch's rms_norm on probe rows the first time it is met, and a size whose bits
differ keeps the torch ops, as does a missing compiler; the engine's `cpu_elementwise` setting turns
them all off (paths.py). The kernels are csrc/elementwise.c.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from tokenmill.kernels.cpu.build import OnDemandLibrary

log = logging.getLogger(__name__)

# Below this many elements a call runs on one thread (torch's own grain size for element-wise ops).
PARALLEL_MIN_ELEMENTS = 32768


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.add_rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, f32, i64, i64, i64, ptr, ptr, i64]
    lib.add_rms_norm_f32.restype = None
    lib.rotary_qk_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64]
    lib.rotary_qk_f32.restype = None
    lib.write_kv_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.write_kv_f32.restype = None
    lib.rotary_write_kv_f32.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64]
    lib.rotary_write_kv_f32.restype = None


_library = OnDemandLibrary("elementwise.c", "CPU element-wise kernels", _declare)
_lock = threading.Lock()
_lanes_for_size: dict[int, int | None] = {}  # hidden size -> lane count whose sums are torch's, or None


def library() -> ctypes.CDLL | None:
    """The kernels' library (for callers of its entry points), or None where it did not build."""
    return _library.get()


def available() -> bool:
    """True where the kernels are built (a C compiler; checked once per process)."""
    return _library.get() is not None


def norm_lanes(n: int) -> int | None:
    """The lane count add_rms_norm_f32 takes at hidden size n, or None where no count gives torch's bits."""
    lib = _library.get()
    return None if lib is None else _lanes(lib, n)


def threads_for(elements: int) -> int:
    """The threads the kernels here use for a pass over `elements` values."""
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


def _fits(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a plain loop: this runs several times per layer, on the step's host path
        if not t.is_cpu or t.dtype is not torch.float32:
            return False
    return True


def _row_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def _call_norm(lib, x, residual, weight, eps, lanes) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    out_norm = torch.empty(rows, n)
    out_res = torch.empty(rows, n) if residual is not None else x
    lib.add_rms_norm_f32(
        x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0, weight.data_ptr(), eps, rows, n, lanes,
        out_norm.data_ptr(), out_res.data_ptr(), threads_for(rows * n),
    )
    return out_norm, out_res


def _lanes(lib, n: int) -> int | None:
    """The lane count that reproduces torch's rms_norm bits at hidden size n, found once per size."""
    if n in _lanes_for_size:  # every call after the first: no lock on the step's path
        return _lanes_for_size[n]
    with _lock:
        if n in _lanes_for_size:
            return _lanes_for_size[n]
        from tokenmill.engine.layers import rms_norm

        gen = torch.Generator().manual_seed(n)
        # Rows of very different scales, where a change of summation order shows in the last bit.
        x = torch.randn(64, n, generator=gen) * torch.logspace(-3, 3, 64).unsqueeze(1)
        res = torch.randn(64, n, generator=gen)
        weight = torch.randn(n, generator=gen)
        want = rms_norm(x + res, weight, 1e-6)
        found = None
        for lanes in (16, 8):
            got, _ = _call_norm(lib, x, res, weight, 1e-6, lanes)
            if torch.equal(got, want):
                found = lanes
                break
        if found is None:
            log.info("hidden size %d: no lane count gives torch's rms_norm bits; keeping the torch ops", n)
        _lanes_for_size[n] = found
        return found


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual) * weight, x + residual) as layers.rms_norm gives them, or None where
    the kernel does not apply (then the caller's torch ops)."""
    if not (_fits(x, weight) and _row_ok(x) and weight.is_contiguous() and weight.shape == (x.shape[1],)):
        return None
    if residual is not None and not (_fits(residual) and _row_ok(residual) and residual.shape == x.shape):
        return None
    lib = _library.get()
    if lib is None or x.shape[0] == 0:
        return None
    lanes = _lanes(lib, x.shape[1])
    if lanes is None:
        return None
    return _call_norm(lib, x, residual, weight, eps, lanes)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(rotated q, rotated k), new contiguous tensors, as layers.apply_rotary gives them; None where
    the kernel does not apply. q [T, heads, d] and k [T, kv_heads, d] may be row-strided views with
    contiguous heads; cos and sin [T, 1, d / 2]."""
    if not _fits(q, k, cos, sin) or q.dim() != 3 or k.dim() != 3:
        return None
    rows, qh, d = q.shape
    kh = k.shape[1]
    if (k.shape[0] != rows or k.shape[2] != d or d % 2 or q.stride(2) != 1 or k.stride(2) != 1
            or q.stride(1) != d or k.stride(1) != d or cos.shape != (rows, 1, d // 2) or sin.shape != cos.shape
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    lib = _library.get()
    if lib is None or rows == 0:
        return None
    out_q, out_k = torch.empty(rows, qh, d), torch.empty(rows, kh, d)
    lib.rotary_qk_f32(q.data_ptr(), q.stride(0), qh, k.data_ptr(), k.stride(0), kh, cos.data_ptr(), sin.data_ptr(),
                      d, rows, out_q.data_ptr(), out_k.data_ptr(), threads_for(rows * (qh + kh) * d))
    return out_q, out_k


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """The step's K/V rows into their cache slots in one pass over the rows on torch's threads (two
    index_copy_ calls are two dispatches and, at decode sizes, one thread each); False where it does
    not apply (the caller copies with torch). key and value are [T, kv_heads, d], rows strided, heads
    contiguous; the caches [blocks, block_size, kv_heads, d], contiguous; slot_mapping int64 [T].
    The caller guarantees the slots are in range (they come from the block tables)."""
    if not _fits(key, value, key_cache, value_cache) or key.dim() != 3 or value.shape != key.shape:
        return False
    rows, heads, d = key.shape
    if (slot_mapping.dtype != torch.int64 or slot_mapping.shape != (rows,) or not slot_mapping.is_contiguous()
            or key_cache.shape[2:] != (heads, d) or value_cache.shape != key_cache.shape
            or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or key.stride(2) != 1 or key.stride(1) != d or value.stride(2) != 1 or value.stride(1) != d):
        return False
    lib = _library.get()
    if lib is None:
        return False
    width = heads * d
    lib.write_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
                     value_cache.data_ptr(), slot_mapping.data_ptr(), rows, width, threads_for(2 * rows * width))
    return True


def rotary_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """One layer's rotary and K/V write in one pass over the rows of its fused projection: returns
    the rotated q [T, num_heads, d] (new, contiguous) after writing the rotated k and v into their
    cache slots, the same bits as rotary_qk then write_kv; None where it does not apply (then the
    caller's separate calls, and nothing has been written). qkv is [T, (num_heads + 2 num_kv_heads) d],
    rows strided, columns contiguous; the caches [blocks, block_size, num_kv_heads, d], contiguous;
    cos and sin [T, 1, d / 2]; slot_mapping int64 [T]. The caller guarantees the slots are in range
    (they come from the block tables)."""
    if not _fits(qkv, cos, sin, key_cache, value_cache) or qkv.dim() != 2 or qkv.stride(1) != 1:
        return None
    rows = qkv.shape[0]
    d = key_cache.shape[-1] if key_cache.dim() == 4 else 0
    if (not d or d % 2 or key_cache.shape[2] != num_kv_heads or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d
            or value_cache.shape != key_cache.shape or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (rows,) or not slot_mapping.is_contiguous()
            or cos.shape != (rows, 1, d // 2) or sin.shape != cos.shape or not cos.is_contiguous()
            or not sin.is_contiguous()):
        return None
    lib = _library.get()
    if lib is None or rows == 0:
        return None
    out_q = torch.empty(rows, num_heads, d)
    lib.rotary_write_kv_f32(qkv.data_ptr(), qkv.stride(0), num_heads, num_kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                            rows, slot_mapping.data_ptr(), out_q.data_ptr(), key_cache.data_ptr(),
                            value_cache.data_ptr(), threads_for(rows * qkv.shape[1]))
    return out_q
