/* One draw per float32 logit row at a temperature, with top_p, on the CPU (row_sample.py): the
   sampler's rule (worker/engine/sampler.py) without sorting the row. One thread per row, every pass
   over the row while it is in the cache.

   For a row x of n logits, temperature t, top_p p and a uniform u in [0, 1):
   1. z = x / t (IEEE division, as torch's), m = max z, w = e^(z - m) (fixed_exp.h), S = sum of w
      (32 float lanes in order, reduced in double).
   2. top_p < 1: the smallest z kept is that of the last token, in descending order, whose preceding
      mass is below p S. The mass is gathered by z into buckets of 1/256 nat below m (the last bucket
      takes everything from 32 nats down), the bucket where the mass crosses p S is found, and only
      its tokens are sorted. Every token with z at least that cutoff is kept (ties with the last kept
      one included), as the torch path keeps them.
   3. The draw: the first id, in id order, whose cumulative kept weight exceeds u times the kept
      total; the sums of blocks of 256 ids find its block, a walk through the block finds the id.
      Where u times the total rounds to the total, the last kept id.
   Masses are summed in double in a fixed order, so a row's draw depends on that row, its u and its
   settings alone. A row whose maximum is not finite or that holds a NaN gets -1 (the caller draws it
   with torch). */
#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
#define BUCKETS 2048
#define BLOCK 256

typedef struct {
    float z;
    float w;
} Entry;

/* z = x / t into z, returns max z; *nan set where the row holds a NaN. */
static float scale_and_max(const float *x, int64_t n, float t, float *z, int *nan) {
    float m = -INFINITY;
    int bad = 0;
    int64_t i = 0;
#ifdef HAVE_AVX2_FMA
    if (n >= 8) {
        const __m256 tv = _mm256_set1_ps(t);
        __m256 mv = _mm256_set1_ps(-INFINITY), badv = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
            _mm256_storeu_ps(z + i, v);
            badv = _mm256_or_ps(badv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mv = _mm256_max_ps(mv, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
        bad = _mm256_movemask_ps(badv) != 0;
    }
#endif
    for (; i < n; ++i) {
        const float v = x[i] / t;
        z[i] = v;
        bad |= v != v;
        m = v > m ? v : m;
    }
    *nan = bad;
    return m;
}

/* w = e^(z - m) into w; returns their sum (the lanes as the header says). */
static double exp_and_sum(const float *z, int64_t n, float m, float *w) {
    float acc[LANES];
    for (int j = 0; j < LANES; ++j) acc[j] = 0.0f;
    const int64_t full = n - n % LANES;
    int64_t i = 0;
#ifdef HAVE_AVX2_FMA
    const __m256 mv = _mm256_set1_ps(m);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i < full; i += LANES) {
        for (int q = 0; q < 4; ++q) {
            const __m256 zv = _mm256_loadu_ps(z + i + 8 * q);
            /* a -inf logit (masked) weighs exactly 0, not the clamped exp's e^-87 */
            const __m256 e = _mm256_and_ps(exp_vector(_mm256_sub_ps(zv, mv)),
                                           _mm256_cmp_ps(zv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
            _mm256_storeu_ps(w + i + 8 * q, e);
            a[q] = _mm256_add_ps(a[q], e);
        }
    }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(acc + 8 * q, a[q]);
#else
    for (; i < full; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            w[i + j] = z[i + j] == -INFINITY ? 0.0f : exp_scalar(z[i + j] - m);
            acc[j] += w[i + j];
        }
#endif
    float tail = 0.0f;
    for (i = full; i < n; ++i) {
        w[i] = z[i] == -INFINITY ? 0.0f : exp_scalar(z[i] - m);
        tail += w[i];
    }
    double total = 0.0;
    for (int j = 0; j < LANES; ++j) total += (double)acc[j];
    return total + (double)tail;
}

/* The bucket of a token whose z is d = m - z nats below the maximum, at a level that starts `offset`
   nats down with `scale` buckets a nat; the last bucket takes everything further down. */
static inline int32_t bucket_of(float z, float m, float offset, float scale) {
    const float d = (m - z - offset) * scale;
    return d < (float)(BUCKETS - 1) ? (int32_t)d : BUCKETS - 1;
}

static int by_z_descending(const void *a, const void *b) {
    const float za = ((const Entry *)a)->z, zb = ((const Entry *)b)->z;
    return za < zb ? 1 : za > zb ? -1 : 0;
}

/* One level of the search: the bucket of each candidate (ids, or every token where ids is NULL) into
   idx, their masses by bucket (four float histograms, candidate k into histogram k % 4, so tokens of
   one bucket close together do not wait on each other's store; merged in double in a fixed order),
   and the bucket where `before` plus the mass reaches target, `before` advanced past the buckets
   above it; -1 where the target is not reached. */
static int crossing_bucket(const float *z, const float *w, const int32_t *ids, int64_t count, float m, float offset,
                           float scale, double target, double *before, double *hist, int32_t *idx) {
    float *part = (float *)(hist + BUCKETS); /* 4 x BUCKETS floats after the BUCKETS doubles */
    int64_t k = 0;
#ifdef HAVE_AVX2_FMA
    if (ids == NULL) {
        const __m256 mv = _mm256_set1_ps(m), ov = _mm256_set1_ps(offset), sv = _mm256_set1_ps(scale),
                     last = _mm256_set1_ps((float)(BUCKETS - 1));
        for (; k + 8 <= count; k += 8) {
            /* the scalar bucket_of's operations; -inf logits give +inf: the last bucket (their weight is 0) */
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_sub_ps(mv, _mm256_loadu_ps(z + k)), ov), sv);
            _mm256_storeu_si256((__m256i *)(idx + k), _mm256_cvttps_epi32(_mm256_min_ps(d, last)));
        }
    }
#endif
    for (; k < count; ++k) idx[k] = bucket_of(z[ids ? ids[k] : k], m, offset, scale);
    memset(part, 0, 4 * BUCKETS * sizeof(float));
    const int64_t full = count - count % 4;
    for (k = 0; k < full; k += 4)
        for (int h = 0; h < 4; ++h) part[h * BUCKETS + idx[k + h]] += w[ids ? ids[k + h] : k + h];
    for (; k < count; ++k) part[idx[k]] += w[ids ? ids[k] : k];
    for (int b = 0; b < BUCKETS; ++b) {
        const double mass = (((double)part[b] + (double)part[BUCKETS + b]) + (double)part[2 * BUCKETS + b]) +
                            (double)part[3 * BUCKETS + b];
        if (*before + mass >= target) return b;
        *before += mass;
    }
    return -1;
}

/* The candidates (their positions k in idx's order) in bucket b into out, as token ids. */
static int64_t gather(const int32_t *ids, const int32_t *idx, int64_t count, int32_t b, int32_t *out) {
    int64_t found = 0, k = 0;
#ifdef HAVE_AVX2_FMA
    const __m256i bv = _mm256_set1_epi32(b);
    for (; k + 8 <= count; k += 8) {
        int bits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(idx + k)), bv)));
        while (bits) {
            const int j = __builtin_ctz(bits);
            out[found++] = ids ? ids[k + j] : (int32_t)(k + j);
            bits &= bits - 1;
        }
    }
