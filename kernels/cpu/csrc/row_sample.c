/* One draw per float32 logit row at a temperature, with top_p, on the CPU (row_sample.py): the
   sampler's rule (worker/engine/sampler.py) without sorting the row. One thread per row, every pass
   over the row while it is in the cache.

   For a row x of n logits, temperature t, top_p p and a uniform u in [0, 1):
   1. z = x (1/t) (1/t rounded to float32, then an IEEE product, as the torch path's), m = max z,
      w = e^(z - m) (fixed_exp.h), S = sum of w (32 float lanes in order, reduced in double).
   2. top_p < 1: the smallest z kept is that of the last token, in descending order, whose preceding
      mass is below p S. The mass is gathered by z into buckets of 1/256 nat below m (the last bucket
      takes everything from 8 nats down, a second level below it), the bucket where the mass crosses
      p S is found, and only its tokens are sorted. A sample of the row first brackets the crossing,
      so that only the tokens of the bracket (or above it) are gathered, at a finer resolution
      (top_p_cutoff). Every token with z at least that cutoff is kept (ties with the last kept one
      included), as the torch path keeps them.
   3. The draw: the first id, in id order, whose cumulative kept weight exceeds u times the kept
      total (the mass at or above the cut as step 2 summed it; S where nothing is cut); the sums of
      blocks of 256 ids, from the first, find its block, a walk through the block finds the id.
      Where u times the total is not passed (rounding), the last kept id.
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
/* The 128 bytes (LANES floats, two cache lines) at p asked into the L2 cache. A row's first pass waits
   on memory for its logits; the pass of e^x is arithmetic: while a thread computes one row's e^x it
   asks for its next row, whose first pass then finds it in the cache. */
#define PREFETCH(p) (__builtin_prefetch((const char *)(p), 0, 2), __builtin_prefetch((const char *)(p) + 64, 0, 2))
#define BLOCK 256
/* The top_p cut's bracket (sampled_bracket, top_p_cutoff): runs of SAMPLE_RUN tokens every SAMPLE_EVERY place
   it, BRACKET_MARGIN of the sample's mass either side of the crossing, and the part of the row that holds
   the crossing is histogrammed at FINE_BUCKETS; rows shorter than BRACKET_MIN_TOKENS take the full
   histogram. */
#define SAMPLE_RUN 8
#define SAMPLE_EVERY 128
#define BRACKET_MARGIN 0.02
#define BRACKET_MIN_TOKENS 4096
#define FINE_BUCKETS 512

typedef struct {
    float z;
    float w;
} Entry;

/* z = x (1/t) into z, returns max z; *nan set where the row holds a NaN, *ninf where it holds a -inf (a
   masked id). */
static float scale_and_max(const float *x, int64_t n, float t, float *z, int *nan, int *ninf) {
    float m = -INFINITY;
    int bad = 0, low = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        const __m512 tv = _mm512_set1_ps(1.0f / t), ninfv = _mm512_set1_ps(-INFINITY);
        __m512 mv = ninfv, minv = _mm512_setzero_ps();
        __mmask16 badm = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), tv);
            _mm512_storeu_ps(z + i, v);
            badm |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            minv = _mm512_min_ps(minv, v);
            mv = _mm512_max_ps(mv, v);
        }
        float lanes[16];
        _mm512_storeu_ps(lanes, mv);
        for (int j = 0; j < 16; ++j) m = lanes[j] > m ? lanes[j] : m;
        bad = badm != 0;
        low = _mm512_cmp_ps_mask(minv, ninfv, _CMP_EQ_OQ) != 0;
    }
#elif defined(HAVE_AVX2_FMA)
    if (n >= 8) {
        const __m256 tv = _mm256_set1_ps(1.0f / t);
        const __m256 ninfv = _mm256_set1_ps(-INFINITY);
        __m256 mv = ninfv, badv = _mm256_setzero_ps(), minv = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), tv);
            _mm256_storeu_ps(z + i, v);
            badv = _mm256_or_ps(badv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            minv = _mm256_min_ps(minv, v);
            mv = _mm256_max_ps(mv, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
        bad = _mm256_movemask_ps(badv) != 0;
        low = _mm256_movemask_ps(_mm256_cmp_ps(minv, ninfv, _CMP_EQ_OQ)) != 0;
    }
#endif
    for (; i < n; ++i) {
        const float v = x[i] * (1.0f / t);
        z[i] = v;
        bad |= v != v;
        low |= v == -INFINITY;
        m = v > m ? v : m;
    }
    *nan = bad;
    *ninf = low;
    return m;
}

