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

Same bits as the torch layers (worker/engine/layers.py), so greedy output does not move:
- The add, the squares, the scales and the rotation are single float32 operations, rounded once
  each, in the reference's order; the build keeps the compiler from fusing them (fp-contract off).
- The mean of the squares is torch's CPU sum then a division by the size. The sum's order is
  torch's vectorised inner reduction: vectors of `lanes` floats summed in four interleaved
  accumulators (with torch's cascade for long rows), the four combined, the scalar tail added to
  zero, then the lanes one by one.
- 1 / sqrt(x), rounded twice, is torch's rsqrt on the CPU.
The lane count is torch's vector width (16 on AVX-512 builds, 8 on AVX2): each hidden size is
checked against torch's rms_norm on probe rows the first time it is met, and a size whose bits
differ keeps the torch ops, as does a missing compiler or TOKENMILL_CPU_ELEMENTWISE=0.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from tokenmill.engine.c_build import OnDemandLibrary
from tokenmill.engine.switches import switch

log = logging.getLogger(__name__)

DISABLE_ENV = "TOKENMILL_CPU_ELEMENTWISE"  # "0": the torch ops

# Below this many elements a call runs on one thread (torch's own grain size for element-wise ops).
PARALLEL_MIN_ELEMENTS = 32768

_SOURCE = r"""
#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ILP 4
#define LEVELS 4

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

/* torch's sum of the squares x[i] * x[i] of n contiguous floats, in the order its vectorised inner
   reduction (SumKernel) adds them, for vectors of L floats (L a constant, so the lanes vectorise). */
#define SQ(i) (x[i] * x[i])
#define DEFINE_ROW_SUM(L)                                                                             \
static float row_sum_of_squares_##L(const float *x, int64_t n) {                                      \
    const int64_t vecs = n / L, groups = vecs / ILP;                                                  \
    float acc[LEVELS][ILP][L];                                                                        \
    memset(acc, 0, sizeof(acc));                                                                      \
    const int64_t power = ceil_log2(groups) / LEVELS > 4 ? ceil_log2(groups) / LEVELS : 4;            \
    const int64_t step = (int64_t)1 << power, mask = step - 1;                                        \
    int64_t i = 0;                                                                                    \
    for (; i + step <= groups;) {                                                                     \
        for (int64_t j = 0; j < step; ++j, ++i)                                                       \
            for (int64_t k = 0; k < ILP; ++k)                                                         \
                for (int64_t l = 0; l < L; ++l) acc[0][k][l] += SQ((i * ILP + k) * L + l);            \
        for (int64_t j = 1; j < LEVELS; ++j) {                                                        \
            for (int64_t k = 0; k < ILP; ++k)                                                         \
                for (int64_t l = 0; l < L; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.f; } \
            if ((i & (mask << (j * power))) != 0) break;                                              \
        }                                                                                             \
    }                                                                                                 \
    for (; i < groups; ++i)                                                                           \
        for (int64_t k = 0; k < ILP; ++k)                                                             \
            for (int64_t l = 0; l < L; ++l) acc[0][k][l] += SQ((i * ILP + k) * L + l);                \
    for (int64_t j = 1; j < LEVELS; ++j)                                                              \
        for (int64_t k = 0; k < ILP; ++k)                                                             \
            for (int64_t l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];                             \
    for (int64_t v = groups * ILP; v < vecs; ++v) /* vectors left over from the groups of four */     \
        for (int64_t l = 0; l < L; ++l) acc[0][0][l] += SQ(v * L + l);                                \
    for (int64_t k = 1; k < ILP; ++k)                                                                 \
        for (int64_t l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];                                 \
    float total = 0.f;                                                                                \
    for (int64_t t = vecs * L; t < n; ++t) total += SQ(t);                                            \
    for (int64_t l = 0; l < L; ++l) total += acc[0][0][l];                                            \
    return total;                                                                                     \
}
DEFINE_ROW_SUM(8)
DEFINE_ROW_SUM(16)

/* norm = rms_norm(x + res) * w, out_res = x + res (res may be NULL: then x itself is normalised). */
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride,
                      const float *w, float eps, int64_t rows, int64_t n, int64_t lanes,
                      float *out_norm, float *out_res, int64_t n_threads) {
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float *s = res ? out_res + r * n : (float *)(x + r * x_stride);
        if (res) {
            const float *xr = x + r * x_stride, *rr = res + r * res_stride;
            for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + rr[i];
        }
        const float sum = lanes == 16 ? row_sum_of_squares_16(s, n) : row_sum_of_squares_8(s, n);
        const float mean = sum / (float)n;
        const float scale = 1.0f / sqrtf(mean + eps);
        float *o = out_norm + r * n;
        for (int64_t i = 0; i < n; ++i) o[i] = (s[i] * scale) * w[i];
    }
}

/* Neox rotary of `heads` heads of d floats from src into dst: first half and second half rotate
   together, each product and sum rounded once, in the reference's order. */
static inline void rotate_heads(const float *src, float *dst, int64_t heads, int64_t d, const float *c,
                                const float *s) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; ++h) {
        const float *x = src + h * d;
        float *o = dst + h * d;
        for (int64_t i = 0; i < half; ++i) {
            const float a = x[i] * c[i], b = x[half + i] * s[i];
            const float e = x[half + i] * c[i], f = x[i] * s[i];
            o[i] = a - b;
            o[half + i] = e + f;
        }
    }
}

/* Neox rotary of q [rows, qh, d] and k [rows, kh, d] (row strides given, heads contiguous), into
   contiguous outputs; cos and sin are [rows, d / 2]. */
void rotary_qk_f32(const float *q, int64_t q_stride, int64_t qh, const float *k, int64_t k_stride, int64_t kh,
                   const float *cos_t, const float *sin_t, int64_t d, int64_t rows,
                   float *out_q, float *out_k, int64_t n_threads) {
    const int64_t half = d / 2;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        rotate_heads(q + r * q_stride, out_q + r * qh * d, qh, d, c, s);
        rotate_heads(k + r * k_stride, out_k + r * kh * d, kh, d, c, s);
    }
}

/* One layer's rotary and K/V write from its fused projection qkv [rows, (qh + 2 kh) d] (row stride
   given; q heads, then k heads, then v heads): q rotated into out_q [rows, qh, d], k rotated straight
   into its cache slot, v copied into its slot (caches [slots, kh * d], contiguous). The same bits as
   rotary_qk_f32 then write_kv_f32, with one pass and no rotated-k tensor in between. */
void rotary_write_kv_f32(const float *qkv, int64_t stride, int64_t qh, int64_t kh, int64_t d,
                         const float *cos_t, const float *sin_t, int64_t rows, const int64_t *slots,
                         float *out_q, float *key_cache, float *value_cache, int64_t n_threads) {
    const int64_t half = d / 2, width = kh * d;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = qkv + r * stride, *c = cos_t + r * half, *s = sin_t + r * half;
        const int64_t slot = slots[r];
        rotate_heads(row, out_q + r * qh * d, qh, d, c, s);
        rotate_heads(row + qh * d, key_cache + slot * width, kh, d, c, s);
        memcpy(value_cache + slot * width, row + (qh + kh) * d, (size_t)width * sizeof(float));
    }
}

/* The K/V write: row r of k and of v (width floats each, row strides given) into cache slot
   slots[r] of key_cache and value_cache ([slots, width], contiguous). A plain copy, so any bits. */
void write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *key_cache,
                  float *value_cache, const int64_t *slots, int64_t rows, int64_t width, int64_t n_threads) {
    const size_t bytes = (size_t)width * sizeof(float);
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[r];
        memcpy(key_cache + slot * width, k + r * k_stride, bytes);
        memcpy(value_cache + slot * width, v + r * v_stride, bytes);
    }
}
"""


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


_library = OnDemandLibrary("cpu_elementwise", _SOURCE, "CPU element-wise kernels", _declare)
_lock = threading.Lock()
_lanes_for_size: dict[int, int | None] = {}  # hidden size -> lane count whose sums are torch's, or None


def _lib() -> ctypes.CDLL | None:
    if switch(DISABLE_ENV) is False:
        return None
    return _library.get()


def library() -> ctypes.CDLL | None:
    """The kernels' library (for callers of its entry points), or None where it is off or did not build."""
    return _lib()


def norm_lanes(n: int) -> int | None:
    """The lane count add_rms_norm_f32 takes at hidden size n, or None where no count gives torch's bits."""
    lib = _lib()
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
    lib = _lib()
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
    lib = _lib()
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
    lib = _lib()
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
    lib = _lib()
    if lib is None or rows == 0:
        return None
    out_q = torch.empty(rows, num_heads, d)
    lib.rotary_write_kv_f32(qkv.data_ptr(), qkv.stride(0), num_heads, num_kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                            rows, slot_mapping.data_ptr(), out_q.data_ptr(), key_cache.data_ptr(),
                            value_cache.data_ptr(), threads_for(rows * qkv.shape[1]))
    return out_q
