/* int8 activations for the quantised strips, and exact fp16 decoding (see moed_cpu.h). */
#include <math.h>
#include <string.h>

#include "moed_cpu.h"

int moed_cpu_isa(void);

static void quantize_span_scalar(const float *x, int T, int64_t K, int span, int8_t *xq, float *xs, float *xsum) {
    const int64_t groups = K / MOED_GROUP;
    const int per = span / MOED_GROUP;  /* groups sharing one scale */
    for (int t = 0; t < T; t++) {
        for (int64_t g0 = 0; g0 < groups; g0 += per) {
            const float *v = x + (int64_t)t * K + g0 * MOED_GROUP;
            float amax = 0.0f;
            for (int i = 0; i < span; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float scale = amax / 127.0f;
            for (int64_t g = g0; g < g0 + per; g++) {
                const float *u = x + (int64_t)t * K + g * MOED_GROUP;
                int8_t *q = xq + (int64_t)t * K + g * MOED_GROUP;
                int isum = 0;
                if (scale > 0.0f) {
                    for (int i = 0; i < MOED_GROUP; i++) {
                        /* the division, not a reciprocal multiply: the torch twin does the same */
                        /* round half to even: |u / scale| <= 127, so adding and taking off 1.5 * 2^23
                         * leaves the nearest integer (default FP mode), as nearbyintf would, without a
                         * libm call per element (the loop vectorises) */
                        float r = (u[i] / scale + 12582912.0f) - 12582912.0f;
                        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                        q[i] = (int8_t)r;
                        isum += q[i];
                    }
                } else {
                    memset(q, 0, MOED_GROUP);
                }
                /* the sum of the *quantised* values (llama.cpp's Q8_1 does the same): int4's min term
                 * then sees the same rounded activations as its scale term, and their errors cancel */
                xs[(int64_t)t * groups + g] = scale;
                xsum[(int64_t)t * groups + g] = scale * (float)isum;
            }
        }
    }
}

#if MOED_X86
#include <immintrin.h>

/* the same, eight values at a time: the same division, rounding and clamp per value, so the same bytes
 * (the scalar loop above does not vectorise past SSE at the library's base target; a decode step quantises
 * every token's input and every run expert's hidden activations) */
__attribute__((target("avx2"))) static void quantize_span_avx2(const float *x, int T, int64_t K, int span, int8_t *xq,
                                                                float *xs, float *xsum) {
    const int64_t groups = K / MOED_GROUP;
    const int per = span / MOED_GROUP;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), magic = _mm256_set1_ps(12582912.0f),
                 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int t = 0; t < T; t++) {
        for (int64_t g0 = 0; g0 < groups; g0 += per) {
            const float *v = x + (int64_t)t * K + g0 * MOED_GROUP;
            __m256 m = _mm256_setzero_ps();
            for (int i = 0; i < span; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + i), absmask));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float scale = _mm_cvtss_f32(m4) / 127.0f;
            const __m256 sv = _mm256_set1_ps(scale);
            for (int64_t g = g0; g < g0 + per; g++) {
                const float *u = x + (int64_t)t * K + g * MOED_GROUP;
                int8_t *q = xq + (int64_t)t * K + g * MOED_GROUP;
                int isum = 0;
                if (scale > 0.0f) {
                    __m256i r[4];
                    for (int k = 0; k < 4; k++) {
                        __m256 f = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(u + 8 * k), sv), magic), magic);
                        r[k] = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(f, hi), lo));
                    }
                    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
                    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, order));
                    __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
                    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                    isum = _mm_cvtsi128_si32(s4);
                } else {
                    memset(q, 0, MOED_GROUP);
                }
                xs[(int64_t)t * groups + g] = scale;
                xsum[(int64_t)t * groups + g] = scale * (float)isum;
            }
        }
    }
}
#endif

void moed_quantize_act_span_isa(int isa, const float *x, int T, int64_t K, int span, int8_t *xq, float *xs,
                                float *xsum) {
#if MOED_X86
    if (isa >= MOED_ISA_AVX2) {
        quantize_span_avx2(x, T, K, span, xq, xs, xsum);
        return;
    }
#endif
    (void)isa;
    quantize_span_scalar(x, T, K, span, xq, xs, xsum);
}

void moed_quantize_act_span(const float *x, int T, int64_t K, int span, int8_t *xq, float *xs, float *xsum) {
    moed_quantize_act_span_isa(moed_cpu_isa(), x, T, K, span, xq, xs, xsum);
}

void moed_quantize_act(const float *x, int T, int64_t K, int8_t *xq, float *xs, float *xsum) {
    moed_quantize_act_span(x, T, K, MOED_GROUP, xq, xs, xsum);
}

float moed_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);  /* subnormal (or zero): exact */
        return sign ? -f : f;
    }
    if (exp == 31)
        v.u = sign | 0x7F800000u | (man << 13);
    else
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    return v.f;
}