/* The level-0 bucket range [lo, hi] that likely holds the top_p crossing (top_p_cutoff), and, filled by
   fill_bracket's pass, the exact mass above it and the ids of the tokens inside it. A
   token's level-0 bucket is bucket_of's, trunc((m - z) 256) (offset 0 subtracts nothing): above the
   bracket exactly where (m - z) 256 < lo, inside it where that is not so and (m - z) 256 < hi + 1. */
typedef struct {
    int32_t lo, hi;
    double above;
    int32_t *ids; /* room for n + 16: eight or sixteen are stored at a time */
    int64_t count;
} Bracket;

#ifdef HAVE_AVX2_FMA
/* For each 8-bit mask, the lanes whose bit is set, in order (the rest 0): a permutation that packs
   them to the front, so the ids of a vector's candidates are stored without a branch per candidate. */
static int32_t pack_lanes[256][8];

__attribute__((constructor)) static void fill_pack_lanes(void) {
    for (int mask = 0; mask < 256; ++mask) {
        int k = 0;
        for (int j = 0; j < 8; ++j)
            if (mask & (1 << j)) pack_lanes[mask][k++] = j;
        for (; k < 8; ++k) pack_lanes[mask][k] = 0;
    }
}

/* Stores the ids i..i+7 whose bit of `bits` is set at out, packed; their count. */
static inline int64_t pack_ids(int32_t *out, int bits, int64_t i) {
    const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_storeu_si256((__m256i *)out,
                        _mm256_permutevar8x32_epi32(lanes, _mm256_loadu_si256((const __m256i *)pack_lanes[bits])));
    return __builtin_popcount((unsigned)bits);
}
#endif


/* w = e^(z - m) into w; returns their sum (the lanes as the header says). `masked`: the row holds a
   -inf logit (a masked id), which weighs exactly 0, not the clamped exp's e^-87; a row without one
   skips that test. `next` (or NULL): the logits of the row this thread takes next, asked into the
   cache meanwhile (PREFETCH). */
static double exp_and_sum(const float *z, int64_t n, float m, float *w, int masked, const float *next) {
    float acc[LANES];
    for (int j = 0; j < LANES; ++j) acc[j] = 0.0f;
    const int64_t full = n - n % LANES;
    int64_t i = 0;
#if defined(__AVX512F__)
    /* Two 16-lane accumulators: lane j of the 32 takes the same elements in the same order as the
       four 8-lane ones below, and e^x is the same in every lane, so the bits are the same. */
    const __m512 mv = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
    __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i < full; i += LANES) {
        if (next) PREFETCH(next + i);
        for (int q = 0; q < 2; ++q) {
            const __m512 zv = _mm512_loadu_ps(z + i + 16 * q);
            __m512 e = exp16_nonpositive(_mm512_sub_ps(zv, mv));
            if (masked) e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(zv, ninf, _CMP_NEQ_OQ), e);
            _mm512_storeu_ps(w + i + 16 * q, e);
            a[q] = _mm512_add_ps(a[q], e);
        }
    }
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(acc + 16 * q, a[q]);
#elif defined(HAVE_AVX2_FMA)
    const __m256 mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if (masked) {
        for (; i < full; i += LANES) {
            if (next) PREFETCH(next + i);
            for (int q = 0; q < 4; ++q) {
                const __m256 zv = _mm256_loadu_ps(z + i + 8 * q);
                const __m256 e = _mm256_and_ps(exp_vector_nonpositive(_mm256_sub_ps(zv, mv)), _mm256_cmp_ps(zv, ninf, _CMP_NEQ_OQ));
                _mm256_storeu_ps(w + i + 8 * q, e);
                a[q] = _mm256_add_ps(a[q], e);
            }
        }
    } else {
        for (; i < full; i += LANES) {
            if (next) PREFETCH(next + i);
            for (int q = 0; q < 4; ++q) {
                const __m256 e = exp_vector_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(z + i + 8 * q), mv));
                _mm256_storeu_ps(w + i + 8 * q, e);
                a[q] = _mm256_add_ps(a[q], e);
            }
        }
    }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(acc + 8 * q, a[q]);
