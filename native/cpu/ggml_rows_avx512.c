/* AVX-512 VNNI kernels of the GGUF block rows (ggml_rows.h) for Q4_K, Q5_K and Q6_K, the types of most files,
 * Q2_K and Q3_K (the low-bit mixes big models ship in)
 * (and the 32-weight types, IQ4_XS and NVFP4, below):
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

#ifndef GGML_PF
#define GGML_PF 8192
#endif
#ifndef GGML_PF_HINT
#define GGML_PF_HINT _MM_HINT_T1
#endif  /* as the AVX2 kernels: software prefetch along a thread's stream of rows */

static inline float f16x(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

static inline float hsum8x(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* a Q4_K / Q5_K block's eight 6-bit scales (lanes 0-7) and mins (8-15) as int32, from its 12 scale
 * bytes (three words u0 u1 u2, read as 16 bytes: the block goes on): sub-blocks 0-3 in the low 6 bits
 * of u0 (scales) and u1 (mins); 4-7 in the nibbles of u2 with their top 2 bits in bits 6-7 of u0 / u1 */
static inline __m512i k_scales_mins(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 0));  /* u0 u1 u2 u2 */
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 1, 0));  /* u0 u1 u0 u1 */
    const __m128i lo = _mm_and_si128(a, _mm_set1_epi32(0x3f3f3f3f));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi32(0x0f0f0f0f)),
                                    _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(b, 6), _mm_set1_epi32(0x03030303)), 4));
    const __m128i all = _mm_blend_epi32(lo, hi, 0xC);  /* scales 0-3, mins 0-3, scales 4-7, mins 4-7 */
    return _mm512_cvtepu8_epi32(_mm_shuffle_epi32(all, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* Q4_K / Q5_K with activations of one scale per super-block (span 256, ggml_rows.h): per 64-weight
 * chunk c one vpdpbusd (lanes 0-7 group 2c, 8-15 group 2c + 1; |sum| <= 4 * 31 * 127 fits 16 bits)
 * and one vpdpwssd by the groups' integer scales into the super-block's int32 sums; then one float
 * multiply-add by d * xs. The min terms, dmin * m_j * xsum_j, are one vector per super-block. */
static inline void dot_q45_k_vnni(int k5, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                                  const float *xsum, int T, float *y, int64_t ldy) {
    const int64_t nb = K / 256, groups = K / 32, bytes = k5 ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    /* per 16-bit lane: 0 in the low 256 bits, 4 (nibbles) / 1 (fifth bits) in the high 256 */
    const __m512i nib_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i nib_shift2 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps();
        __m256 macc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * bytes;
            if (t == 0)
                for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            const __m512i sm = k_scales_mins(b + 4);  /* int32: lanes 0-7 scales, 8-15 mins */
            const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd32(b)));  /* d, dmin */
            macc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(sm, 1)),
                                                 _mm256_broadcastss_ps(_mm_movehdup_ps(dd))),
                                   _mm256_loadu_ps(su + 8 * i), macc);
            const uint8_t *qs = b + (k5 ? 48 : 16);
            const int8_t *x8 = q + i * 256;
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {  /* chunk c: groups 2c (low nibbles) and 2c + 1 (high), 64 activations */
                __m512i codes = _mm512_and_si512(
                    _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c))), nib_shift),
                    m4);
                if (k5) {  /* fifth bits: bit 2c (low half) and 2c + 1 (high half) of qh[l] for weight l */
                    const __m512i bit = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))),
                                                          _mm512_add_epi16(nib_shift2, _mm512_set1_epi16((short)(2 * c))));
                    codes = _mm512_or_si512(codes, _mm512_slli_epi16(_mm512_and_si512(bit, one), 4));
                }
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                                      _mm512_loadu_si512((const void *)(x8 + 64 * c)));
                const __m512i pick = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * c)),
                                                        _mm256_set1_epi32(2 * c + 1), 1);
                isum = _mm512_dpwssd_epi32(isum, p, _mm512_permutexvar_epi32(pick, sm));  /* scale < 64: [sc, 0] */
            }
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(_mm_cvtss_f32(dd) * s[8 * i]), acc);
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(acc) - hsum8x(macc);
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
 * Codes q in 0..63: sum (q - 32) x = dpbusd(q, x) - dpbusd(32, x), exact, |sum| <= 4 * 32 * 127 fits
 * 16 bits. With activations of span 256 (ggml_rows.h) the int8 scale of each 16 weights multiplies
 * these sums in integers (vpdpwssd) and a super-block ends in one float multiply-add by d * xs. */
