"""float32 GEMMs on the CPU's AMX tiles, each operand split exactly into three bfloat16 parts.

Why: on a CPU with AMX (Intel Xeon from Sapphire Rapids on) one core multiplies bfloat16 tiles at
about 1,024 flop per cycle, against 64 for float32 FMA in AVX-512: oneDNN's float32 GEMM peaks here
at 165-180 GFLOP/s on one core, its bfloat16 GEMM at 1.0-1.5 TFLOP/s. The layers' projections are
two thirds of a SmolLM2 step, all float32.

How, without leaving float32's accuracy: a float32 x is the exact sum x1 + x2 + x3 of three
bfloat16 numbers (x1 = bf16(x), x2 = bf16(x - x1), x3 = x - x1 - x2; 8 + 8 + 8 significant bits
cover float32's 24). So x . w = sum over i, j of xi . wj. The kernel keeps the six products with
i + j <= 4 and drops x2.w3, x3.w2, x3.w3, each below 2^-24 |x||w|, under float32's own rounding of
one product. Every bfloat16 product is exact in float32 and the tiles accumulate in float32, so a
logit's error is that of a float32 GEMM with another summation order: measured against float64,
the largest error relative to sum |x||w| is 1.0-2.0e-7 here, against 1.4-4.2e-7 for oneDNN's
float32 GEMM (tests/test_cpu_amx_gemm.py holds it under a bound). Six tile products per float32
product still leave about 2.6x float32's peak; measured per GEMM at SmolLM2's shapes, 1.4-1.9x
oneDNN's float32 (docs/engine.md).

Layout: the weight is split and packed once, at load, into the tiles' VNNI order (a 16 x 32 tile of
the three parts per 32 columns and 32 inputs); the activations are split per call, 32 rows at a
time, into the same blocks. One output block is 32 x 32 (four accumulator tiles, two A and two B
tiles). Threads split the columns, so a thread's weight stays in its own L2; inputs longer than
about 640 KB of split rows run in K slabs, the accumulators kept in a float32 workspace between
slabs (an exact round trip), so a row's bits do not depend on the slab, the row count, the other
rows or the thread count.

Where it applies: a float32 CPU weight, a CPU with amx_bf16, amx_tile and avx512_bf16 whose kernel
grants the tile state (arch_prctl), a C compiler that knows the AMX intrinsics (GCC 11, clang 12),
and a self-check against float64 at first use. Elsewhere available() is False and callers keep
oneDNN / MKL. TOKENMILL_AMX_GEMM=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import NamedTuple

import torch

from tokenmill.engine.c_build import OnDemandLibrary
from tokenmill.engine.switches import switch

log = logging.getLogger(__name__)

DISABLE_ENV = "TOKENMILL_AMX_GEMM"  # "0": float32 GEMMs never on AMX

# Row blocks (of 32 rows) per pass of one thread: the split rows of a pass (rows x K x 6 bytes) stay
# in the core's L2 while every column pair reads them.
PASS_BLOCKS = 8
# Bytes of split rows per K slab: a pass over longer inputs (SmolLM2's down projection, K = 1,536)
# runs in slabs of at most this many, with the partial sums kept between slabs.
SLAB_BYTES = 640 * 1024
# The largest error of a self-check product against float64, relative to sum |x||w|: 4x what the
# split leaves (1-2e-7 measured), still below what oneDNN's float32 GEMM shows on the same data.
SELF_CHECK_BOUND = 8e-7
# How the threads share a call (amx_gemm), measured on 2 threads over a model's worth of weights in
# turn (so that each weight comes from L3, as in a step):
# - up to COLUMN_MAJOR_BLOCKS blocks of 32 rows, column-major, each thread splitting all rows itself:
#   it reads a share of the weight instead of all of it;
# - up to SHARED_SPLIT_BLOCKS, for a weight of at least SHARED_SPLIT_MIN_WEIGHT_BYTES (split, three
#   quarters of a 4 MiB L2), column-major with the rows split once between the threads: SmolLM2's
#   projections at 96-160 rows 0.99-1.18x row-major (gate/up and down 1.03-1.18x); tiny-llama's
#   weights (at most 2.1 MB split) 0.8-0.95x, so they stay row-major;
# - else row-major.
COLUMN_MAJOR_BLOCKS = 2
SHARED_SPLIT_BLOCKS = 5
SHARED_SPLIT_MIN_WEIGHT_BYTES = 3 << 20

# What every AMX kernel of the project shares (the attention prefill kernel includes it too): the
# build target, the tile state, the three-part split, exp and one 32 x 32 block of products.
TILES_SOURCE = r"""
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_ELEMS 512 /* a 16 x 32 bfloat16 tile */
#define BLOCK_ELEMS (3 * 2 * TILE_ELEMS) /* three parts x two tiles: 32 rows (or columns) x 32 inputs */

