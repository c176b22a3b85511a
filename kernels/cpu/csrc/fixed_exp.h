/* e^x as one fixed sequence of float32 operations, shared by the kernels whose results must not depend
   on where a value sits (invariant_gemm.c's SiLU, row_logprobs.c's normaliser). Include after
   <math.h>, <stdint.h>, <string.h> and, with HAVE_AVX2_FMA defined, <immintrin.h>. */
#ifndef TOKENMILL_FIXED_EXP_H
#define TOKENMILL_FIXED_EXP_H

/* e^x: one fixed sequence of float32 operations (Cephes' expf: x clamped to
   [-87, 88], n = x log2(e) rounded to the nearest integer, r = x - n ln(2) in two parts, a degree-5
   polynomial, times 2^n), the same in every vector lane and in the scalar code, so an element's
   value never depends on where it sits in a row or a call. Within ~2 ulp of expf. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float exp_scalar(float x) {
    x = x < EXP_HI ? x : EXP_HI; /* the vector min/max's rules, NaN included */
    x = x > EXP_LO ? x : EXP_LO;
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float y = P0;
    y = fmaf(y, r, P1);
    y = fmaf(y, r, P2);
    y = fmaf(y, r, P3);
    y = fmaf(y, r, P4);
    y = fmaf(y, r, P5);
    y = fmaf(y, r * r, r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return y * scale;
}

#ifdef HAVE_AVX2_FMA
/* exp_vector for x with no lane above EXP_HI: the clamp at EXP_LO, then the fixed sequence. */
static inline __m256 exp_vector_below_hi(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 y = _mm256_set1_ps(P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static inline __m256 exp_vector(__m256 x) {
    return exp_vector_below_hi(_mm256_min_ps(x, _mm256_set1_ps(EXP_HI)));
}

/* exp_vector's e^x, every bit the same, where no lane of x is above 0 or NaN (x - max of a finite
   row): its clamp at EXP_HI changes nothing there, so it is left out (one operation of about 20). */
static inline __m256 exp_vector_nonpositive(__m256 x) { return exp_vector_below_hi(x); }
#endif

#if defined(__AVX512F__)
/* exp_vector_nonpositive in 16 lanes: the same operations, so every lane's bits are the same as the
   8-lane and the scalar code's (round to nearest even, then the conversion of an integral value). */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 y = _mm512_set1_ps(P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif

#endif
