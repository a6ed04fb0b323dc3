/* AVX-512 VNNI kernels of the GGUF block rows (ggml_rows.h) for Q4_K, Q5_K and Q6_K, the types of most files:
 * four groups of 32 per pair of 512-bit `vpdpbusd` (64 unsigned codes x 64 int8 activations -> 16 int32
 * sums, lanes 0-7 one group, 8-15 another), where the AVX2 kernel needs two instructions per group.
 * The arithmetic is the AVX2 kernel's (ggml_rows_avx2.c), in another order of float additions. */
#include <stddef.h>
#include <string.h>

#include "ggml_rows.h"
#include "moed_cpu.h"

#if MOED_X86
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

#define GGML_PF 4096  /* as the AVX2 kernels: software prefetch along a thread's stream of rows */

static inline float f16x(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

/* 32 activations of group a in the low half, group b in the high half */
static inline __m512i two_groups(const int8_t *x, int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 32 * a))),
                              _mm256_loadu_si256((const __m256i *)(x + 32 * b)), 1);
}

static inline void dot_q45_k_vnni(int k5, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                                  const float *xsum, int T, float *y, int64_t ldy) {
    const int64_t nb = K / 256, groups = K / 32, bytes = k5 ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        __m256 macc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * bytes;
            if (t == 0)
                for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, _MM_HINT_T0);
            uint32_t u[3];
            memcpy(u, b + 4, 12);
            const uint32_t s_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
            const uint32_t s_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
            const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)s_hi, (int)s_lo)));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo)));
            const __m256 f = _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(f16x(b))), _mm256_loadu_ps(s + 8 * i));
            macc = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(f16x(b + 2))), _mm256_loadu_ps(su + 8 * i), macc);
            const __m512 f512 = _mm512_castps256_ps512(f);
            const uint8_t *qs = b + (k5 ? 48 : 16);
            const int8_t *x8 = q + i * 256;
            __m512i qh = k5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))) : _mm512_setzero_si512();
            for (int cc = 0; cc < 2; cc++) {  /* chunks 2cc and 2cc + 1: groups 4cc .. 4cc + 3 */
                const __m512i bytes64 = _mm512_loadu_si512((const void *)(qs + 64 * cc));
                __m512i lo = _mm512_and_si512(bytes64, m4), hi = _mm512_and_si512(_mm512_srli_epi16(bytes64, 4), m4);
                if (k5) {  /* chunk c's fifth bits: bits 2c (low nibbles) and 2c + 1 (high) of qh */
                    const __m512i sh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(4 * cc))),
                                                          _mm256_set1_epi16((short)(4 * cc + 2)), 1);
                    const __m512i bits = _mm512_srlv_epi16(qh, sh);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(bits, one), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(bits, 1), one), 4));
                }
                const int g0 = 4 * cc;  /* lo: groups g0 and g0 + 2; hi: g0 + 1 and g0 + 3 */
                const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, two_groups(x8, g0, g0 + 2));
                const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, two_groups(x8, g0 + 1, g0 + 3));
                const __m512i i0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(g0)),
                                                      _mm256_set1_epi32(g0 + 2), 1);
                const __m512i i1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(g0 + 1)),
                                                      _mm256_set1_epi32(g0 + 3), 1);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(i0, f512), acc);
                acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(i1, f512), acc1);
            }
        }
        __m256 m = macc;
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1)) - _mm_cvtss_f32(h);
    }
}

static void dot_q4_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    dot_q45_k_vnni(0, row, K, xq, xs, xsum, T, y, ldy);
}

static void dot_q5_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    dot_q45_k_vnni(1, row, K, xq, xs, xsum, T, y, ldy);
}

/* lanes 0-3 a, 4-7 b, 8-11 c, 12-15 d */
static inline __m512i quads(int a, int b, int c, int d) {
    return _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d);
}

/* Q6_K: per 128-weight half h, the 64 ql bytes hold groups 4h, 4h + 1 in their low nibbles and
 * 4h + 2, 4h + 3 in their high ones; the 32 qh bytes' bit pairs 0-3 the top 2 bits of those groups.
 * Codes q in 0..63: sum (q - 32) x = dpbusd(q, x) - dpbusd(32, x), exact. */
static void dot_q6_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3), c32 = _mm512_set1_epi8(32);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(0)), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(4)), _mm256_set1_epi16(6), 1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 210;
            if (t == 0)
                for (int l = 0; l < 210; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, _MM_HINT_T0);
            const __m512 S = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
                                           _mm512_set1_ps(f16x(b + 208)));
            const __m512 X = _mm512_castps256_ps512(_mm256_loadu_ps(s + 8 * i));
            const int8_t *x8 = q + i * 256;
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                for (int part = 0; part < 2; part++) {  /* groups A = 4h + 2 part, B = A + 1 */
                    const int A = 4 * h + 2 * part, B = A + 1;
                    const __m512i lo = part ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4) : _mm512_and_si512(ql, m4);
                    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(hb, part ? shift_hi : shift_lo), m2);
                    const __m512i codes = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
                    const __m512i x = two_groups(x8, A, B);
                    const __m512i p = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x),
                                                       _mm512_dpbusd_epi32(_mm512_setzero_si512(), c32, x));
                    const __m512 f = _mm512_mul_ps(_mm512_permutexvar_ps(quads(2 * A, 2 * A + 1, 2 * B, 2 * B + 1), S),
                                                   _mm512_permutexvar_ps(quads(A, A, B, B), X));
                    if (part)
                        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc1);
                    else
                        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc);
                }
            }
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1));
    }
}

#pragma GCC pop_options

moed_ggml_dot_fn moed_ggml_dot_avx512vnni(int type) {
    switch (type) {
    case MOED_GGML_Q4_K: return dot_q4_k;
    case MOED_GGML_Q5_K: return dot_q5_k;
    case MOED_GGML_Q6_K: return dot_q6_k;
    default: return NULL;
    }
}

#else

moed_ggml_dot_fn moed_ggml_dot_avx512vnni(int type) {
    (void)type;
    return NULL;
}

#endif
