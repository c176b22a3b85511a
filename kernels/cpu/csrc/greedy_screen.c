/* The greedy screen's candidate check: the float32 logits of the few columns a bfloat16 screen
   cannot rule out, and their argmax (greedy_screen.py). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX512F__)
/* 16 bfloat16 values as float32: a bfloat16 is the top half of a float32. */
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* A constraint's allowed ids (llguidance's bitmask: bit j of word w allows id 32 w + j, ids at or past
   32 W disallowed), or every id where aw is NULL. */
static inline int allowed_id(const int32_t *aw, int64_t W, int64_t j) {
    if (!aw) return 1;
    return (j >> 5) < W && (((uint32_t)aw[j >> 5] >> (j & 31)) & 1u);
}

/* The allowed bits of ids j ... j + 15, j a multiple of 16 (half a word). */
static inline uint32_t allowed16(const int32_t *aw, int64_t W, int64_t j) {
    if (!aw) return 0xFFFFu;
    return (j >> 5) < W ? ((uint32_t)aw[j >> 5] >> (j & 31)) & 0xFFFFu : 0u;
}

/* The largest of the V bfloat16 values whose ids are allowed (NaN ignored; the caller rejects a row
   whose norm is not finite); -inf when none is. */
static inline float row_max(const uint16_t *s, int64_t V, const int32_t *aw, int64_t W) {
    float m = -INFINITY;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    if (aw)
        for (; j + 16 <= V; j += 16) mv = _mm512_mask_max_ps(mv, (__mmask16)allowed16(aw, W, j), mv, bf16x16(s + j));
    else
        for (; j + 16 <= V; j += 16) mv = _mm512_max_ps(mv, bf16x16(s + j));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; j < V; ++j) {
        const float x = bf16_to_f32(s[j]);
        if (x > m && allowed_id(aw, W, j)) m = x;
    }
    return m;
}

/* The first allowed j with s[j] == m, m the value of an allowed id: a scalar search would walk half the
   vocabulary on average, as long as the max itself. */
static inline int64_t first_equal(const uint16_t *s, int64_t V, float m, const int32_t *aw, int64_t W) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    for (; j + 16 <= V; j += 16) {
        const __mmask16 eq = _mm512_mask_cmp_ps_mask((__mmask16)allowed16(aw, W, j), bf16x16(s + j), mv, _CMP_EQ_OQ);
        if (eq) return j + __builtin_ctz(eq);
    }
#else
    (void)V; /* the scalar search needs no bound: m is the value of one of the V ids */
#endif
    while (bf16_to_f32(s[j]) != m || !allowed_id(aw, W, j)) ++j;
    return j;
}

/* The float32 logit as oneDNN's float32 GEMM computes it: fused multiply-adds in order of k within
   each block of `kb` (oneDNN's K blocking, found at load: GreedyScreen.build), the blocks' sums added in
   order. */
static inline float logit_f32(const float *h, const float *w, int64_t K, int64_t kb) {
    float total = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t end = k0 + kb < K ? k0 + kb : K;
        float acc = 0.f;
        for (int64_t k = k0; k < end; ++k) acc = fmaf(h[k], w[k], acc);
        total = k0 == 0 ? acc : total + acc;
    }
    return total;
}

#define AT_CHAINS 8

/* out[i] = logit_f32 of hidden row rows[i] and weight row cols[i] (to find kb at load, and for the
   positions that penalties edit). Eight pairs at a time, each its own chain in the same order: one
   chain waits on its fma's latency at every k, eight keep the units busy, and no bit changes. */
void logits_at(const float *hidden, int64_t h_stride, const float *weight, int64_t K, int64_t kb,
               const int64_t *rows, const int64_t *cols, int64_t n, float *out)
{
    int64_t i = 0;
    for (; i + AT_CHAINS <= n; i += AT_CHAINS) {
        const float *h[AT_CHAINS], *w[AT_CHAINS];
        float total[AT_CHAINS] = {0}, acc[AT_CHAINS];
        for (int j = 0; j < AT_CHAINS; ++j) {
            h[j] = hidden + rows[i + j] * h_stride;
            w[j] = weight + cols[i + j] * K;
        }
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t end = k0 + kb < K ? k0 + kb : K;
            for (int j = 0; j < AT_CHAINS; ++j) acc[j] = 0.f;
            for (int64_t k = k0; k < end; ++k)
                for (int j = 0; j < AT_CHAINS; ++j) acc[j] = fmaf(h[j][k], w[j][k], acc[j]);
            for (int j = 0; j < AT_CHAINS; ++j) total[j] = k0 == 0 ? acc[j] : total[j] + acc[j];
        }
        for (int j = 0; j < AT_CHAINS; ++j) out[i + j] = total[j];
    }
    for (; i < n; ++i) out[i] = logit_f32(hidden + rows[i] * h_stride, weight + cols[i] * K, K, kb);
}

