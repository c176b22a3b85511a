/* The sampler's logprob parts of float32 logit rows (row_logprobs.py): per row its logsumexp and its
   top-N logits with their ids, in two passes over the row while it sits in the cache (the top-N with
   the maximum, its first entry; then the sum), one thread per row.

   A row's bits depend on that row alone: its maximum is exact in any order; its sum of
   e^(x - max) is kept in 32 float lanes (four 8-lane accumulators; lane j takes the elements
   j, j + 32, j + 64, ... in order, the tail past the last full 32 in a scalar chain), reduced in a
   fixed order in double; e^x is fixed_exp.h's, the same in every lane and in the tail. Neither the
   other rows, nor the row count, nor the thread count, nor which thread runs a row changes it.

   Top-N keeps the N largest in a small array sorted largest first, a logit entering only when it is
   larger than the N-th kept (so among equal logits the lowest id stays, as ids are read in order). */
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

#include "fixed_exp.h"

#define LANES 32
/* The 128 bytes (LANES floats, two cache lines) at p asked into the L2 cache. A row's first pass waits
   on memory for its logits; the pass of e^x is arithmetic: while a thread sums one row's e^x it asks
   for its next row, whose first pass then finds it in the cache. */
#define PREFETCH(p) (__builtin_prefetch((const char *)(p), 0, 2), __builtin_prefetch((const char *)(p) + 64, 0, 2))

static float row_max(const float *x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#ifdef HAVE_AVX2_FMA
    if (n >= 8) {
        __m256 a = _mm256_loadu_ps(x), b = a;
        for (i = 8; i + 16 <= n; i += 16) {
            a = _mm256_max_ps(a, _mm256_loadu_ps(x + i));
            b = _mm256_max_ps(b, _mm256_loadu_ps(x + i + 8));
        }
        a = _mm256_max_ps(a, b);
        float lanes[8];
        _mm256_storeu_ps(lanes, a);
        for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
    }
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

/* Sum of e^(x - m) over the row, the lanes as the header says (m: the row's finite maximum, so x - m
   is never above 0; a NaN returns NaN). `next` (or NULL): the row this thread takes next, asked into
   the cache meanwhile (PREFETCH). */
static double row_exp_sum(const float *x, int64_t n, float m, const float *next) {
    float acc[LANES];
    for (int j = 0; j < LANES; ++j) acc[j] = 0.0f;
    const int64_t full = n - n % LANES;
    int64_t i = 0;
#if defined(__AVX512F__)
    /* Two 16-lane accumulators: lane j of the 32 takes the same elements in the same order as the
       four 8-lane ones below, and e^x is the same in every lane, so the bits are the same. */
    const __m512 mv = _mm512_set1_ps(m);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    __mmask16 nan = 0;
    for (; i < full; i += LANES) {
        if (next) PREFETCH(next + i);
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        nan |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        a0 = _mm512_add_ps(a0, exp16_nonpositive(_mm512_sub_ps(v0, mv)));
        a1 = _mm512_add_ps(a1, exp16_nonpositive(_mm512_sub_ps(v1, mv)));
    }
    if (nan) return NAN;
    _mm512_storeu_ps(acc, a0);
    _mm512_storeu_ps(acc + 16, a1);
#elif defined(HAVE_AVX2_FMA)
    const __m256 mv = _mm256_set1_ps(m);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, nan = a0;
#define RL_STEP(acc_, at_)                                                                             \
    {                                                                                                  \
        const __m256 v = _mm256_loadu_ps(x + (at_));                                                   \
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                                    \
        acc_ = _mm256_add_ps(acc_, exp_vector_nonpositive(_mm256_sub_ps(v, mv)));                      \
    }
    for (; i < full; i += LANES) {
        if (next) PREFETCH(next + i);
        RL_STEP(a0, i)
        RL_STEP(a1, i + 8)
        RL_STEP(a2, i + 16)
        RL_STEP(a3, i + 24)
    }
#undef RL_STEP
    if (_mm256_movemask_ps(nan)) return NAN;
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
#else
    for (; i < full; i += LANES) {
        if (next) PREFETCH(next + i);
        for (int j = 0; j < LANES; ++j) {
            if (isnan(x[i + j])) return NAN;
            acc[j] += exp_scalar(x[i + j] - m);
        }
    }
#endif
    float tail = 0.0f;
    for (i = full; i < n; ++i) {
        if (isnan(x[i])) return NAN;
        tail += exp_scalar(x[i] - m);
    }
    double total = 0.0;
    for (int j = 0; j < LANES; ++j) total += (double)acc[j];
    return total + (double)tail;
}

/* Puts logit v of id into vals/ids (largest first) at position p or above: the entries from p up that
   it beats move down one (an equal logit stays above it: it came from an earlier id). */
static inline void insert_sorted(float *vals, int64_t *ids, int64_t p, float v, int64_t id) {
    while (p > 0 && vals[p - 1] < v) {
        vals[p] = vals[p - 1];
        ids[p] = ids[p - 1];
        --p;
    }
    vals[p] = v;
    ids[p] = id;
}

/* The top_n largest of the row, largest first, into vals/ids (top_n >= 1, n >= top_n). */
static void row_top(const float *x, int64_t n, int64_t top_n, float *vals, int64_t *ids) {
    int64_t i = 0;
    for (; i < top_n; ++i) insert_sorted(vals, ids, i, x[i], i); /* fill */
    float floor = vals[top_n - 1];
    for (; i < n; ++i) {
#if defined(__AVX512F__)
        /* Sixteen at a time while none beats the floor: the common case once the array is full. */
        if (i + 16 <= n) {
            if (!_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(floor), _CMP_GT_OQ)) {
                i += 15;
                continue;
            }
        }
#elif defined(HAVE_AVX2_FMA)
        /* Eight at a time while none beats the floor: the common case once the array is full. */
        if (i + 8 <= n) {
            const __m256 v = _mm256_loadu_ps(x + i);
            if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor), _CMP_GT_OQ))) {
                i += 7;
                continue;
            }
        }
#endif
        if (!(x[i] > floor)) continue;
        insert_sorted(vals, ids, top_n - 1, x[i], i); /* the last entry drops out */
        floor = vals[top_n - 1];
    }
}

/* For rows 0..rows-1 of x (row stride ld, vocab n): log_total[r] = max + log(sum e^(x - max)) and,
   when top_n > 0, the top_n largest logits and their ids (row r at top_vals + r * top_n). A row whose
   maximum is not finite or that holds a NaN gets NaN as its log_total (the caller takes torch's path
   for it). */
void rl_logprob_parts(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t top_n, float *log_total,
                      float *top_vals, int64_t *top_ids, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
#endif
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * ld;
        float m;
        if (top_n > 0) {
            /* The top-1 is the maximum (a NaN never enters the top-N; row_exp_sum finds it): one pass
               fewer over the row, the first of which reads it from memory. */
            row_top(row, n, top_n, top_vals + r * top_n, top_ids + r * top_n);
            m = top_vals[r * top_n];
        } else {
            m = row_max(row, n);
        }
        /* the thread's next row under the static schedule: the next one, where it is this thread's */
        const float *next = r + 1 < rows ? row + ld : NULL;
        log_total[r] = isfinite(m) ? m + (float)log(row_exp_sum(row, n, m, next)) : NAN;
    }
}