/* Linux hands out the AMX tile state only to a process that asks (once; oneDNN asks too). */
int amx_request_permission(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

static inline __m512 widen(__m256bh h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

/* 16 floats -> their three bfloat16 parts (round to nearest even each time; the last is exact). */
static inline void split16(__m512 v, uint16_t *p1, uint16_t *p2, uint16_t *p3) {
    __m256bh h1 = _mm512_cvtneps_pbh(v);
    __m512 r1 = _mm512_sub_ps(v, widen(h1));
    __m256bh h2 = _mm512_cvtneps_pbh(r1);
    __m256bh h3 = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen(h2)));
    _mm256_storeu_si256((__m256i *)p1, (__m256i)h1);
    _mm256_storeu_si256((__m256i *)p2, (__m256i)h2);
    _mm256_storeu_si256((__m256i *)p3, (__m256i)h3);
}

static inline __m512 load16(const float *row, int64_t from, int64_t k, int valid) {
    if (valid && from + 16 <= k) return _mm512_loadu_ps(row + from);
    __mmask16 mask = (valid && from < k) ? (__mmask16)((1u << (k - from)) - 1u) : 0;
    return _mm512_maskz_loadu_ps(mask, row + from);
}

/* Column `col` of a packed B operand (a weight row, or a cached key) from its k floats at `src` (zeros
   where !valid): [col / 32][k / 32][part 3][half 2][16 input pairs][16 columns][2] bfloat16, the
   tiles' VNNI order, kbs = k_pad / 32 input blocks. */
static void pack_column(const float *src, int64_t k, int valid, int64_t col, int64_t kbs, uint16_t *out) {
    uint16_t parts[3][32];
    const int64_t pair = col / 32, half = (col / 16) & 1, c = col & 15;
    for (int64_t kb = 0; kb < kbs; ++kb) {
        for (int j = 0; j < 32; j += 16)
            split16(load16(src, kb * 32 + j, k, valid), parts[0] + j, parts[1] + j, parts[2] + j);
        uint16_t *block = out + (pair * kbs + kb) * BLOCK_ELEMS;
        for (int p = 0; p < 3; ++p) {
            uint16_t *tile = block + (p * 2 + half) * TILE_ELEMS;
            for (int r = 0; r < 16; ++r) {
                tile[r * 32 + c * 2] = parts[p][2 * r];
                tile[r * 32 + c * 2 + 1] = parts[p][2 * r + 1];
            }
        }
    }
}

/* exp(x) for 16 floats, within 1 ulp: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by Cephes'
   expf polynomial, then times 2^n by scalef (which gives inf past 88.7 and 0 below -104). */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* The input of a row at `from`: x itself, or with silu_mul (x = [gate | up], k wide each) SiLU(gate)
   * up, computed as the torch layer does: gate / (1 + exp(-gate)) * up. */
static inline __m512 input16(const float *row, int64_t from, int64_t k, int valid, int silu_mul) {
    __m512 v = load16(row, from, k, valid);
    if (!silu_mul) return v;
    const __m512 up = load16(row + k, from, k, valid);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    return _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), up);
}

/* Row i (0-31) of a packed A operand from its k inputs at `src` (zeros where !valid):
   [k / 32][part 3][half 2][16 rows][32] bfloat16, kbs = k_pad / 32 input blocks. */
static void split_row(const float *src, int64_t k, int valid, int silu_mul, int64_t i, int64_t kbs, uint16_t *out) {
    const int64_t half = i / 16, r = i & 15;
    for (int64_t kb = 0; kb < kbs; ++kb) {
        uint16_t *dst = out + kb * BLOCK_ELEMS + (half * 16 + r) * 32;
        for (int j = 0; j < 32; j += 16)
            split16(input16(src, kb * 32 + j, k, valid, silu_mul), dst + j, dst + 2 * TILE_ELEMS + j,
                    dst + 4 * TILE_ELEMS + j);
    }
}

