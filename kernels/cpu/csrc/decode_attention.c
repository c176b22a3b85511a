/* Decode attention on the CPU, read straight from the paged KV cache, float32 (decode_attention.py). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
/* Every prefetch of K and V asks for the line in L2, not L1 (prefetcht1, locality 2). Why: a block
   is ~200 cache lines, and prefetches aimed at L1 hold the core's few L1 miss buffers until the line
   arrives, so the dot products' own loads queued behind them; aimed at L2 they use L2's deeper miss
   queue and the loads then hit L2. Measured on SmolLM2's shapes (9 query / 3 kv heads, 256 rows of
   150-450 keys, blocks scattered over a cache 8x the rows' size): 14.5 -> 8.2 ms on one thread,
   7.6 -> 5.0 ms on two; tiny-llama's shapes 9.0 -> 4.5 ms on one thread. */
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

/* Dot product with 8 independent partial sums, so the compiler keeps them in one vector register and
   fuses multiply-add; the remainder (D not a multiple of 8) is summed last. */
static inline float dot_f32(const float *a, const float *b, int64_t D) {
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; ++l) part[l] += a[d + l] * b[d + l];
    float tail = 0.f;
    for (; d < D; ++d) tail += a[d] * b[d];
    return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) + tail;
}

#ifdef HAVE_AVX2
/* out[i] = scale * q . k_i for 8 keys k_i = k + i * k_stride (D a multiple of 8).
   Why not 8 calls of dot_f32: one dot of D = 64 is a chain of 8 dependent FMAs plus a horizontal sum,
   so the FMA units mostly wait. Here the d loop is outside the key loop: each q vector is loaded once
   and feeds 8 independent accumulators (one per key), and the 8 horizontal sums share one hadd tree.
   Not inlined: inside the row loop the eight key pointers did not fit the general registers, and the
   compiler parked them in vector registers, moving each back before its load (SmolLM2's shapes, K/V
   resident in L2, one thread: 4.9 -> 3.9 ms). */
__attribute__((noinline)) static void dot8_keys(const float *q, const float *k, int64_t k_stride, int64_t D, float scale, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + k_stride + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * k_stride + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * k_stride + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * k_stride + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * k_stride + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * k_stride + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * k_stride + d), a7);
    }
    /* hadd tree: lane i of the result is the full sum of accumulator i */
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

/* acc[0..63] += sum_t w[t] * v_t[0..63], v_t = v + t * v_stride. The 64 accumulators stay in 8
   registers over all cnt keys (8 independent FMA chains) instead of a load/store of acc per key. */
static inline void weighted_sum64(const float *w, const float *v, int64_t v_stride, int64_t cnt, float *acc) {
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8), a2 = _mm256_loadu_ps(acc + 16);
    __m256 a3 = _mm256_loadu_ps(acc + 24), a4 = _mm256_loadu_ps(acc + 32), a5 = _mm256_loadu_ps(acc + 40);
    __m256 a6 = _mm256_loadu_ps(acc + 48), a7 = _mm256_loadu_ps(acc + 56);
    for (int64_t t = 0; t < cnt; ++t) {
        const __m256 wt = _mm256_broadcast_ss(w + t);
        const float *vt = v + t * v_stride;
        a0 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt), a0);
        a1 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 8), a1);
        a2 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 16), a2);
        a3 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 24), a3);
        a4 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 32), a4);
        a5 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 40), a5);
        a6 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 48), a6);
        a7 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 56), a7);
    }
    _mm256_storeu_ps(acc, a0); _mm256_storeu_ps(acc + 8, a1); _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3); _mm256_storeu_ps(acc + 32, a4); _mm256_storeu_ps(acc + 40, a5);
    _mm256_storeu_ps(acc + 48, a6); _mm256_storeu_ps(acc + 56, a7);
}

/* e^x for x <= 0 (softmax inputs after subtracting the maximum), 8 lanes at a time: Cephes' expf
   (range reduction by ln 2 in two parts, degree-5 polynomial, scale by 2^n), within ~2 ulp of expf.
   Why: the scalar libm call per score was most of this kernel's time once the dot products were
   vectorised (a decode step takes H x L exponentials per row). Inputs below -87 give ~1e-38 instead of
   an underflowing tiny value, which no softmax sum can notice. */