#else
    (void)masked; /* the scalar code tests each logit */
    for (; i < full; i += LANES) {
        if (next) PREFETCH(next + i);
        for (int j = 0; j < LANES; ++j) {
            w[i + j] = z[i + j] == -INFINITY ? 0.0f : exp_scalar(z[i + j] - m);
            acc[j] += w[i + j];
        }
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

/* The sum of LANES float lanes of partial sums (four vectors of 8): the four added in float, pairwise,
   then their 8 lanes in double. A short chain: kept_sum runs it for every block of a row. */
static inline double lanes_total(const float *acc) {
    double s = 0.0;
    for (int j = 0; j < 8; ++j) s += (double)((acc[j] + acc[8 + j]) + (acc[16 + j] + acc[24 + j]));
    return s;
}

/* Fills the bracket's mass above it (LANES float lanes, in order, reduced by lanes_total: four chains
   of adds, not one that each vector waits on) and its ids: one pass. */
static void fill_bracket(const float *z, const float *w, int64_t n, float m, Bracket *br) {
    float acc_above[LANES] = {0};
    const float lo_f = (float)br->lo, end_f = (float)(br->hi + 1);
    int64_t i = 0, found = 0;
#if defined(__AVX512F__)
    /* As the AVX2 code below, 16 lanes at a time: the same 32 lanes of sums. The ids of the lanes in
       the bracket are packed by a compress in a register, then stored (16 at a time). */
    const __m512 mv = _mm512_set1_ps(m), lov = _mm512_set1_ps(lo_f / 256.0f), endv = _mm512_set1_ps(end_f / 256.0f);
    const __m512i lane_ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 above[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (; i + LANES <= n; i += LANES)
        for (int q = 0; q < 2; ++q) {
            const __m512 d = _mm512_sub_ps(mv, _mm512_loadu_ps(z + i + 16 * q));
            const __mmask16 is_above = _mm512_cmp_ps_mask(d, lov, _CMP_LT_OQ);
            const __mmask16 is_in = (__mmask16)(~is_above & _mm512_cmp_ps_mask(d, endv, _CMP_LT_OQ));
            above[q] = _mm512_add_ps(above[q], _mm512_maskz_mov_ps(is_above, _mm512_loadu_ps(w + i + 16 * q)));
            const __m512i here = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(i + 16 * q)), lane_ids);
            _mm512_storeu_si512(br->ids + found, _mm512_maskz_compress_epi32(is_in, here));
            found += __builtin_popcount((unsigned)is_in);
        }
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(acc_above + 16 * q, above[q]);
#elif defined(HAVE_AVX2_FMA)
    /* (m - z) 256 < lo exactly where m - z < lo / 256: the product by 256 and lo / 256 are exact */
    const __m256 mv = _mm256_set1_ps(m), lov = _mm256_set1_ps(lo_f / 256.0f), endv = _mm256_set1_ps(end_f / 256.0f);
    __m256 above[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + LANES <= n; i += LANES)
        for (int q = 0; q < 4; ++q) {
            const __m256 d = _mm256_sub_ps(mv, _mm256_loadu_ps(z + i + 8 * q));
            const __m256 e = _mm256_loadu_ps(w + i + 8 * q);
            const __m256 is_above = _mm256_cmp_ps(d, lov, _CMP_LT_OQ);
            const __m256 is_in = _mm256_andnot_ps(is_above, _mm256_cmp_ps(d, endv, _CMP_LT_OQ));
            above[q] = _mm256_add_ps(above[q], _mm256_and_ps(e, is_above));
            found += pack_ids(br->ids + found, _mm256_movemask_ps(is_in), i + 8 * q);
        }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(acc_above + 8 * q, above[q]);
#else
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            const float d = (m - z[i + j]) * 256.0f;
            if (d < lo_f)
                acc_above[j] += w[i + j];
            else if (d < end_f)
                br->ids[found++] = (int32_t)(i + j);
        }
#endif
    double s_above = lanes_total(acc_above);
    for (; i < n; ++i) {
        const float d = (m - z[i]) * 256.0f;
        if (d < lo_f)
            s_above += (double)w[i];
        else if (d < end_f)
            br->ids[found++] = (int32_t)i;
    }
    br->above = s_above;
    br->count = found;
}

/* The bucket of a token whose z is d = m - z nats below the maximum, at a level that starts `offset`
   nats down with `scale` buckets a nat; bucket `last` takes everything further down. */
