/* A float32 GEMM whose every output is one fused multiply-add chain in a fixed order
   (invariant_gemm.py): y[m][n] = bias[n] + (w[n][0] x[m][0] + w[n][1] x[m][1] + ... ), the chain
   starting from 0 and taking k = 0, 1, ..., K - 1 in turn, each step one fmaf (one rounding), the
   bias added last. Nothing else decides the bits: not the row count, not the other rows, not the
   thread count, not the vector width. The threads split columns (panels of 16) and rows, never k;
   K is cut into blocks only to keep operands in cache, and a block's partial sums go to memory and
   come back as they are (a float32 round trip is exact), so the chain goes on unbroken.

   Layout: the weight [N][K] is packed once into panels of 16 columns, panel p holding
   w[16p + j][k] at packed[(p * K + k) * 16 + j] (columns past N are zero and never stored). The
   micro-kernel keeps a tile of up to 6 rows x 16 columns in twelve 8-lane accumulators: per k it
   broadcasts the 6 rows' x[m][k], loads the panel's 16 weights and issues 12 FMAs, so each lane is
   the chain of one (row, column). With AVX-512 the tile is 12 rows x 32 columns of 16-lane vectors
   (tile512 below); without AVX2 and FMA the same chains run through fmaf. */
#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_FMA 1
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif

#define NR 16 /* columns per panel */
#define MR 6  /* rows per micro-tile */

int64_t ig_panel_width(void) { return NR; }

/* packed [ceil(N / 16)][K][16] from w [N][K] (row stride ldw). */
void ig_pack_weight(const float *w, int64_t ldw, int64_t n, int64_t k, float *packed, int64_t n_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t j = 0; j < NR; ++j) {
                const int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * ldw + kk] : 0.f;
            }
    }
}

#ifndef HAVE_AVX512 /* the tiles of 8-lane vectors (AVX2) or of fmaf: CPUs without AVX-512 */
#ifdef HAVE_AVX2_FMA
/* The lanes of columns 0..nr-1 of a panel, for the masked loads and stores of its last panel. */
static inline void column_masks(int64_t nr, __m256i *lo, __m256i *hi) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    *lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr), lane);
    *hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr - 8), lane);
}

/* Row i of a tile of R rows: its two accumulators start from 0 or from c (masked past column nr). */
#define ROW_START(i)                                                                                   \
    if (ROWS > i) {                                                                                    \
        if (first) {                                                                                   \
            l##i = _mm256_setzero_ps(); h##i = _mm256_setzero_ps();                                    \
        } else if (full) {                                                                             \
            l##i = _mm256_loadu_ps(c + i * ldc); h##i = _mm256_loadu_ps(c + i * ldc + 8);              \
        } else {                                                                                       \
            l##i = _mm256_maskload_ps(c + i * ldc, mlo); h##i = _mm256_maskload_ps(c + i * ldc + 8, mhi); \
        }                                                                                              \
    }
#define ROW_FMA(i)                                                                                     \
    if (ROWS > i) {                                                                                    \
        const __m256 a = _mm256_broadcast_ss(x + i * ldx + kk);                                        \
        l##i = _mm256_fmadd_ps(a, b0, l##i); h##i = _mm256_fmadd_ps(a, b1, h##i);                     \
    }