static inline __m256 exp_nonpos_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s[0..L-1] = softmax(s), vectorised (the scalar loops do not vectorise without -ffast-math). */
static inline void softmax_row(float *s, int64_t L) {
    int64_t p = 0;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; p + 8 <= L; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + p));
    float m = hmax_ps(mv);
    for (; p < L; ++p) m = s[p] > m ? s[p] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (p = 0; p + 8 <= L; p += 8) {
        const __m256 e = exp_nonpos_ps(_mm256_sub_ps(_mm256_loadu_ps(s + p), mb));
        _mm256_storeu_ps(s + p, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum_ps(sv);
    for (; p < L; ++p) { s[p] = expf(s[p] - m); sum += s[p]; }
    const float inv = 1.f / sum;
    const __m256 iv = _mm256_set1_ps(inv);
    for (p = 0; p + 8 <= L; p += 8) _mm256_storeu_ps(s + p, _mm256_mul_ps(_mm256_loadu_ps(s + p), iv));
    for (; p < L; ++p) s[p] *= inv;
}
#endif

typedef struct {
    const float *query; int64_t q_stride;
    const float *key_cache, *value_cache;
    const int32_t *block_tables; int64_t table_stride;
    const int64_t *token_index, *table_row; const int32_t *seq_lens;
    float *out; int64_t out_stride;
    int64_t H, Hkv, D, bs, max_len; float scale;
    int64_t begin, end; /* rows of this worker */
    int status;
} job_t;

/* Decode rows begin..end-1: one query token each. Row r (token tok = token_index[r], length
   L = seq_lens[r]) attends over keys 0 .. L-1, found through block_tables[table_row[r]]: position p
   lives in block table[p / bs] at offset p % bs. Query head j uses kv head j / G (G = H / Hkv).
   Cache layout [num_blocks, bs, Hkv, D]: each block is read front to back (all kv heads of a token
   together), and the next block is prefetched, so memory streams although blocks are scattered. */
static void *decode_rows(void *arg) {
    job_t *a = (job_t *)arg;
    const int64_t H = a->H, D = a->D, bs = a->bs, max_len = a->max_len;
    const int64_t G = H / a->Hkv, token_stride = a->Hkv * D;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(H * max_len + H * D));
    if (!scores) { a->status = -1; return 0; }
    float *acc = scores + H * max_len;
    for (int64_t r = a->begin; r < a->end; ++r) {
        const int64_t L = a->seq_lens[r];
        const int32_t *table = a->block_tables + a->table_row[r] * a->table_stride;
        const float *q = a->query + a->token_index[r] * a->q_stride;
        float *o = a->out + a->token_index[r] * a->out_stride;
        /* Prefetching, measured on blocks scattered over a cache far bigger than the CPU caches
           (~25% faster than prefetching each next block in one burst): the next row's first K and V
           blocks a whole row ahead; within a pass, the next block spread over the pieces of work on
           this one (a burst of 128 line prefetches fills the core's miss buffers and stalls it; with
           the prefetches aimed at L2 a burst per block is still 1.4x slower than spreading them). */
        if (r + 1 < a->end) {
            const int32_t *nt = a->block_tables + a->table_row[r + 1] * a->table_stride;
            const float *nk = a->key_cache + (int64_t)nt[0] * bs * token_stride;
            const float *nv = a->value_cache + (int64_t)nt[0] * bs * token_stride;
            for (int64_t l = 0; l < bs * token_stride; l += 16) { PREFETCH_L2(nk + l); PREFETCH_L2(nv + l); }
        }
        /* scores[j][p] = scale * q_j . k_p (kv head of j) */
        for (int64_t p0 = 0; p0 < L; p0 += bs) {
            const float *kb = a->key_cache + (int64_t)table[p0 / bs] * bs * token_stride;
            const int64_t cnt = (L - p0) < bs ? (L - p0) : bs;
            const float *next = p0 + bs < L ? a->key_cache + (int64_t)table[p0 / bs + 1] * bs * token_stride : 0;
            const int64_t pf_n = cnt * token_stride;
            int64_t pf_at = 0;
            int64_t t = 0;
#ifdef HAVE_AVX2
            const int64_t pieces = cnt / 8 * H > 0 ? cnt / 8 * H : 1, pf_step = (pf_n + pieces - 1) / pieces;
            if (D % 8 == 0)
                for (; t + 8 <= cnt; t += 8)
                    for (int64_t j = 0; j < H; ++j, pf_at += pf_step) {
                        if (next)
                            for (int64_t l = pf_at; l < pf_at + pf_step && l < pf_n; l += 16) PREFETCH_L2(next + l);
                        dot8_keys(q + j * D, kb + t * token_stride + (j / G) * D, token_stride, D, a->scale,
                                  scores + j * max_len + p0 + t);
                    }
#endif
            if (next && pf_at < pf_n) /* short block, or no vector path: the rest in one go */
                for (int64_t l = pf_at; l < pf_n; l += 16) PREFETCH_L2(next + l);
            for (; t < cnt; ++t)
                for (int64_t j = 0; j < H; ++j)
                    scores[j * max_len + p0 + t] = dot_f32(q + j * D, kb + t * token_stride + (j / G) * D, D) * a->scale;
        }
        {   /* this row's first V block, while the softmax runs */
            const float *v0 = a->value_cache + (int64_t)table[0] * bs * token_stride;
            for (int64_t l = 0; l < (L < bs ? L : bs) * token_stride; l += 16) PREFETCH_L2(v0 + l);
        }
        /* softmax per query head, 1/sum folded into the weights */
        for (int64_t j = 0; j < H; ++j) {
            float *s = scores + j * max_len;
#ifdef HAVE_AVX2
            softmax_row(s, L);
            continue;
#endif
            float m = -INFINITY;
            for (int64_t p = 0; p < L; ++p) m = s[p] > m ? s[p] : m;
            float sum = 0.f;
            for (int64_t p = 0; p < L; ++p) { s[p] = expf(s[p] - m); sum += s[p]; }
            const float inv = 1.f / sum;
            for (int64_t p = 0; p < L; ++p) s[p] *= inv;
        }
        for (int64_t i = 0; i < H * D; ++i) acc[i] = 0.f;
        /* acc[j] = sum_p w[j][p] * v_p */
        for (int64_t p0 = 0; p0 < L; p0 += bs) {
            const float *vb = a->value_cache + (int64_t)table[p0 / bs] * bs * token_stride;
            const int64_t cnt = (L - p0) < bs ? (L - p0) : bs;
            const float *next = p0 + bs < L ? a->value_cache + (int64_t)table[p0 / bs + 1] * bs * token_stride : 0;
#ifdef HAVE_AVX2
            if (D % 64 == 0) {
                const int64_t pf_n = cnt * token_stride, pf_step = (pf_n + H - 1) / H;
                for (int64_t j = 0; j < H; ++j)
                    for (int64_t d0 = 0; d0 < D; d0 += 64) {
                        if (next && d0 == 0)
                            for (int64_t l = j * pf_step; l < (j + 1) * pf_step && l < pf_n; l += 16) PREFETCH_L2(next + l);
                        weighted_sum64(scores + j * max_len + p0, vb + (j / G) * D + d0, token_stride, cnt,
                                       acc + j * D + d0);
                    }
                continue;
            }
#endif
            for (int64_t t = 0; t < cnt; ++t) {
                if (next)
                    for (int64_t l = 0; l < token_stride; l += 16) PREFETCH_L2(next + t * token_stride + l);
                for (int64_t j = 0; j < H; ++j) {
                    const float w = scores[j * max_len + p0 + t];
                    const float *v = vb + t * token_stride + (j / G) * D;
                    float *acc_j = acc + j * D;
                    for (int64_t d = 0; d < D; ++d) acc_j[d] += w * v[d];
                }
            }
        }
        for (int64_t i = 0; i < H * D; ++i) o[i] = acc[i];
    }
    free(scores);
    a->status = 0;
    return 0;
}