static inline int32_t bucket_of(float z, float m, float offset, float scale, int32_t last) {
    const float d = (m - z - offset) * scale;
    return d < (float)last ? (int32_t)d : last;
}

static int by_z_descending(const void *a, const void *b) {
    const float za = ((const Entry *)a)->z, zb = ((const Entry *)b)->z;
    return za < zb ? 1 : za > zb ? -1 : 0;
}

/* One level of the search over `buckets` buckets (at most BUCKETS): the bucket of each candidate (ids,
   or every token where ids is NULL) into idx, their masses by bucket (four float histograms,
   candidate k into histogram k % 4, so tokens of one bucket close together do not wait on each other's
   store; merged in double in a fixed order), and the bucket where `before` plus the mass reaches
   target, `before` advanced past the buckets above it; -1 where the target is not reached. */
static int crossing_bucket(const float *z, const float *w, const int32_t *ids, int64_t count, float m, float offset,
                           float scale, int32_t buckets, double target, double *before, double *hist, int32_t *idx) {
    float *part = (float *)(hist + BUCKETS); /* 4 x BUCKETS floats after the BUCKETS doubles */
    const int32_t last = buckets - 1;
    int64_t k = 0;
#ifdef HAVE_AVX2_FMA
    if (ids == NULL) {
        const __m256 mv = _mm256_set1_ps(m), ov = _mm256_set1_ps(offset), sv = _mm256_set1_ps(scale),
                     lastv = _mm256_set1_ps((float)last);
        for (; k + 8 <= count; k += 8) {
            /* the scalar bucket_of's operations; -inf logits give +inf: the last bucket (their weight is 0) */
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_sub_ps(mv, _mm256_loadu_ps(z + k)), ov), sv);
            _mm256_storeu_si256((__m256i *)(idx + k), _mm256_cvttps_epi32(_mm256_min_ps(d, lastv)));
        }
    }
#endif
    for (; k < count; ++k) idx[k] = bucket_of(z[ids ? ids[k] : k], m, offset, scale, last);
    for (int h = 0; h < 4; ++h) memset(part + h * BUCKETS, 0, (size_t)buckets * sizeof(float));
    const int64_t full = count - count % 4;
    for (k = 0; k < full; k += 4)
        for (int h = 0; h < 4; ++h) part[h * BUCKETS + idx[k + h]] += w[ids ? ids[k + h] : k + h];
    for (; k < count; ++k) part[idx[k]] += w[ids ? ids[k] : k];
    for (int b = 0; b < buckets; ++b) {
        const double mass = (((double)part[b] + (double)part[BUCKETS + b]) + (double)part[2 * BUCKETS + b]) +
                            (double)part[3 * BUCKETS + b];
        if (*before + mass >= target) return b;
        *before += mass;
    }
    return -1;
}

/* The candidates (their positions k in idx's order) in bucket b into out, as token ids. */
static int64_t gather(const int32_t *ids, const int32_t *idx, int64_t count, int32_t b, int32_t *out) {
    int64_t found = 0;
    for (int64_t k = 0; k < count; ++k) {
        out[found] = ids ? ids[k] : (int32_t)k;
        found += idx[k] == b; /* no branch per candidate: a flat row's bucket is its tokens' coin toss */
    }
    return found;
}

/* The cut among the tokens ids[0..count-1] of the crossing bucket, `before` the mass above them: in
   descending z, the z of the last token whose preceding mass is below target. *kept: the mass of
   every token at or above the cut (the ties with it included), summed as found. */
static float cutoff_among(const float *z, const float *w, const int32_t *ids, int64_t count, double before,
                          double target, Entry *entries, double *kept) {
    for (int64_t k = 0; k < count; ++k) entries[k] = (Entry){z[ids[k]], w[ids[k]]};
    qsort(entries, (size_t)count, sizeof(Entry), by_z_descending);
    float cutoff = entries[0].z; /* the bucket's first token: its preceding mass is `before` < target */
    int64_t k = 0;
    for (; k < count; ++k) {
        if (!(before < target)) break;
        cutoff = entries[k].z;
        before += (double)entries[k].w;
    }
    for (; k < count && entries[k].z == cutoff; ++k) before += (double)entries[k].w; /* ties: kept too */
    *kept = before;
    return cutoff;
}