/* Two A tiles (rows) times two B tiles (columns) into the four accumulators. */
#define FOUR_PRODUCTS() do { \
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); \
} while (0)

/* A 32 x 32 output block over input blocks [kb0, kb1): the accumulators start at zero (first slab)
   or from acc, and end in acc. The products go from the largest parts to the smallest. */
static void block_32x32(const uint16_t *a, const uint16_t *b, int64_t kb0, int64_t kb1, float *acc,
                        int64_t acc_stride, int first) {
    const int64_t s = acc_stride * 4;
    if (first) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
    else {
        _tile_loadd(0, acc, s); _tile_loadd(1, acc + 16, s);
        _tile_loadd(2, acc + 16 * acc_stride, s); _tile_loadd(3, acc + 16 * acc_stride + 16, s);
    }
    for (int64_t kb = kb0; kb < kb1; ++kb) {
        const uint16_t *ak = a + kb * BLOCK_ELEMS, *bk = b + kb * BLOCK_ELEMS;
        _tile_loadd(6, bk, 64); _tile_loadd(7, bk + TILE_ELEMS, 64);                  /* w1 */
        _tile_loadd(4, ak, 64); _tile_loadd(5, ak + TILE_ELEMS, 64); FOUR_PRODUCTS(); /* x1 w1 */
        _tile_loadd(4, ak + 2 * TILE_ELEMS, 64); _tile_loadd(5, ak + 3 * TILE_ELEMS, 64); FOUR_PRODUCTS(); /* x2 w1 */
        _tile_loadd(4, ak + 4 * TILE_ELEMS, 64); _tile_loadd(5, ak + 5 * TILE_ELEMS, 64); FOUR_PRODUCTS(); /* x3 w1 */
        _tile_loadd(6, bk + 2 * TILE_ELEMS, 64); _tile_loadd(7, bk + 3 * TILE_ELEMS, 64); /* w2 */
        _tile_loadd(4, ak, 64); _tile_loadd(5, ak + TILE_ELEMS, 64); FOUR_PRODUCTS(); /* x1 w2 */
        _tile_loadd(4, ak + 2 * TILE_ELEMS, 64); _tile_loadd(5, ak + 3 * TILE_ELEMS, 64); FOUR_PRODUCTS(); /* x2 w2 */
        _tile_loadd(6, bk + 4 * TILE_ELEMS, 64); _tile_loadd(7, bk + 5 * TILE_ELEMS, 64); /* w3 */
        _tile_loadd(4, ak, 64); _tile_loadd(5, ak + TILE_ELEMS, 64); FOUR_PRODUCTS(); /* x1 w3 */
    }
    _tile_stored(0, acc, s); _tile_stored(1, acc + 16, s);
    _tile_stored(2, acc + 16 * acc_stride, s); _tile_stored(3, acc + 16 * acc_stride + 16, s);
}

"""

SOURCE_TAIL = r"""
#if defined(__clang__)
#pragma clang attribute pop
#endif
"""

_SOURCE = TILES_SOURCE + r"""
/* w [n, k] float32 -> [n / 32][k / 32][part 3][half 2][16 input pairs][16 columns][2] bfloat16, the
   tiles' VNNI order; zero past n and k. */
void amx_pack_weight(const float *w, int64_t n, int64_t k, int64_t n_pad, int64_t k_pad, uint16_t *out,
                     int64_t n_threads) {
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t col = 0; col < n_pad; ++col)
        pack_column(w + col * k, k, col < n, col, k_pad / 32, out);
}

/* 32 rows of x (row0 on; zero past m) -> [k / 32][part 3][half 2][16 rows][32] bfloat16. */
static void split_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t row0, int64_t k_pad,
                       int silu_mul, uint16_t *out) {
    for (int64_t i = 0; i < 32; ++i)
        split_row(x + (row0 + i) * x_stride, k, row0 + i < m, silu_mul, i, k_pad / 32, out);
}