#define MAX_THREADS 64

/* query/out are [tokens, H, D] with row strides q_stride/out_stride. Rows are split over up to
   n_threads workers in contiguous ranges of about equal total length (work is proportional to it).
   Returns 0, or -1 if a worker could not allocate its scratch memory. */
int paged_decode_attention_f32(
    const float *query, int64_t q_stride,
    const float *key_cache, const float *value_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int64_t *token_index, const int64_t *table_row, const int32_t *seq_lens, int64_t n,
    float *out, int64_t out_stride,
    int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t max_len, int64_t n_threads)
{
    job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t total = 0;
    for (int64_t r = 0; r < n; ++r) total += seq_lens[r];
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (n_threads > n) n_threads = n > 0 ? n : 1;
    if (total < 4096) n_threads = 1; /* too little work to pay for a thread */
    int64_t r = 0, done = 0;
    for (int64_t w = 0; w < n_threads; ++w) {
        job_t *j = &jobs[w];
        j->query = query; j->q_stride = q_stride; j->key_cache = key_cache; j->value_cache = value_cache;
        j->block_tables = block_tables; j->table_stride = table_stride;
        j->token_index = token_index; j->table_row = table_row; j->seq_lens = seq_lens;
        j->out = out; j->out_stride = out_stride;
        j->H = H; j->Hkv = Hkv; j->D = D; j->bs = bs; j->max_len = max_len; j->scale = scale;
        j->begin = r;
        const int64_t goal = total * (w + 1) / n_threads;
        while (r < n && (done < goal || w == n_threads - 1)) done += seq_lens[r++];
        j->end = r;
        j->status = 0;
    }
#ifdef _OPENMP
    /* torch's own OpenMP pool: the process has one libgomp.so.1 (torch's), so these are the threads
       that just ran the step's GEMMs, still spinning or parked, and no thread competes with them. */
    (void)threads; (void)started;
    #pragma omp parallel for num_threads(n_threads) schedule(static, 1)
    for (int64_t w = 0; w < n_threads; ++w) decode_rows(&jobs[w]);
#else
    for (int64_t w = 1; w < n_threads; ++w)
        started[w] = pthread_create(&threads[w], 0, decode_rows, &jobs[w]) == 0;
    decode_rows(&jobs[0]);
    for (int64_t w = 1; w < n_threads; ++w) {
        if (started[w]) pthread_join(threads[w], 0);
        else decode_rows(&jobs[w]); /* could not start a thread: do its share here */
    }
#endif
    for (int64_t w = 0; w < n_threads; ++w)
        if (jobs[w].status != 0) return -1;
    return 0;
}