/* The smallest kept z under top_p by a histogram of every token, or -INFINITY where every token is
   kept. Level 0 covers 8 nats below the maximum at 256 buckets a nat; where the crossing lies further
   down (top_p close to 1), level 1 takes the tokens below, 8 to 72 nats down at 32 a nat. */
static float top_p_cutoff_full(const float *z, const float *w, int64_t n, float m, double target, double *hist,
                               int32_t *idx, int32_t *ids, Entry *entries, double *kept) {
    double before = 0.0;
    int32_t b = crossing_bucket(z, w, NULL, n, m, 0.0f, 256.0f, BUCKETS, target, &before, hist, idx);
    if (b < 0) return -INFINITY; /* p S not reached (p rounds to 1): keep all */
    int64_t count = gather(NULL, idx, n, b, ids);
    if (b == BUCKETS - 1) {
        const double at = before;
        const int32_t b1 = crossing_bucket(z, w, ids, count, m, 8.0f, 32.0f, BUCKETS, target, &before, hist, idx);
        if (b1 < 0) return -INFINITY;
        if (b1 < BUCKETS - 1) {
            count = gather(ids, idx, count, b1, ids); /* in place: out never runs ahead of the reads */
        } else {
            before = at; /* beyond 72 nats: sort every token of level 0's last bucket (never met in practice) */
        }
    }
    return cutoff_among(z, w, ids, count, before, target, entries, kept);
}

/* The level-0 buckets [*lo, *hi] where the mass of a sample of the row, from the top, crosses the
   fraction p of the sample's, BRACKET_MARGIN of it either side. The sample: SAMPLE_RUN consecutive
   tokens every SAMPLE_EVERY (token ids carry no order of logits), weighed with the same e^x. Its
   weights and buckets go to sample_w and sample_b (room for sample_size(n)) and are added into the
   histogram (floats: the bracket is an estimate) after the pass: a scalar load of a lane just
   stored as a vector waits for the store, which cost a quarter of this function. */