#define ROW_STORE(i)                                                                                   \
    if (ROWS > i) {                                                                                    \
        if (full) {                                                                                    \
            _mm256_storeu_ps(c + i * ldc, l##i); _mm256_storeu_ps(c + i * ldc + 8, h##i);              \
        } else {                                                                                       \
            _mm256_maskstore_ps(c + i * ldc, mlo, l##i); _mm256_maskstore_ps(c + i * ldc + 8, mhi, h##i); \
        }                                                                                              \
    }

/* One tile of R rows (R constant in each instance, so unused rows vanish and the twelve
   accumulators stay in registers): rows 0..R-1 of x (row stride ldx, already offset to the K
   block), one panel's kc x 16 block b, into c (row stride ldc) for columns 0..nr-1. first: the
   chains start from 0, else from what c holds (the previous K block's partial sums). */
#define DEFINE_TILE(R)                                                                                 \
static void tile_##R(const float *x, int64_t ldx, const float *b, int64_t kc, float *c, int64_t ldc,  \
                     int64_t nr, int first) {                                                          \
    enum { ROWS = R };                                                                                 \
    const int full = nr == NR;                                                                         \
    __m256i mlo, mhi;                                                                                  \
    column_masks(nr, &mlo, &mhi);                                                                      \
    __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;                     \
    __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;                                      \
    ROW_START(0) ROW_START(1) ROW_START(2) ROW_START(3) ROW_START(4) ROW_START(5)                       \
    for (int64_t kk = 0; kk < kc; ++kk) {                                                              \
        const __m256 b0 = _mm256_loadu_ps(b + kk * NR), b1 = _mm256_loadu_ps(b + kk * NR + 8);         \
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)                              \
    }                                                                                                  \
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)                      \
}
#else
/* Without AVX2 and FMA: the same chains, one column at a time, through fmaf. */
#define DEFINE_TILE(R)                                                                                 \
static void tile_##R(const float *x, int64_t ldx, const float *b, int64_t kc, float *c, int64_t ldc,  \
                     int64_t nr, int first) {                                                          \
    for (int i = 0; i < R; ++i)                                                                        \
        for (int64_t j = 0; j < nr; ++j) {                                                             \
            float acc = first ? 0.f : c[i * ldc + j];                                                  \
            for (int64_t kk = 0; kk < kc; ++kk) acc = fmaf(x[i * ldx + kk], b[kk * NR + j], acc);      \
            c[i * ldc + j] = acc;                                                                      \
        }                                                                                              \
}
#endif
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

static void tiles(const float *x, int64_t ldx, int64_t rows, const float *b, int64_t kc, float *c, int64_t ldc,
                  int64_t nr, int first) {
    int64_t i = 0;
    for (; i + MR <= rows; i += MR) tile_6(x + i * ldx, ldx, b, kc, c + i * ldc, ldc, nr, first);
    switch (rows - i) {
    case 5: tile_5(x + i * ldx, ldx, b, kc, c + i * ldc, ldc, nr, first); break;
    case 4: tile_4(x + i * ldx, ldx, b, kc, c + i * ldc, ldc, nr, first); break;
    case 3: tile_3(x + i * ldx, ldx, b, kc, c + i * ldc, ldc, nr, first); break;
    case 2: tile_2(x + i * ldx, ldx, b, kc, c + i * ldc, ldc, nr, first); break;
    case 1: tile_1(x + i * ldx, ldx, b, kc, c + i * ldc, ldc, nr, first); break;
    default: break;
    }
}
#endif

#ifdef HAVE_AVX512
/* With AVX-512: a tile of R rows x P panels (P = 1 or 2: 16 or 32 columns), one 16-lane accumulator
   per row and panel (up to 24 of the 32 registers), per k one load of each panel's 16 weights and a
   broadcast per row: twice the lanes of the AVX2 tile and fewer loads per FMA. Each lane is still the
   chain of one (row, column), so the bits are those of the AVX2 tile and of fmaf. b1: the second
   panel's block (P = 2); nr: the columns of the last panel of the tile (its lanes past nr are masked
   on load and store). */