static void dot_q6_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(3), c32 = _mm512_set1_epi8(32);
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(0)), _mm256_set1_epi16(2), 1);
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(4)), _mm256_set1_epi16(6), 1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 210;
            if (t == 0)
                for (int l = 0; l < 210; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            /* the 16 int8 scales as int16 in the low half of each int32 lane (high half zero) */
            const __m512i S = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))), low16);
            const int8_t *x8 = q + i * 256;
            __m512i isum = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
                const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                for (int part = 0; part < 2; part++) {  /* groups A = 4h + 2 part and A + 1: 64 activations */
                    const int A = 4 * h + 2 * part;
                    const __m512i lo = part ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4) : _mm512_and_si512(ql, m4);
                    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(hb, part ? shift_hi : shift_lo), m2);
                    const __m512i codes = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
                    const __m512i x = _mm512_loadu_si512((const void *)(x8 + 32 * A));
                    const __m512i p = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x),
                                                       _mm512_dpbusd_epi32(_mm512_setzero_si512(), c32, x));
                    isum = _mm512_dpwssd_epi32(isum, p, _mm512_permutexvar_epi32(quads(2 * A, 2 * A + 1, 2 * A + 2, 2 * A + 3), S));
                }
            }
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(f16x(b + 208) * s[8 * i]), acc);
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(acc);
    }
}

/* Q2_K / Q3_K with activations of span 256: the 2-bit codes of a 128-weight half sit at shifts 0/2/4/6 of
 * its 32 bytes (group 4n + j at shift 2j of half n); a 64-activation chunk c (groups 2c, 2c + 1) is one
 * vpdpbusd of those codes shifted per 256-bit half, whose lanes 4k..4k+3 are 16-weight sub-block 4c + k,
 * times the sub-blocks' integer scales (vpdpwssd; |sum| <= 4 * 7 * 127 fits 16 bits) into the super-block's
 * int32 sums, then one float multiply-add per super-block.
 * Q2_K: w = d sc q - dmin m per 16 (4-bit sc, m): the mins take the sub-blocks' activation sums
 *   (vpdpbusd of ones) times m, a second int32 sum and multiply-add by dmin * xs.
 * Q3_K: q = low2 - 4 (hmask bit g clear) in -4..3, w = d (sc - 32) q (6-bit sc): unsigned codes low2 + 4 hbit,
 *   and the 4 x sum of the activations subtracted before the scales apply. */
static inline __m512i q2_codes(__m512i half, int c) {
    const __m512i shift = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(4 * (c & 1)))),
                                             _mm256_set1_epi16((short)(4 * (c & 1) + 2)), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(half, shift), _mm512_set1_epi8(3));
}

static void dot_q2_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m512i one = _mm512_set1_epi8(1), m4 = _mm512_set1_epi32(0xF);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 84;
            if (t == 0)
                for (int l = 0; l < 84; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            const __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
            const __m512i S = _mm512_and_si512(packed, m4), M = _mm512_srli_epi32(packed, 4);
            const int8_t *x8 = q + i * 256;
            __m512i isum = _mm512_setzero_si512(), msum = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i half = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (c >> 1))));
                const __m512i x = _mm512_loadu_si512((const void *)(x8 + 64 * c));
                const __m512i pick = quads(4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3);
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q2_codes(half, c), x);
                isum = _mm512_dpwssd_epi32(isum, p, _mm512_permutexvar_epi32(pick, S));
                const __m512i xs4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), one, x);  /* |.| <= 4 * 128 */
                msum = _mm512_dpwssd_epi32(msum, xs4, _mm512_permutexvar_epi32(pick, M));
            }
            const float sx = s[8 * i];
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(f16x(b + 80) * sx), acc);
            macc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_set1_ps(f16x(b + 82) * sx), macc);
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(acc) - _mm512_reduce_add_ps(macc);
    }
}

