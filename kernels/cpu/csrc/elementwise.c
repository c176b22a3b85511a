/* The decoder's element-wise layers, float32, one pass each, with torch's bits (elementwise.py). */
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