#define MR512 12
static inline __attribute__((always_inline)) void tile512(
    const float *x, int64_t ldx, const float *b0, const float *b1, int64_t kc, float *c, int64_t ldc, int64_t nr,
    int first, const int R, const int P) {
    const __mmask16 last = (__mmask16)(nr >= NR ? 0xFFFF : (1u << nr) - 1u);
    const __mmask16 m0 = P == 2 ? (__mmask16)0xFFFF : last;
    __m512 acc0[MR512], acc1[MR512];
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
        acc0[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, c + i * ldc);
        if (P == 2) acc1[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(last, c + i * ldc + NR);
    }
    for (int64_t kk = 0; kk < kc; ++kk) {
        const __m512 w0 = _mm512_loadu_ps(b0 + kk * NR);
        const __m512 w1 = P == 2 ? _mm512_loadu_ps(b1 + kk * NR) : w0;
#pragma GCC unroll 12
        for (int i = 0; i < R; ++i) {
            const __m512 a = _mm512_set1_ps(x[i * ldx + kk]);
            acc0[i] = _mm512_fmadd_ps(a, w0, acc0[i]);
            if (P == 2) acc1[i] = _mm512_fmadd_ps(a, w1, acc1[i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
        _mm512_mask_storeu_ps(c + i * ldc, m0, acc0[i]);
        if (P == 2) _mm512_mask_storeu_ps(c + i * ldc + NR, last, acc1[i]);
    }
}

#define DEFINE_TILE512(R, P)                                                                           \
static void tile512_##R##_##P(const float *x, int64_t ldx, const float *b0, const float *b1, int64_t kc, \
                              float *c, int64_t ldc, int64_t nr, int first) {                          \
    tile512(x, ldx, b0, b1, kc, c, ldc, nr, first, R, P);                                              \
}
#define DEFINE_TILES512(R) DEFINE_TILE512(R, 1) DEFINE_TILE512(R, 2)
DEFINE_TILES512(1) DEFINE_TILES512(2) DEFINE_TILES512(3) DEFINE_TILES512(4) DEFINE_TILES512(5)
DEFINE_TILES512(6) DEFINE_TILES512(7) DEFINE_TILES512(8) DEFINE_TILES512(9) DEFINE_TILES512(10)
DEFINE_TILES512(11) DEFINE_TILES512(12)

typedef void (*tile512_fn)(const float *, int64_t, const float *, const float *, int64_t, float *, int64_t,
                           int64_t, int);
static const tile512_fn TILE512[2][MR512 + 1] = {
    {0, tile512_1_1, tile512_2_1, tile512_3_1, tile512_4_1, tile512_5_1, tile512_6_1, tile512_7_1, tile512_8_1,
     tile512_9_1, tile512_10_1, tile512_11_1, tile512_12_1},
    {0, tile512_1_2, tile512_2_2, tile512_3_2, tile512_4_2, tile512_5_2, tile512_6_2, tile512_7_2, tile512_8_2,
     tile512_9_2, tile512_10_2, tile512_11_2, tile512_12_2},
};

/* rows of x against panels p_begin..p_end-1 (packed, panel stride pk = K * 16 floats, already offset to
   the K block), into c: pairs of panels, then a last single one; n: the matrix's columns. */
static void panel_tiles512(const float *x, int64_t ldx, int64_t rows, const float *packed, int64_t pk, int64_t kc,
                           float *c, int64_t ldc, int64_t n, int64_t p_begin, int64_t p_end, int first) {
    for (int64_t p = p_begin; p < p_end;) {
        const int pair = p + 1 < p_end;
        const int64_t last_panel = p + pair;
        const int64_t nr = (n - last_panel * NR) < NR ? (n - last_panel * NR) : NR;
        const float *b0 = packed + p * pk, *b1 = pair ? b0 + pk : b0;
        for (int64_t i = 0; i < rows; i += MR512) {
            const int64_t r = rows - i < MR512 ? rows - i : MR512;
            TILE512[pair][r](x + i * ldx, ldx, b0, b1, kc, c + i * ldc + p * NR, ldc, nr, first);
        }
        p += 1 + pair;
    }
}
#endif

#include "fixed_exp.h"

static inline float silu_mul_scalar(float g, float u) { return g / (1.0f + exp_scalar(-g)) * u; }


/* out[r][j] = SiLU(gate[r][j]) * up[r][j] for gate_up = [gate | up] (row stride ld, width 2k),
   rows begin..end-1; SiLU(g) = g / (1 + e^-g), each operation rounded once. */
static void silu_mul_rows(const float *gate_up, int64_t ld, int64_t k, int64_t begin, int64_t end, float *out) {
    for (int64_t r = begin; r < end; ++r) {
        const float *g = gate_up + r * ld, *u = g + k;
        float *o = out + r * k;
        int64_t j = 0;
#ifdef HAVE_AVX2_FMA
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= k; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp_vector(_mm256_xor_ps(gv, sign));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < k; ++j) o[j] = silu_mul_scalar(g[j], u[j]);
    }
}

/* out [rows][k] = SiLU(gate) * up of gate_up [rows][2k] (row stride ld), split over threads by rows. */
void ig_silu_mul(const float *gate_up, int64_t ld, int64_t rows, int64_t k, float *out, int64_t n_threads) {
    #pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) silu_mul_rows(gate_up, ld, k, r, r + 1, out);
}

/* y [M][N] (row stride ldy) = x [M][K] (row stride ldx) . w^T + bias (bias may be NULL); with silu_mul,
   x is [M][2K] = [gate | up] and the input is SiLU(gate) * up, written to act [M][K] first.
   kc: the K block; mc: the rows of one pass (a multiple of MR). Each thread takes a contiguous
   share of the (row pass, panel) pairs; which thread computes a pair changes nothing in its bits. */
void ig_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const float *packed, int64_t n,
             const float *bias, float *y, int64_t ldy, int64_t kc, int64_t mc, int64_t n_threads,
             int silu_mul, float *act) {
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t passes = (m + mc - 1) / mc;
    const int64_t units = passes * panels;
    if (kc < 1) kc = k > 0 ? k : 1;
    if (n_threads > units) n_threads = units > 0 ? units : 1;
    #pragma omp parallel num_threads(n_threads)
    {
        int64_t t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        if (silu_mul) { /* the input is SiLU(gate) * up of x = [gate | up]: made once, then multiplied */
            silu_mul_rows(x, ldx, k, m * t / nt, m * (t + 1) / nt, act);
            #pragma omp barrier
        }
        const float *a = silu_mul ? act : x;
        const int64_t lda = silu_mul ? k : ldx;
        const int64_t begin = units * t / nt, end = units * (t + 1) / nt;
        /* units in pass-major order: a thread's share is a run of panels within one or two passes */
        for (int64_t u0 = begin; u0 < end;) {
            const int64_t pass = u0 / panels, p_begin = u0 % panels;
            const int64_t p_end = (end - pass * panels) < panels ? (end - pass * panels) : panels;
            const int64_t r0 = pass * mc, rows = (m - r0) < mc ? (m - r0) : mc;
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t kb = (k - k0) < kc ? (k - k0) : kc;
#ifdef HAVE_AVX512
                panel_tiles512(a + r0 * lda + k0, lda, rows, packed + k0 * NR, k * NR, kb, y + r0 * ldy, ldy, n,
                               p_begin, p_end, k0 == 0);
#else
                for (int64_t p = p_begin; p < p_end; ++p) {
                    const int64_t nr = (n - p * NR) < NR ? (n - p * NR) : NR;
                    tiles(a + r0 * lda + k0, lda, rows, packed + (p * k + k0) * NR, kb, y + r0 * ldy + p * NR, ldy, nr,
                          k0 == 0);
                }
#endif
            }
            if (k == 0)
                for (int64_t r = r0; r < r0 + rows; ++r)
                    for (int64_t col = p_begin * NR; col < n && col < p_end * NR; ++col) y[r * ldy + col] = 0.f;
            if (bias)
                for (int64_t r = r0; r < r0 + rows; ++r)
                    for (int64_t col = p_begin * NR; col < n && col < p_end * NR; ++col) y[r * ldy + col] += bias[col];
            u0 = pass * panels + p_end;
        }
    }
}