/* a Q3_K block's 16 6-bit scales minus 32, as int16: scale k's low 4 bits are nibble k / 8 of byte k % 8,
 * its top 2 bits bits 2 (k / 4) of byte 8 + k % 4 (12 bytes read, none past them) */
static inline __m256i q3_scales(const uint8_t *p) {
    const __m128i low8 = _mm_loadl_epi64((const __m128i *)p);
    const __m128i top4 = _mm_cvtsi32_si128((int)rd32(p + 8));
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(low8, _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(top4, _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)));
    const __m256i l4 = _mm256_and_si256(_mm256_srlv_epi16(lo, _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4)),
                                        _mm256_set1_epi16(0xF));
    const __m256i h2 = _mm256_and_si256(_mm256_srlv_epi16(hi, _mm256_setr_epi16(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6)),
                                        _mm256_set1_epi16(3));
    return _mm256_sub_epi16(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), _mm256_set1_epi16(32));
}

static void dot_q3_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m512i one = _mm512_set1_epi8(1), four = _mm512_set1_epi8(4), low16 = _mm512_set1_epi32(0xFFFF);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 110;
            if (t == 0)
                for (int l = 0; l < 110; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            const __m512i S = _mm512_and_si512(_mm512_cvtepi16_epi32(q3_scales(b + 96)), low16);  /* int16 in the low half */
            const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b));
            const int8_t *x8 = q + i * 256;
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i half = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (c >> 1))));
                const __m512i gshift = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * c))),
                                                          _mm256_set1_epi16((short)(2 * c + 1)), 1);
                const __m512i hbit = _mm512_and_si512(_mm512_srlv_epi16(hm, gshift), one);
                const __m512i codes = _mm512_or_si512(q2_codes(half, c), _mm512_slli_epi16(hbit, 2));
                const __m512i x = _mm512_loadu_si512((const void *)(x8 + 64 * c));
                const __m512i prod = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x),
                                                      _mm512_dpbusd_epi32(_mm512_setzero_si512(), four, x));
                isum = _mm512_dpwssd_epi32(isum, prod, _mm512_permutexvar_epi32(quads(4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3), S));
            }
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(f16x(b + 108) * s[8 * i]), acc);
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(acc);
    }
}

/* The 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) and IQ4_XS: two blocks per
 * `vpdpbusd` (64 unsigned codes x the 64 activations that follow each other in memory; lanes 0-7 the
 * first block, 8-15 the second). Codes are read as unsigned, c = code + offset (Q8_0's int8 + 128,
 * IQ4's levels + 128, MXFP4's doubled e2m1 + 12, Q4_0's q as stored); the offset comes back as a min
 * term, -offset * scale * xsum, like Q4_1's m * xsum. Per eight blocks the scales are one gather. */

/* [low nibbles of q0, high of q0, low of q1, high of q1]: two blocks' 4-bit codes in weight order */
static inline __m512i nibble_pair(const uint8_t *q0, const uint8_t *q1) {
    const __m512i sh = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                         0x0004000400040004LL, 0x0004000400040004LL);
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q0));
    v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128((const __m128i *)q1));
    return _mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi8(0x0F));
}

/* lanes 0-7 factor a, 8-15 factor b of a vector of eight */
static inline __m512 pair_factors(__m512 f8, int a) {
    const __m512i i = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(a)), _mm256_set1_epi32(a + 1), 1);
    return _mm512_permutexvar_ps(i, f8);
}

