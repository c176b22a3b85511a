/* What every AMX kernel of the package shares (amx_gemm.c, amx_prefill_attention.c): the build
   target, the tile configuration, the exact three-part bfloat16 split of a float32 operand, exp, and
   one 32 x 32 block of products (amx_gemm.py's docstring has the argument).

   Everything after this header in a source is compiled for AVX-512 and AMX, whatever -march says:
   such a library is only loaded where the CPU has both (amx_gemm.available()). A source that
   includes it ends with AMX_TARGET_END. */
#ifndef TOKENMILL_AMX_TILES_H
#define TOKENMILL_AMX_TILES_H

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#define AMX_TARGET_END _Pragma("clang attribute pop")
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#define AMX_TARGET_END
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE_ELEMS 512 /* a 16 x 32 bfloat16 tile */
#define BLOCK_ELEMS (3 * 2 * TILE_ELEMS) /* three parts x two tiles: 32 rows (or columns) x 32 inputs */

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

#endif /* TOKENMILL_AMX_TILES_H */