#endif
    for (; k < count; ++k)
        if (idx[k] == b) out[found++] = ids ? ids[k] : (int32_t)k;
    return found;
}

/* The smallest kept z under top_p (see the header), or -INFINITY where every token is kept. Level 0
   covers 8 nats below the maximum at 256 buckets a nat; where the crossing lies further down (top_p
   close to 1), level 1 takes the tokens below, 8 to 72 nats down at 32 a nat. */
static float top_p_cutoff(const float *z, const float *w, int64_t n, float m, double target, double *hist,
                          int32_t *idx, int32_t *ids, Entry *entries) {
    double before = 0.0;
    int32_t b = crossing_bucket(z, w, NULL, n, m, 0.0f, 256.0f, target, &before, hist, idx);
    if (b < 0) return -INFINITY; /* p S not reached (p rounds to 1): keep all */
    int64_t count = gather(NULL, idx, n, b, ids);
    if (b == BUCKETS - 1) {
        const double at = before;
        const int32_t b1 = crossing_bucket(z, w, ids, count, m, 8.0f, 32.0f, target, &before, hist, idx);
        if (b1 < 0) return -INFINITY;
        if (b1 < BUCKETS - 1) {
            count = gather(ids, idx, count, b1, ids); /* in place: out never runs ahead of the reads */
        } else {
            before = at; /* beyond 72 nats: sort every token of level 0's last bucket (never met in practice) */
        }
    }
    for (int64_t k = 0; k < count; ++k) entries[k] = (Entry){z[ids[k]], w[ids[k]]};
    qsort(entries, (size_t)count, sizeof(Entry), by_z_descending);
    float cutoff = entries[0].z; /* the bucket's first token: its preceding mass is `before` < target */
    for (int64_t k = 0; k < count; ++k) {
        if (!(before < target)) break;
        cutoff = entries[k].z;
        before += (double)entries[k].w;
    }
    return cutoff;
}