static inline int b32_bytes(int type) {
    switch (type) {
    case MOED_GGML_Q4_1: return 20;
    case MOED_GGML_Q5_0: return 22;
    case MOED_GGML_Q5_1: return 24;
    case MOED_GGML_Q8_0: return 34;
    case MOED_GGML_MXFP4: return 17;
    default: return 18;  /* Q4_0, IQ4_NL */
    }
}

/* the unsigned codes of blocks b0 and b1 of a 32-weight type */
static inline __m512i b32_codes(int type, const uint8_t *b0, const uint8_t *b1) {
    const __m512i iq4 = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141,
                                                             (char)153, (char)166, (char)181, (char)197, (char)217,
                                                             (char)241));
    const __m512i fp4 = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    switch (type) {
    case MOED_GGML_Q8_0:
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                                   _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1),
                                _mm512_set1_epi8((char)0x80));
    case MOED_GGML_Q4_0: return nibble_pair(b0 + 2, b1 + 2);
    case MOED_GGML_Q4_1: return nibble_pair(b0 + 4, b1 + 4);
    case MOED_GGML_IQ4_NL: return _mm512_shuffle_epi8(iq4, nibble_pair(b0 + 2, b1 + 2));
    case MOED_GGML_MXFP4: return _mm512_shuffle_epi8(fp4, nibble_pair(b0 + 1, b1 + 1));
    default: {  /* Q5_0, Q5_1: the fifth bits, bit i of qh for weight i */
        const int off = type == MOED_GGML_Q5_1 ? 2 : 0;
        uint32_t h0, h1;
        memcpy(&h0, b0 + 2 + off, 4);
        memcpy(&h1, b1 + 2 + off, 4);
        const __m512i lo = nibble_pair(b0 + 6 + off, b1 + 6 + off);
        return _mm512_mask_add_epi8(lo, _cvtu64_mask64((uint64_t)h0 | (uint64_t)h1 << 32), lo, _mm512_set1_epi8(16));
    }
    }
}

static inline void dot_b32_vnni(int type, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                                const float *xsum, int T, float *y, int64_t ldy) {
    const int bytes = b32_bytes(type);
    const float offset = type == MOED_GGML_Q8_0 || type == MOED_GGML_IQ4_NL ? 128.0f
                         : type == MOED_GGML_MXFP4                          ? 12.0f
                         : type == MOED_GGML_Q4_0                           ? 8.0f
                         : type == MOED_GGML_Q5_0                           ? 16.0f
                                                                            : 0.0f;
    const int has_min = type == MOED_GGML_Q4_1 || type == MOED_GGML_Q5_1;
    const int64_t groups = K / 32, full = groups / 8 * 8;
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bytes));
    const moed_ggml_dot_fn tail = full < groups ? moed_ggml_dot(type, MOED_ISA_AVX2) : NULL;
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        __m256 macc = _mm256_setzero_ps();
        for (int64_t g = 0; g < full; g += 8) {
            const uint8_t *b = row + g * bytes;
            if (t == 0)
                for (int l = 0; l < 8 * bytes; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            const __m256i head = _mm256_i32gather_epi32((const int *)b, at, 1);  /* each block's first 4 bytes */
            __m256 d;
            if (type == MOED_GGML_MXFP4) {  /* 2^(e - 128) from the E8M0 byte (exact, subnormal for e = 0, 1) */
                const __m256i e = _mm256_and_si256(head, _mm256_set1_epi32(0xFF));
                d = _mm256_scalef_ps(_mm256_set1_ps(1.0f), _mm256_cvtepi32_ps(_mm256_sub_epi32(e, _mm256_set1_epi32(128))));
            } else {
                d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(head));
            }
            const __m256 mins = has_min ? _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(head, 16)))
                                        : _mm256_mul_ps(d, _mm256_set1_ps(-offset));
            macc = _mm256_fmadd_ps(mins, _mm256_loadu_ps(su + g), macc);
            const __m512 f8 = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_loadu_ps(s + g)));
            for (int j = 0; j < 4; j++) {
                const uint8_t *b0 = b + 2 * j * bytes;
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b32_codes(type, b0, b0 + bytes),
                                                      _mm512_loadu_si512((const void *)(q + 32 * (g + 2 * j))));
                if (j & 1)
                    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_factors(f8, 2 * j), acc1);
                else
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_factors(f8, 2 * j), acc);
            }
        }
        float r = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1)) + hsum8x(macc);
        if (tail) {  /* the last groups % 8 blocks */
            float rest;
            tail(row + full * bytes, K - full * 32, q + full * 32, s + full, su + full, 1, &rest, 1);
            r += rest;
        }
        y[(int64_t)t * ldy] = r;
    }
}