/* y [m, n] = x [m, k] . w^T (+ bias), w packed by amx_pack_weight. With silu_mul, x is [m, 2k], the
   gate and up projections side by side, and the product's input is SiLU(gate) * up.

   The work is the 32 x 32 output blocks (row block rb, column pair p) in row-major order, or
   column-major with col_major. Thread t takes the t-th of n_threads equal runs of that order, so the
   shares differ by at most one block whatever the row count (by whole row blocks, 160 rows on two
   threads would be 3 : 2), and row-major a thread's rows are those a static split of the rows gives
   it, as the element-wise kernels split them. A thread works through its row blocks in passes of up
   to pass_blocks: it splits a pass's rows into slots of its own in split_ws (pass_blocks x k_pad x 96
   bfloat16 per thread), multiplies them by each column pair of its run in slabs of slab_blocks input
   blocks, and writes the pass out from its own slots of acc_ws (pass_blocks x 32 x n_pad floats per
   thread): it waits for no other thread and reads no split rows of another core (a row block that two
   runs share is split twice). With shared_split (column-major, one pass, one set of slots) each thread
   splits a share of the rows and all wait for all: for a few rows times a large weight, each thread
   then reads only its share of the weight and splits only its share of the rows. */
void amx_gemm(const float *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *w, int64_t n,
              int64_t n_pad, int64_t k_pad, const float *bias, float *y, uint16_t *split_ws, float *acc_ws,
              int64_t pass_blocks, int64_t slab_blocks, int64_t n_threads, int64_t col_major, int64_t shared_split,
              int64_t silu_mul) {
    const int64_t kbs = k_pad / 32, pairs = n_pad / 32, row_blocks = (m + 31) / 32, items = row_blocks * pairs;
    #pragma omp parallel num_threads(n_threads)
    {
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        const int64_t i0 = items * t / nt, i1 = items * (t + 1) / nt;
        /* The row blocks [rb0, rb1) and column pairs [p0, p1) that the run [i0, i1) touches. */
        int64_t rb0 = 0, rb1 = row_blocks, p0 = 0, p1 = pairs;
        if (i0 >= i1) rb1 = 0;
        else if (col_major) { p0 = i0 / row_blocks; p1 = (i1 - 1) / row_blocks + 1; }
        else { rb0 = i0 / pairs; rb1 = (i1 - 1) / pairs + 1; }
        uint16_t *split = shared_split ? split_ws : split_ws + t * pass_blocks * kbs * BLOCK_ELEMS;
        float *acc = shared_split ? acc_ws : acc_ws + t * pass_blocks * 32 * n_pad;
        if (shared_split) {
            for (int64_t rb = row_blocks * t / nt; rb < row_blocks * (t + 1) / nt; ++rb)
                split_rows(x, x_stride, m, k, rb * 32, k_pad, (int)silu_mul, split + rb * kbs * BLOCK_ELEMS);
            #pragma omp barrier
        }
        if (rb0 < rb1) configure_tiles();
        for (int64_t pa = rb0; pa < rb1; pa += pass_blocks) {
            const int64_t pb = pa + pass_blocks < rb1 ? pa + pass_blocks : rb1;
            for (int64_t rb = pa; rb < pb && !shared_split; ++rb)
                split_rows(x, x_stride, m, k, rb * 32, k_pad, (int)silu_mul, split + (rb - pa) * kbs * BLOCK_ELEMS);
            for (int64_t kb0 = 0; kb0 < kbs; kb0 += slab_blocks) {
                const int64_t kb1 = kb0 + slab_blocks < kbs ? kb0 + slab_blocks : kbs;
                /* Column pairs outside, so one pair of w serves all of the pass's rows in turn. */
                for (int64_t p = p0; p < p1; ++p)
                    for (int64_t rb = pa; rb < pb; ++rb) {
                        const int64_t item = col_major ? p * row_blocks + rb : rb * pairs + p;
                        if (item < i0 || item >= i1) continue;
                        block_32x32(split + (rb - pa) * kbs * BLOCK_ELEMS, w + p * kbs * BLOCK_ELEMS, kb0, kb1,
                                    acc + (rb - pa) * 32 * n_pad + p * 32, n_pad, kb0 == 0);
                    }
            }
            /* The pass's blocks of this run are final: out with the bias, row by row over the run's
               columns of that row (one span: a run is contiguous in either order). */
            for (int64_t rb = pa; rb < pb; ++rb) {
                int64_t q0, q1;
                if (col_major) { q0 = (i0 - rb + row_blocks - 1) / row_blocks; q1 = (i1 - rb + row_blocks - 1) / row_blocks; }
                else { q0 = i0 - rb * pairs; q1 = i1 - rb * pairs; }
                q0 = q0 < 0 ? 0 : q0;
                q1 = q1 > pairs ? pairs : q1;
                const int64_t c0 = q0 * 32, c1 = q1 * 32 < n ? q1 * 32 : n;
                const int64_t r1 = rb * 32 + 32 < m ? rb * 32 + 32 : m;
                for (int64_t r = rb * 32; r < r1 && c1 > c0; ++r) {
                    float *dst = y + r * n;
                    const float *src = acc + (r - pa * 32) * n_pad;
                    if (bias) for (int64_t j = c0; j < c1; ++j) dst[j] = src[j] + bias[j];
                    else memcpy(dst + c0, src + c0, (size_t)(c1 - c0) * sizeof(float));
                }
            }
        }
        if (rb0 < rb1) _tile_release();
    }
}
""" + SOURCE_TAIL


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_request_permission.argtypes = []
    lib.amx_request_permission.restype = ctypes.c_int
    lib.amx_pack_weight.argtypes = [ptr, i64, i64, i64, i64, ptr, i64]
    lib.amx_pack_weight.restype = None
    lib.amx_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    lib.amx_gemm.restype = None


_library = OnDemandLibrary("cpu_amx_gemm", _SOURCE, "AMX split-bfloat16 GEMM", _declare)
_lock = threading.Lock()
_ready: bool | None = None
_self_checking = False  # set while available() runs the self-check (under _lock)
_workspaces = threading.local()  # each thread's split rows and partial sums (steps in parts run side by side)

_NEEDED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in flags for flag in _NEEDED_FLAGS)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class SplitWeight:
    """A float32 weight [out, in] split into three bfloat16 parts and packed for the tiles."""

    __slots__ = ("n", "k", "n_pad", "k_pad", "packed")

    def __init__(self, weight: torch.Tensor):
        # available() also asks the kernel for the tile state: without it the first tile
        # instruction kills the process (SIGILL).
        lib = _library.get() if _ready or _self_checking or available() else None
        if lib is None:
            raise RuntimeError("the AMX GEMM is not available on this machine (cpu_amx_gemm.available())")
        self.n, self.k = weight.shape
        self.n_pad, self.k_pad = _round_up(self.n, 32), _round_up(self.k, 32)
        w = weight.detach().contiguous()
        self.packed = torch.empty(self.n_pad * self.k_pad * 3, dtype=torch.int16)
        lib.amx_pack_weight(w.data_ptr(), self.n, self.k, self.n_pad, self.k_pad, self.packed.data_ptr(),
                            torch.get_num_threads())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, in] (rows may be strided) @ weight.T + bias, float32 [m, out]."""
        return self._gemm(x, bias, silu_mul=False)

    def linear_silu_mul(self, gate_up: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(SiLU(gate) * up) @ weight.T + bias for gate_up = [gate | up] [m, 2 * in]: the MLP's down
        projection with layers.silu_and_mul folded into the split of its rows, so the product of the
        two never goes to memory (one pass over [m, 2 * in] instead of three)."""
        return self._gemm(gate_up, bias, silu_mul=True)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
        width = 2 * self.k if silu_mul else self.k
        if x.dim() != 2 or x.shape[1] != width or x.dtype != torch.float32 or x.stride(1) != 1:
            x = x.reshape(-1, width).float().contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n)
        if m == 0:
            return y
        if bias is not None:
            bias = bias.detach().float().contiguous()
        threads = torch.get_num_threads()
        plan = self.plan(m, threads)
        split_ws, acc_ws = workspace(plan.split_elems, plan.acc_elems)
        _library.get().amx_gemm(
            x.data_ptr(), x.stride(0), m, self.k, self.packed.data_ptr(), self.n, self.n_pad, self.k_pad,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), split_ws.data_ptr(), acc_ws.data_ptr(),
            plan.pass_blocks, plan.slab_blocks, threads, plan.col_major, plan.shared_split, silu_mul,
        )
        return y

    def plan(self, m: int, threads: int) -> GemmPlan:
        """How `threads` threads share a call of m rows, and the workspaces it needs (the kernel's
        arguments beyond the operands; cpu_decode_layers.py passes them to the kernel itself)."""
        row_blocks = -(-m // 32)
        # How the threads share the call: see COLUMN_MAJOR_BLOCKS.
        col_major = threads > 1 and row_blocks <= COLUMN_MAJOR_BLOCKS
        shared_split = (threads > 1 and not col_major and row_blocks <= SHARED_SPLIT_BLOCKS
                        and self.n_pad * self.k_pad * 6 >= SHARED_SPLIT_MIN_WEIGHT_BYTES)
        if shared_split:
            col_major, pass_blocks, copies = True, row_blocks, 1
        elif col_major:
            pass_blocks, copies = row_blocks, threads
        else:  # the most row blocks one thread's run can touch, at most a pass's worth
            run = -(-row_blocks * (self.n_pad // 32) // threads)
            pass_blocks, copies = min(PASS_BLOCKS, row_blocks, -(-run // (self.n_pad // 32)) + 1), threads
        kbs = self.k_pad // 32
        slab_blocks = max(1, SLAB_BYTES // (pass_blocks * 32 * 32 * 6))
        slabs = -(-kbs // slab_blocks)
        slab_blocks = -(-kbs // slabs)  # equal slabs
        return GemmPlan(pass_blocks, slab_blocks, int(col_major), int(shared_split),
                        copies * pass_blocks * 32 * self.k_pad * 3, copies * pass_blocks * 32 * self.n_pad)


class GemmPlan(NamedTuple):
    """The kernel's split of one call over its threads (SplitWeight.plan)."""

    pass_blocks: int
    slab_blocks: int
    col_major: int
    shared_split: int
    split_elems: int  # int16 elements of split rows the call needs
    acc_elems: int  # float32 elements of partial sums


def workspace(split_elems: int, acc_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's workspaces, grown to at least the sizes asked (kept: every step needs them)."""
    split = getattr(_workspaces, "split", None)
    if split is None or split.numel() < split_elems:
        split = _workspaces.split = torch.empty(split_elems, dtype=torch.int16)
    acc = getattr(_workspaces, "acc", None)
    if acc is None or acc.numel() < acc_elems:
        acc = _workspaces.acc = torch.empty(acc_elems, dtype=torch.float32)
    return split, acc


def _self_check() -> bool:
    """Products of awkward shapes (tails of rows, columns and inputs, two slabs, a bias) against
    float64: a kernel that is wrong on this CPU turns the path off instead of serving wrong logits."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((5, 40, 48), (260, 1100, 33), (70, 96, 70)):
        weight = torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, k)
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        got = SplitWeight(weight).linear(x, bias).double()
        want = x.double() @ weight.double().T + bias.double()
        scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()
        if not bool(((got - want).abs() <= SELF_CHECK_BOUND * scale).all()):
            return False
    return True


def library() -> ctypes.CDLL | None:
    """The kernel's library where the AMX GEMM is available (for callers of its entry points), else None."""
    return _library.get() if available() else None


def available() -> bool:
    """True when float32 weights can run on the AMX split kernel here (checked once per process)."""
    global _ready
    global _self_checking
    if switch(DISABLE_ENV) is False:
        return False
    if _ready is not None:  # settled: every layer of every step asks, so no lock then
        return _ready
    with _lock:
        if _ready is None:
            ready = False
            if not _cpu_has_amx():
                log.info("no AMX on this CPU: float32 GEMMs stay on oneDNN / MKL")
            elif (lib := _library.get()) is None:
                log.info("the AMX GEMM did not build: float32 GEMMs stay on oneDNN / MKL")
            elif not lib.amx_request_permission():
                log.info("the kernel refused the AMX tile state: float32 GEMMs stay on oneDNN / MKL")
            else:
                _self_checking = True  # the self-check's own SplitWeights may be built
                try:
                    with torch.inference_mode():
                        ready = _self_check()
                finally:
                    _self_checking = False
                if not ready:
                    log.warning("the AMX GEMM failed its self-check: float32 GEMMs stay on oneDNN / MKL")
            _ready = ready  # only the final answer: read without the lock above
        return _ready


def forced() -> bool | None:
    """The switch as set: False (off), True or None (on where available)."""
    return switch(DISABLE_ENV)