/* The kept weight of ids [begin, end): w where z >= cutoff, summed in 8 float lanes in order. */
static double kept_sum(const float *z, const float *w, int64_t begin, int64_t end, float cutoff) {
    float acc[8] = {0};
    int64_t i = begin;
#ifdef HAVE_AVX2_FMA
    __m256 a = _mm256_setzero_ps();
    const __m256 cv = _mm256_set1_ps(cutoff);
    for (; i + 8 <= end; i += 8)
        a = _mm256_add_ps(a, _mm256_and_ps(_mm256_loadu_ps(w + i), _mm256_cmp_ps(_mm256_loadu_ps(z + i), cv, _CMP_GE_OQ)));
    _mm256_storeu_ps(acc, a);
#else
    for (; i + 8 <= end; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += z[i + j] >= cutoff ? w[i + j] : 0.0f;
#endif
    double s = 0.0;
    for (int j = 0; j < 8; ++j) s += (double)acc[j];
    for (; i < end; ++i) s += z[i] >= cutoff ? (double)w[i] : 0.0;
    return s;
}

/* The last id of [begin, end) with weight that is kept, or -1. */
static int64_t last_kept_in(const float *z, const float *w, int64_t begin, int64_t end, float cutoff) {
    for (int64_t i = end - 1; i >= begin; --i)
        if (z[i] >= cutoff && w[i] > 0.0f) return i;
    return -1;
}

/* The draw of step 3 among the tokens with z >= cutoff (a kept token of weight 0, a masked one, is
   never drawn). */
static int64_t draw(const float *z, const float *w, int64_t n, float cutoff, double u, double *block_sums) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t k = 0; k < blocks; ++k) {
        const int64_t end = (k + 1) * BLOCK < n ? (k + 1) * BLOCK : n;
        block_sums[k] = kept_sum(z, w, k * BLOCK, end, cutoff);
        total += block_sums[k];
    }
    const double target = u * total;
    double before = 0.0;
    for (int64_t k = 0; k < blocks; ++k) {
        if (before + block_sums[k] > target) {
            const int64_t end = (k + 1) * BLOCK < n ? (k + 1) * BLOCK : n;
            for (int64_t i = k * BLOCK; i < end; ++i) {
                if (z[i] >= cutoff && w[i] > 0.0f) {
                    before += (double)w[i];
                    if (before > target) return i;
                }
            }
            /* The block's sum crossed, its walk (summed per id) rounded short: its last kept id. */
            return last_kept_in(z, w, k * BLOCK, end, cutoff);
        }
        before += block_sums[k];
    }
    /* u times the total rounded to the total: the last kept id, as the torch path takes. */
    for (int64_t k = blocks - 1; k >= 0; --k) {
        const int64_t end = (k + 1) * BLOCK < n ? (k + 1) * BLOCK : n;
        const int64_t id = last_kept_in(z, w, k * BLOCK, end, cutoff);
        if (id >= 0) return id;
    }
    return -1;
}

/* For rows rows_idx[0..count-1] of x (row stride ld, vocab n): out_ids[r] = the draw of that row at
   temps[r], top_ps[r] and uniforms[r], or -1 where the row is not finite (see the header). */
void rs_sample_rows(const float *x, int64_t ld, const int64_t *rows_idx, int64_t count, int64_t n, const float *temps,
                    const float *top_ps, const double *uniforms, int64_t *out_ids, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1 && count > 1)
#endif
    {
        float *z = malloc((size_t)n * sizeof(float));
        float *w = malloc((size_t)n * sizeof(float));
        double *hist = malloc(3 * BUCKETS * sizeof(double)); /* BUCKETS doubles, then 4 x BUCKETS floats */
        Entry *entries = malloc((size_t)n * sizeof(Entry));
        int32_t *idx = malloc((size_t)n * sizeof(int32_t));
        int32_t *ids = malloc((size_t)n * sizeof(int32_t));
        double *block_sums = malloc((size_t)((n + BLOCK - 1) / BLOCK) * sizeof(double));
        const int ok = z && w && hist && entries && idx && ids && block_sums;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < count; ++r) {
            out_ids[r] = -1;
            if (!ok) continue;
            int nan = 0;
            const float m = scale_and_max(x + rows_idx[r] * ld, n, temps[r], z, &nan);
            if (nan || !isfinite(m)) continue;
            const double total = exp_and_sum(z, n, m, w);
            float cutoff = -INFINITY;
            if (top_ps[r] < 1.0f) cutoff = top_p_cutoff(z, w, n, m, (double)top_ps[r] * total, hist, idx, ids, entries);
            out_ids[r] = draw(z, w, n, cutoff, uniforms[r], block_sums);
        }
        free(z);
        free(w);
        free(hist);
        free(entries);
        free(idx);
        free(ids);
        free(block_sums);
    }
}