#define B32_TYPE(name, type)                                                                               \
    static void name(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T, \
                     float *y, int64_t ldy) {                                                              \
        dot_b32_vnni(type, row, K, xq, xs, xsum, T, y, ldy);                                               \
    }

B32_TYPE(dot_q4_0, MOED_GGML_Q4_0)
B32_TYPE(dot_q4_1, MOED_GGML_Q4_1)
B32_TYPE(dot_q5_0, MOED_GGML_Q5_0)
B32_TYPE(dot_q5_1, MOED_GGML_Q5_1)
B32_TYPE(dot_q8_0, MOED_GGML_Q8_0)
B32_TYPE(dot_iq4_nl, MOED_GGML_IQ4_NL)
B32_TYPE(dot_mxfp4, MOED_GGML_MXFP4)

/* NVFP4 (ggml_rows.h): one 64-weight block per vpdpbusd. Its 32 code bytes split into low and high
 * nibbles ([lo | hi]) and one qword permute puts the 64 codes in weight order (16-weight run s: the low
 * nibbles of bytes 8s..8s+7, then their high ones); the magnitudes 2|e2m1| are looked up and each sign
 * bit negates its activation instead, so lanes 4s..4s+3 sum run s (|sum| <= 4 * 12 * 127). */
static inline __m512i nvfp4_sums(const uint8_t *b, const int8_t *x64) {
    const __m512i mag = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12));
    const __m512i nib_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i z = _mm512_and_si512(
        _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 4))), nib_shift),
        _mm512_set1_epi8(0x0F));
    z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), z);
    const __m512i x = _mm512_loadu_si512((const void *)x64);
    const __m512i sx = _mm512_mask_sub_epi8(x, _mm512_test_epi8_mask(z, _mm512_set1_epi8(0x08)), _mm512_setzero_si512(), x);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_shuffle_epi8(mag, z), sx);
}

/* 16 E4M3 scale bytes (4 blocks) as ue4m3 / 256 floats: a byte's low 7 bits shifted left by 7 are an
 * fp16 of its value / 256, subnormals included; the byte 0x7F (NaN) reads as 0 (0xFF does not) */
static inline __m512 nvfp4_scales(__m128i bytes) {
    const __m256i w = _mm256_cvtepu8_epi16(bytes);
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(w, _mm256_set1_epi16(0x7F));
    return _mm512_cvtph_ps(_mm256_maskz_slli_epi16((__mmask16)~nan, _mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
}

/* Four blocks a step: their 16 scales decoded in one vector, times 128 (ue4m3 / 2) and the xs of their
 * eight groups, then spread over each block's lanes. */
static void dot_nvfp4(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                      float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 64, groups = K / 32, full = nb / 4 * 4;
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 half = _mm512_set1_ps(128.0f);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i < nb; i += 4) {
            const uint8_t *b = row + i * 36;
            const int n = i < full ? 4 : (int)(nb - i);
            if (t == 0)
                for (int l = 0; l < 144; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            __m128i sc = _mm_cvtsi32_si128((int)rd32(b));
            __m256 s8 = _mm256_castps128_ps256(_mm_loadu_ps(s + 2 * i));
            if (n == 4) {
                sc = _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(sc, (int)rd32(b + 36), 1), (int)rd32(b + 72), 2),
                                      (int)rd32(b + 108), 3);
                s8 = _mm256_loadu_ps(s + 2 * i);
            } else {  /* the last nb % 4 blocks */
                uint32_t w[4] = {0, 0, 0, 0};
                for (int j = 0; j < n; j++) w[j] = rd32(b + 36 * j);
                sc = _mm_loadu_si128((const __m128i *)w);
                s8 = _mm256_maskz_loadu_ps((__mmask8)((1u << (2 * n)) - 1), s + 2 * i);
            }
            const __m512 f16 = _mm512_mul_ps(_mm512_mul_ps(nvfp4_scales(sc), half),
                                             _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(s8)));
            for (int j = 0; j < n; j++) {
                const __m512i p = nvfp4_sums(b + 36 * j, q + 64 * (i + j));
                const __m512 f = _mm512_permutexvar_ps(quads(4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3), f16);
                if (j & 1)
                    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc1);
                else
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc);
            }
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1));
    }
}