static void sampled_bracket(const float *z, int64_t n, float m, double p, float *hist, float *sample_w,
                            int32_t *sample_b, int32_t *lo, int32_t *hi) {
    memset(hist, 0, BUCKETS * sizeof(float));
    float lanes[SAMPLE_RUN] = {0};
    int64_t count = 0;
#ifdef HAVE_AVX2_FMA
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
#endif
    for (int64_t k = 0; k + SAMPLE_RUN <= n; k += SAMPLE_EVERY, count += SAMPLE_RUN) {
#ifdef HAVE_AVX2_FMA
        const __m256 zv = _mm256_loadu_ps(z + k);
        const __m256 e = _mm256_and_ps(exp_vector_nonpositive(_mm256_sub_ps(zv, mv)),
                                       _mm256_cmp_ps(zv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
        _mm256_storeu_ps(sample_w + count, e);
        acc = _mm256_add_ps(acc, e);
        /* bucket_of's operations at level 0 (-inf: +inf, the last bucket) */
        _mm256_storeu_si256((__m256i *)(sample_b + count), _mm256_cvttps_epi32(_mm256_min_ps(
            _mm256_mul_ps(_mm256_sub_ps(mv, zv), _mm256_set1_ps(256.0f)), _mm256_set1_ps((float)(BUCKETS - 1)))));
#else
        for (int j = 0; j < SAMPLE_RUN; ++j) {
            sample_w[count + j] = z[k + j] == -INFINITY ? 0.0f : exp_scalar(z[k + j] - m);
            sample_b[count + j] = bucket_of(z[k + j], m, 0.0f, 256.0f, BUCKETS - 1);
            lanes[j] += sample_w[count + j];
        }
#endif
    }
#ifdef HAVE_AVX2_FMA
    _mm256_storeu_ps(lanes, acc);
#endif
    for (int64_t c = 0; c < count; ++c) hist[sample_b[c]] += sample_w[c];
    double sampled = 0.0;
    for (int j = 0; j < SAMPLE_RUN; ++j) sampled += (double)lanes[j];
    const double from = (p - BRACKET_MARGIN) * sampled, to = (p + BRACKET_MARGIN) * sampled;
    double mass = 0.0;
    int32_t b = 0;
    for (; b < BUCKETS - 1; ++b) { /* the first bucket whose mass, with the ones above, reaches `from` */
        mass += (double)hist[b];
        if (mass >= from) break;
    }
    *lo = b;
    while (b < BUCKETS - 1 && mass < to) mass += (double)hist[++b];
    *hi = b;
}

/* Room sampled_bracket needs for the sample of a row of n tokens. */
static int64_t sample_size(int64_t n) { return (n / SAMPLE_EVERY + 1) * SAMPLE_RUN; }

/* The ids, in order, of the tokens in level-0 buckets [lo, hi] into out (room for n + 8: eight are
   stored at a time); their count. */
static int64_t gather_range(const float *z, int64_t n, float m, int32_t lo, int32_t hi, int32_t *out) {
    const float lo_f = (float)lo, end_f = (float)(hi + 1);
    int64_t found = 0, i = 0;
#ifdef HAVE_AVX2_FMA
    const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(256.0f), lov = _mm256_set1_ps(lo_f),
                 endv = _mm256_set1_ps(end_f);
    for (; i + 8 <= n; i += 8) {
        const __m256 d = _mm256_mul_ps(_mm256_sub_ps(mv, _mm256_loadu_ps(z + i)), sv);
        found += pack_ids(out + found, _mm256_movemask_ps(_mm256_andnot_ps(_mm256_cmp_ps(d, lov, _CMP_LT_OQ),
                                                                           _mm256_cmp_ps(d, endv, _CMP_LT_OQ))), i);
    }
#endif
    for (; i < n; ++i) {
        const float d = (m - z[i]) * 256.0f;
        if (!(d < lo_f) && d < end_f) out[found++] = (int32_t)i;
    }
    return found;
}

/* The smallest kept z under top_p (see the header), or -INFINITY where every token is kept.

   A histogram of every token costs a scattered add per token, most of a flat row's draw. So where
   fill_bracket's pass filled a bracket (br), the histogram takes only the tokens of the part of the row
   that holds the crossing: the bracket (a few % of a flat row's tokens), or, where the sample missed
   the few heavy tokens of a peaked row, the tokens above it; at FINE_BUCKETS over that part, so the
   bucket that is sorted holds a few tokens. Where the crossing lies below the bracket, or rounding
   leaves the part's histogram short of the target, the full histogram decides. Every choice is made
   from the row alone, so the draw still depends on the row, its uniform and its settings alone. */
static float top_p_cutoff(const float *z, const float *w, int64_t n, float m, double target, Bracket *br,
                          double *hist, int32_t *idx, int32_t *ids, Entry *entries, double *kept) {
    if (br) {
        int32_t from = -1, to = -1;
        double before = 0.0;
        int64_t count = 0;
        if (br->above < target) { /* in the bracket, or below it: then its histogram falls short */
            from = br->lo, to = br->hi, before = br->above, count = br->count;
            if (br->ids != ids) memcpy(ids, br->ids, (size_t)count * sizeof(int32_t));
        } else if (br->above >= target && br->lo > 0) {
            from = 0, to = br->lo - 1; /* the crossing lies above the bracket */
            count = gather_range(z, n, m, from, to, ids);
        }
        if (from >= 0 && count > 0) {
            const int32_t span = to - from + 1, per = FINE_BUCKETS / span > 0 ? FINE_BUCKETS / span : 1;
            const int32_t buckets = span * per < BUCKETS ? span * per : BUCKETS;
            const int32_t b = crossing_bucket(z, w, ids, count, m, (float)from / 256.0f, 256.0f * (float)per,
                                              buckets, target, &before, hist, idx);
            if (b >= 0) {
                count = gather(ids, idx, count, b, ids); /* in place, as in the full search */
                if (count > 0) return cutoff_among(z, w, ids, count, before, target, entries, kept);
            }
        }
    }
    return top_p_cutoff_full(z, w, n, m, target, hist, idx, ids, entries, kept);
}

/* The kept weight of ids [begin, end): w where z >= cutoff, summed in LANES float lanes in order (four
   chains of adds), reduced by lanes_total. */
static double kept_sum(const float *z, const float *w, int64_t begin, int64_t end, float cutoff) {
    float acc[LANES] = {0};
    int64_t i = begin;
#if defined(__AVX512F__)
    __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512 cv = _mm512_set1_ps(cutoff);
    for (; i + LANES <= end; i += LANES)
        for (int q = 0; q < 2; ++q)
            a[q] = _mm512_add_ps(a[q], _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_loadu_ps(z + i + 16 * q), cv, _CMP_GE_OQ),
                                                           _mm512_loadu_ps(w + i + 16 * q)));
    for (int q = 0; q < 2; ++q) _mm512_storeu_ps(acc + 16 * q, a[q]);
#elif defined(HAVE_AVX2_FMA)
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 cv = _mm256_set1_ps(cutoff);
    for (; i + LANES <= end; i += LANES)
        for (int q = 0; q < 4; ++q)
            a[q] = _mm256_add_ps(a[q], _mm256_and_ps(_mm256_loadu_ps(w + i + 8 * q),
                                                     _mm256_cmp_ps(_mm256_loadu_ps(z + i + 8 * q), cv, _CMP_GE_OQ)));
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(acc + 8 * q, a[q]);
#else
    for (; i + LANES <= end; i += LANES)
        for (int j = 0; j < LANES; ++j) acc[j] += z[i + j] >= cutoff ? w[i + j] : 0.0f;
#endif
    double s = lanes_total(acc);
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
   never drawn), whose mass is `kept` (the cut's search summed it): the blocks are summed from the
   first until the target is passed, so a draw reads about u of the row, not all of it twice. */
static int64_t draw(const float *z, const float *w, int64_t n, float cutoff, double u, double kept) {
    const double target = u * kept;
    double before = 0.0;
    for (int64_t begin = 0; begin < n; begin += BLOCK) {
        const int64_t end = begin + BLOCK < n ? begin + BLOCK : n;
        const double block = kept_sum(z, w, begin, end, cutoff);
        if (before + block > target) {
            for (int64_t i = begin; i < end; ++i) {
                if (z[i] >= cutoff && w[i] > 0.0f) {
                    before += (double)w[i];
                    if (before > target) return i;
                }
            }
            /* The block's sum crossed, its walk (summed per id) rounded short: its last kept id. */
            return last_kept_in(z, w, begin, end, cutoff);
        }
        before += block;
    }
    /* u times the kept mass rounded to the blocks' total (or, summed in another order, past it): the
       last kept id, as the torch path takes where u times the total rounds to the total. */
    for (int64_t begin = (n - 1) / BLOCK * BLOCK; begin >= 0; begin -= BLOCK) {
        const int64_t id = last_kept_in(z, w, begin, begin + BLOCK < n ? begin + BLOCK : n, cutoff);
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
        int32_t *ids = malloc((size_t)(n + 16) * sizeof(int32_t)); /* written 8 or 16 at a time */
        float *sample_w = malloc((size_t)sample_size(n) * sizeof(float));
        int32_t *sample_b = malloc((size_t)sample_size(n) * sizeof(int32_t));
        const int ok = z && w && hist && entries && idx && ids && sample_w && sample_b;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < count; ++r) {
            out_ids[r] = -1;
            if (!ok) continue;
            int nan = 0, masked = 0;
            const float m = scale_and_max(x + rows_idx[r] * ld, n, temps[r], z, &nan, &masked);
            if (nan || !isfinite(m)) continue;
            /* A bracket for the top_p cut, from a sample of the row, filled after the pass of e^x. */
            Bracket bracket = {.lo = 0, .hi = BUCKETS - 1, .above = 0.0, .ids = ids, .count = 0};
            const int use_bracket = top_ps[r] < 1.0f && n >= BRACKET_MIN_TOKENS;
            if (use_bracket)
                sampled_bracket(z, n, m, (double)top_ps[r], (float *)hist, sample_w, sample_b, &bracket.lo, &bracket.hi);
            Bracket *br = use_bracket && bracket.hi < BUCKETS - 1 ? &bracket : NULL;
            /* the thread's next row under the static schedule: the next one, where it is this thread's */
            const float *next = r + 1 < count ? x + rows_idx[r + 1] * ld : NULL;
            const double total = exp_and_sum(z, n, m, w, masked, next);
            if (br) fill_bracket(z, w, n, m, br);
            float cutoff = -INFINITY;
            double kept = total; /* every token, unless top_p cuts */
            if (top_ps[r] < 1.0f)
                cutoff = top_p_cutoff(z, w, n, m, (double)top_ps[r] * total, br, hist, idx, ids, entries, &kept);
            out_ids[r] = draw(z, w, n, cutoff, uniforms[r], kept);
        }
        free(z);
        free(w);
        free(hist);
        free(entries);
        free(idx);
        free(ids);
        free(sample_w);
        free(sample_b);
    }
}
