/* float32 GEMMs on the AMX tiles, each operand split exactly into three bfloat16 parts (amx_gemm.py). */
#include "amx_tiles.h"

#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the AMX tile state only to a process that asks (once; oneDNN asks too). */
int amx_request_permission(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

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

AMX_TARGET_END