/* IQ4_XS: per 256, d, 8 six-bit scales ls (low nibbles in 4 bytes, top 2 bits in a u16) and the
 * IQ4_NL codes of eight groups of 32 (16 bytes each); w = d (ls - 32) level(q) */
static void dot_iq4_xs(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                       float *y, int64_t ldy) {
    const int64_t nb = K / 256, groups = K / 32;
    const __m512i iq4 = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141,
                                                             (char)153, (char)166, (char)181, (char)197, (char)217,
                                                             (char)241));
    const __m256i lo_shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), hi_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        __m256 macc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 136;
            if (t == 0)
                for (int l = 0; l < 136; l += 64) _mm_prefetch((const char *)b + GGML_PF + l, GGML_PF_HINT);
            uint16_t sh;
            uint32_t sl;
            memcpy(&sh, b + 2, 2);
            memcpy(&sl, b + 4, 4);
            const __m256i ls = _mm256_or_si256(
                _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), lo_shift), _mm256_set1_epi32(0xF)),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), hi_shift), _mm256_set1_epi32(3)), 4));
            const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(f16x(b)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
            macc = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(-128.0f)), _mm256_loadu_ps(su + 8 * i), macc);
            const __m512 f8 = _mm512_castps256_ps512(_mm256_mul_ps(scale, _mm256_loadu_ps(s + 8 * i)));
            for (int j = 0; j < 4; j++) {
                const uint8_t *q0 = b + 8 + 32 * j;
                const __m512i codes = _mm512_shuffle_epi8(iq4, nibble_pair(q0, q0 + 16));
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                                      _mm512_loadu_si512((const void *)(q + 256 * i + 64 * j)));
                if (j & 1)
                    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_factors(f8, 2 * j), acc1);
                else
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_factors(f8, 2 * j), acc);
            }
        }
        y[(int64_t)t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1)) + hsum8x(macc);
    }
}

#pragma GCC pop_options

moed_ggml_dot_fn moed_ggml_dot_avx512vnni(int type) {
    switch (type) {
    case MOED_GGML_Q4_K: return dot_q4_k;
    case MOED_GGML_Q5_K: return dot_q5_k;
    case MOED_GGML_Q6_K: return dot_q6_k;
    case MOED_GGML_Q2_K: return dot_q2_k;
    case MOED_GGML_Q3_K: return dot_q3_k;
    case MOED_GGML_Q4_0: return dot_q4_0;
    case MOED_GGML_Q4_1: return dot_q4_1;
    case MOED_GGML_Q5_0: return dot_q5_0;
    case MOED_GGML_Q5_1: return dot_q5_1;
    case MOED_GGML_Q8_0: return dot_q8_0;
    case MOED_GGML_IQ4_NL: return dot_iq4_nl;
    case MOED_GGML_IQ4_XS: return dot_iq4_xs;
    case MOED_GGML_MXFP4: return dot_mxfp4;
    case MOED_GGML_NVFP4: return dot_nvfp4;
    default: return NULL;
    }
}

#else

moed_ggml_dot_fn moed_ggml_dot_avx512vnni(int type) {
    (void)type;
    return NULL;
}

#endif