/* bfloat16 of x as torch rounds it (to nearest, ties to even), back as a float32; x finite. */
static inline float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The squared norms, in double, of each row j of the float32 weight w [V][K] (finite): sq[j] = |w_j|^2,
   sq_bf16[j] = |bf16(w_j)|^2 and sq_rest[j] = |w_j - bf16(w_j)|^2, each a sum in order of k (the
   columns' parts of the bound, taken at load; the caller takes the roots and rounds them up). One
   pass over the weight, no copy of it: the same sums in float64 tensors cost three float64 copies
   of the weight (SmolLM2's head: 680 MB written) on the start's critical path. */
void column_norms(const float *w, int64_t V, int64_t K, double *sq, double *sq_bf16, double *sq_rest,
                  int64_t threads) {
#ifdef _OPENMP
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#else
    (void)threads;
#endif
    for (int64_t j = 0; j < V; ++j) {
        const float *row = w + j * K;
        double a = 0.0, b = 0.0, c = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            const double x = (double)row[k], xb = (double)round_bf16(row[k]), r = x - xb;
            a += x * x;
            b += xb * xb;
            c += r * r;
        }
        sq[j] = a;
        sq_bf16[j] = b;
        sq_rest[j] = c;
    }
}

/* Row r: screen[r] holds V bfloat16 logits. For each column j the bound of the module docstring,
       eps_j = A p[j] + B t[j] + D |screen_j| + E,
   with A = |h - bf16(h)| + gamma |bf16(h)|, B = |h|, E = abs_term (|h| + w_max + 1) from the row
   (computed here in double) and p[j] = |bf16(w_j)|, t[j] = |w_j - bf16(w_j)| + gamma |w_j| from the
   column (at load, rounded up). ids[r] = the argmax of the float32 logits of the candidates, the
   columns with screen_j + eps_j >= screen_m - eps_m (m: the screen's own argmax), lowest id on
   ties; cand[r] = their number, or -1 when the row's hidden state or screen is not finite or it
   has more than max_cand candidates (the caller then takes the full head for it).
   With a constraint (allow not NULL): row r's allowed ids are bitmask row allow_row[r] of allow
   [.][W] (every id where allow_row[r] < 0); the others are neither the screen's maximum nor
   candidates, as if they were -inf on the screen, and nothing is written to mask them.
   terms (NULL, or [n][3]): each screened row's A, B and E, for edited_may_win. */
void greedy_from_screen(const uint16_t *screen, int64_t screen_stride, const float *hidden, int64_t h_stride,
                        const float *weight, int64_t V, int64_t K, int64_t kb, const float *p, const float *t,
                        double p_max, double t_max, double gamma, double d_rel, double abs_term, double w_max,
                        int64_t max_cand, int64_t n, int64_t *ids, int64_t *cand,
                        const int32_t *allow, int64_t W, const int64_t *allow_row, double *terms)
{
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
        const int32_t *aw = allow && allow_row[r] >= 0 ? allow + allow_row[r] * W : NULL;
        const uint16_t *s = screen + r * screen_stride;
        const float *h = hidden + r * h_stride;
        double sq = 0.0, sq_b = 0.0, sq_d = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            sq += (double)h[k] * (double)h[k];
            if (!isfinite(h[k])) { sq = INFINITY; break; }
            const float hb = round_bf16(h[k]), dh = h[k] - hb; /* exact: hb is within a factor 2 of h */
            sq_b += (double)hb * (double)hb;
            sq_d += (double)dh * (double)dh;
        }
        const double norm = sqrt(sq);
        const float m = row_max(s, V, aw, W);
        /* |logit| <= norm * w_max: below 1e37 no sum can overflow, so no screen value is NaN */
        if (!(norm * w_max < 1e37) || !isfinite(m)) { ids[r] = -1; cand[r] = -1; continue; }
        const double slack = 1.0 + 1e-9; /* the rounding of the norms and of eps itself */
        const double A = (sqrt(sq_d) + gamma * sqrt(sq_b)) * slack, B = norm * slack;
        const double E = abs_term * (norm + w_max + 1.0) * slack, D = d_rel * slack;
        if (terms) { terms[3 * r] = A; terms[3 * r + 1] = B; terms[3 * r + 2] = E; }
        const int64_t jm = first_equal(s, V, m, aw, W);
        const double eps_m = A * p[jm] + B * t[jm] + D * fabs((double)m) + E;
        const double floor_t = (double)m - eps_m; /* the best logit is at least this */
        /* Only a column with screen_j >= pre can reach floor_t (eps_j at most the largest column's). */
        const double x = floor_t - (A * p_max + B * t_max + E);
        const float pre = nextafterf((float)(x >= 0 ? x / (1.0 + D) : x / (1.0 - D)), -INFINITY);
        int64_t best_id = -1, count = 0;
        float best = -INFINITY;
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 pre_v = _mm512_set1_ps(pre);
        for (; j + 16 <= V && count <= max_cand; j += 16) {
            __mmask16 hit = _mm512_mask_cmp_ps_mask((__mmask16)allowed16(aw, W, j), bf16x16(s + j), pre_v, _CMP_GE_OQ);
            while (hit) {
                const int64_t c = j + __builtin_ctz(hit);
                hit &= hit - 1;
                const double sc = (double)bf16_to_f32(s[c]);
                if (sc + A * p[c] + B * t[c] + D * fabs(sc) + E < floor_t) continue;
                const float v = logit_f32(h, weight + c * K, K, kb);
                ++count;
                if (best_id < 0 || v > best) { best = v; best_id = c; } /* ascending ids: ties keep the lowest */
            }
        }
#endif
        for (; j < V && count <= max_cand; ++j) {
            const float sf = bf16_to_f32(s[j]);
            if (!(sf >= pre) || !allowed_id(aw, W, j)) continue;
            const double sc = (double)sf;
            if (sc + A * p[j] + B * t[j] + D * fabs(sc) + E < floor_t) continue;
            const float v = logit_f32(h, weight + j * K, K, kb);
            ++count;
            if (best_id < 0 || v > best) { best = v; best_id = j; }
        }
        if (count > max_cand) { ids[r] = -1; cand[r] = -1; continue; } /* a loose screen: the full head is cheaper */
        ids[r] = best_id;
        cand[r] = count;
    }
}

