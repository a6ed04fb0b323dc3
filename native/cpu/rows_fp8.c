/* Row-major FP8 matrices (the block-scaled float8_e4m3fn linears of DeepSeek-V3 / V3.2 / GLM-5 checkpoints,
 * kept as stored: moed/layers/packed_linear.py's "fp8" dtype):
 *   w uint8 [N][K] e4m3 codes      s float32 [N][K/128] the scale of each row's 128-weight blocks
 * y[t][n] = sum over blocks b of s[n][b] * (sum_k e4m3(w[n][k]) * x[t][k]), with the float activations x.
 *
 * An e4m3 byte s.eeee.mmm becomes the fp16 bits s.0eeee.mmm0000000 (the sign to bit 15, the rest
 * shifted left by 7): that fp16 is the e4m3 value times 2^-8 for every normal and subnormal code
 * (fp16's exponent bias is 8 more than e4m3's, and its subnormals are e4m3's shifted alike), so the
 * conversion is two shifts and the hardware fp16 -> float32 (F16C), and 256 folds into the block scale.
 * The torch twin (moed.kernels.rows_format.dequantize_rows "fp8") multiplies the codes read as
 * float8_e4m3fn by the scales; the sums here run in another order (float rounding apart, the same). */
#define _POSIX_C_SOURCE 200809L
#include <string.h>

#include "moed_cpu.h"

#define FP8_BLOCK 128

static inline float fp8_value(uint8_t b) {
    return moed_f16_to_f32((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))) * 256.0f;
}

float moed_fp8_e4m3_to_f32(uint8_t b) { return fp8_value(b); }

void moed_rows_fp8_scalar(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, B = K / FP8_BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = (const uint8_t *)w->w + r * K;
        const float *s = (const float *)w->s + r * B;
        for (int t = 0; t < a->T; t++) {
            const float *x = a->x + (int64_t)t * K;
            float acc = 0.0f;
            for (int64_t b = 0; b < B; b++) {
                float part = 0.0f;
                for (int k = 0; k < FP8_BLOCK; k++) part += fp8_value(q[b * FP8_BLOCK + k]) * x[b * FP8_BLOCK + k];
                acc += s[b] * part;
            }
            y[(int64_t)t * ldy + r] = acc;
        }
    }
}

#if MOED_X86
#include <immintrin.h>

#ifndef FP8_PF
#define FP8_PF 4096 /* software prefetch distance along a thread's stream of rows, bytes */
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
/* 16 codes -> two vectors of 8 floats (each the e4m3 value / 256) */
static inline __attribute__((always_inline)) void fp8x16_avx2(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

void moed_rows_fp8_avx2(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, B = K / FP8_BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = (const uint8_t *)w->w + r * K;
        const float *s = (const float *)w->s + r * B;
        for (int t = 0; t < a->T; t++) {
            const float *x = a->x + (int64_t)t * K;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < B; b++) {
                __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
                for (int k = 0; k < FP8_BLOCK; k += 16) {
                    const uint8_t *qp = q + b * FP8_BLOCK + k;
                    if (t == 0 && !(k & 63)) _mm_prefetch((const char *)qp + FP8_PF, _MM_HINT_T0);
                    __m256 lo, hi;
                    fp8x16_avx2(qp, &lo, &hi);
                    p0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + b * FP8_BLOCK + k), p0);
                    p1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + b * FP8_BLOCK + k + 8), p1);
                }
                acc = _mm256_fmadd_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(s[b] * 256.0f), acc);
            }
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            y[(int64_t)t * ldy + r] = _mm_cvtss_f32(v);
        }
    }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
/* 32 codes -> two vectors of 16 floats */
static inline __attribute__((always_inline)) void fp8x32_avx512(const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8),
                                      _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 7));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

void moed_rows_fp8_avx512(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, B = K / FP8_BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = (const uint8_t *)w->w + r * K;
        const float *s = (const float *)w->s + r * B;
        for (int t = 0; t < a->T; t++) {
            const float *x = a->x + (int64_t)t * K;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t b = 0; b < B; b++) {
                __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
                for (int k = 0; k < FP8_BLOCK; k += 32) {
                    const uint8_t *qp = q + b * FP8_BLOCK + k;
                    if (t == 0 && !(k & 63)) _mm_prefetch((const char *)qp + FP8_PF, _MM_HINT_T0);
                    __m512 lo, hi;
                    fp8x32_avx512(qp, &lo, &hi);
                    p0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + b * FP8_BLOCK + k), p0);
                    p1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + b * FP8_BLOCK + k + 16), p1);
                }
                acc = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), _mm512_set1_ps(s[b] * 256.0f), acc);
            }
            y[(int64_t)t * ldy + r] = _mm512_reduce_add_ps(acc);
        }
    }
}
#pragma GCC pop_options
#else
void moed_rows_fp8_avx2(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    moed_rows_fp8_scalar(w, a, r0, r1, y, ldy);
}
void moed_rows_fp8_avx512(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    moed_rows_fp8_scalar(w, a, r0, r1, y, ldy);
}
#endif