/* The penalised positions pos[i] = row * V + id, taken out of the screen before its search:
   vals[i] = their screen values as float32, and -inf on the screen in their place. */
void hold_out(uint16_t *screen, int64_t screen_stride, int64_t V, const int64_t *pos, int64_t n_pos, float *vals)
{
    const uint16_t minus_inf = 0xFF80u; /* bfloat16 -inf */
    for (int64_t i = 0; i < n_pos; ++i) {
        uint16_t *at = screen + (pos[i] / V) * screen_stride + pos[i] % V;
        vals[i] = bf16_to_f32(*at);
        *at = minus_inf;
    }
}

/* Which penalised positions may still win their row (greedy_screen.py, _with_edits): keep[] gets the
   indices i (ascending) whose value after the penalties can reach best[row], the exact logit of the
   row's best untouched id; returns their number. A position's raw logit is at most
   vals[i] + eps (the bound, with the row's terms from greedy_from_screen); the penalties are
   increasing in it (sampler.py, LogitEdits.penalised_values: x / rep where x > 0, else x * rep, then
   minus freq * count and presence where count > 0), evaluated here in double with room for the
   float32 roundings of the real thing (three operations, each within 2^-24 of its result).
   allowed (NULL: all): 0 for a position the constraint disallows or min_tokens blocks. */
int64_t edited_may_win(const int64_t *pos, int64_t n_pos, int64_t V, const float *vals, const float *p, const float *t,
                       const double *terms, double d_rel, const float *rep, const float *freq, const float *pres,
                       const float *counts, const float *best, const uint8_t *allowed, int64_t *keep)
{
    const double D = d_rel * (1.0 + 1e-9);
    int64_t kept = 0;
    for (int64_t i = 0; i < n_pos; ++i) {
        if (allowed && !allowed[i]) continue;
        const int64_t r = pos[i] / V, j = pos[i] % V;
        const double s = (double)vals[i];
        const double up = s + (terms[3 * r] * p[j] + terms[3 * r + 1] * t[j] + D * fabs(s) + terms[3 * r + 2]) * (1.0 + 1e-6);
        const double x = up > 0 ? up / (double)rep[i] : up * (double)rep[i];
        const double cut = (double)freq[i] * (double)counts[i] + (counts[i] > 0 ? (double)pres[i] : 0.0);
        if (x - cut + 1e-6 * (fabs(x) + fabs(cut)) + 1e-37 >= (double)best[r]) keep[kept++] = i;
    }
    return kept;
}
