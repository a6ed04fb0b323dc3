/* AVX2 kernels of the GGUF block rows (ggml_rows.h) for the types of the common files (Q4_K, Q5_K,
 * Q6_K, Q8_0, and the 32-weight 4-bit ones); the others use the scalar kernels.
 *
 * Per group of 32 weights the codes are unpacked into one __m256i of int8, multiplied with the 32
 * int8 activations (vpmaddubsw on unsigned codes, or on |code| with the activations' signs moved
 * over: the products of one pair stay below 2 * 127 * 127, no saturation), widened to 8 int32 sums
 * (lanes 0-3 the first 16 weights, 4-7 the second) and added into a float accumulator with a
 * per-lane factor scale_h * xs; the min terms (min * xsum per group) go into a scalar. One
 * horizontal sum per row and token. */
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "ggml_rows.h"
#include "moed_cpu.h"

/* GGML_VNNI256: this file built a second time (ggml_rows_avx2vnni.c) with AVX-512 VNNI's 256-bit forms, for
 * CPUs that split 512-bit instructions in two (Zen 4): `vpdpbusd` takes maddubs + madd, `vpdpwssd` a scaled
 * madd + add; the same integer sums, so the same floats as the plain AVX2 kernels */
#ifndef GGML_VNNI256
#define GGML_VNNI256 0
#endif
#if GGML_VNNI256
#define GGML_AVX2_DOT moed_ggml_dot_avx2vnni
#else
#define GGML_AVX2_DOT moed_ggml_dot_avx2
#endif

#if MOED_X86
#include <immintrin.h>

#pragma GCC push_options
#if GGML_VNNI256
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#else
#pragma GCC target("avx2,fma,f16c")
#endif

static inline float f16x(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 sums of unsigned codes u (0..127) times signed activations x, 4 weights per lane */
static inline __m256i udot(__m256i u, __m256i x) {
#if GGML_VNNI256
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* acc + udot(u, x) * s, s from scale_pick (each lane's integer scale; |udot| < 2^15 here) */
static inline __m256i udot_scaled(__m256i acc, __m256i u, __m256i x, __m256i s) {
#if GGML_VNNI256
    return _mm256_dpwssd_epi32(acc, _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x), s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s));
#endif
}

/* the shuffle that takes 16-bit scale g (of each 128-bit half's eight) into every lane, as udot_scaled
 * multiplies: both halves of a 32-bit lane for madd, the low half (the high one 0) for vpdpwssd */
static inline __m256i scale_pick(int g) {
#if GGML_VNNI256
    return _mm256_set1_epi32((int)(0x80800100u + 0x0202u * (unsigned)g));
#else
    return _mm256_set1_epi16((short)(0x0100 + 0x0202 * g));
#endif
}

/* the same for signed codes s (|s| <= 127) */
static inline __m256i sdot(__m256i s, __m256i x) {
    return udot(_mm256_sign_epi8(s, s), _mm256_sign_epi8(x, s));
}

/* software prefetch this far ahead along a thread's stream of rows (the rows of a task follow each
 * other in memory); the hardware prefetchers alone left these kernels at ~40% of the read bandwidth
 * (rows_quant.c measured the same for its rows) */
#ifndef GGML_PF
#define GGML_PF 8192
#endif
#ifndef GGML_PF_HINT
#define GGML_PF_HINT _MM_HINT_T1
#endif
static inline void prefetch_block(const uint8_t *p, int bytes) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + GGML_PF + l, GGML_PF_HINT);
}

static inline __m256 halves(float a, float b) { return _mm256_setr_m128(_mm_set1_ps(a), _mm_set1_ps(b)); }

/* one sub-block's 6-bit scale and min (Q4_K / Q5_K) */
static inline void k_scale_min_1(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* one type's kernel from a shared one that takes the type (or a flag) first */
#define ONE_TYPE(name, shared, arg)                                                                   \
    static void name(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, \
                     int T, float *y, int64_t ldy) {                                                  \
        shared(arg, row, K, xq, xs, xsum, T, y, ldy);                                                 \
    }

/* Q4_K / Q5_K: the two sub-blocks of 32-byte chunk c (low nibbles: sub-block 2c, high: 2c + 1),
 * with Q5_K's fifth bits from qh (bit 0, then bit 1 of each byte; qh shifted by 2 for the next chunk) */
static inline void q45k_pair(int k5, const uint8_t *qs, int c, __m256i *qh, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    *lo = _mm256_and_si256(bytes, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
    if (k5) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(*qh, one), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(*qh, 1), one), 4));
        *qh = _mm256_srli_epi16(*qh, 2);
    }
}

/* Q6_K: the signed codes (q - 32) of group gi (0-3) of a 128-weight half: ql bytes l0 / l1, qh bytes hb */
static inline __m256i q6k_codes(__m256i l0, __m256i l1, __m256i hb, int gi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    const __m256i lsrc = gi & 1 ? l1 : l0;
    const __m256i lo = gi < 2 ? _mm256_and_si256(lsrc, m4) : _mm256_and_si256(_mm256_srli_epi16(lsrc, 4), m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * gi), m2);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), off);
}

/* ---- the 32-weight block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 ----
 *
 * Eight blocks per step: their eight scales come as one vector (eight 16-bit loads and one fp16
 * conversion, or eight E8M0 bytes through a table), times the activations' eight scales, stored and
 * broadcast back from memory per block (a load, no shuffle port); the min terms of eight blocks are one
 * multiply-add against the activation sums. Four accumulators, so the multiply-add latency does not
 * bound a block to two cycles. What is left per block is its code decode, two integer multiply-adds,
 * one conversion and one multiply-add. Blocks past the last whole eight (K = 2880: 90 blocks) take the
 * same path one at a time. */

/* 2^(e - 128) per E8M0 byte (MXFP4's codes are doubled E2M1 values; e < 2 gives the subnormals) */
static float e8m0_half_table[256];

/* NVFP4's unsigned E4M3 scale byte times 1/2 (moed_ue4m3_half) per byte */
static float ue4m3_half_table[256];

static void init_tables(void) {
    for (int e = 0; e < 256; e++) {
        union { uint32_t u; float f; } v;
        v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
        e8m0_half_table[e] = v.f;
        ue4m3_half_table[e] = moed_ue4m3_half((uint8_t)e);
    }
}

static inline uint16_t ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* the fp16 at p, p + stride, ..., p + 7 stride as 8 floats */
static inline __m256 f16_8(const uint8_t *p, int stride) {
    __m128i v = _mm_cvtsi32_si128(ld16(p));
    v = _mm_insert_epi16(v, ld16(p + stride), 1);
    v = _mm_insert_epi16(v, ld16(p + 2 * stride), 2);
    v = _mm_insert_epi16(v, ld16(p + 3 * stride), 3);
    v = _mm_insert_epi16(v, ld16(p + 4 * stride), 4);
    v = _mm_insert_epi16(v, ld16(p + 5 * stride), 5);
    v = _mm_insert_epi16(v, ld16(p + 6 * stride), 6);
    v = _mm_insert_epi16(v, ld16(p + 7 * stride), 7);
    return _mm256_cvtph_ps(v);
}

/* 16 bytes of nibbles -> 32 codes (weights 0-15 the low nibbles, 16-31 the high ones): one broadcast
 * load, the upper lane shifted by 4, one mask */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

/* 32 bits of qh -> 32 bytes of 0x10 where the bit is set (bit i for weight i) */
static inline __m256i high_bits32(uint32_t qh) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

static inline int b32_bytes(int type) {
    switch (type) {
    case MOED_GGML_Q8_0: return 34;
    case MOED_GGML_Q4_1: return 20;
    case MOED_GGML_Q5_0: return 22;
    case MOED_GGML_Q5_1: return 24;
    case MOED_GGML_MXFP4: return 17;
    default: return 18;  /* Q4_0, IQ4_NL */
    }
}

/* the block's 32 codes: unsigned (0..31) for the types with an offset or a min, signed otherwise */
static inline __m256i b32_codes(int type, const uint8_t *b) {
    const __m256i nl = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    /* MXFP4's doubled E2M1 values plus 12 (unsigned: no sign moves; the 12 comes back as a min term) */
    const __m256i e2m1u = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                           12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    uint32_t qh;
    switch (type) {
    case MOED_GGML_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case MOED_GGML_Q4_1: return nibbles32(b + 4);
    case MOED_GGML_IQ4_NL: return _mm256_shuffle_epi8(nl, nibbles32(b + 2));
    case MOED_GGML_MXFP4: return _mm256_shuffle_epi8(e2m1u, nibbles32(b + 1));
    case MOED_GGML_Q5_0:
        memcpy(&qh, b + 2, 4);
        return _mm256_or_si256(nibbles32(b + 6), high_bits32(qh));
    case MOED_GGML_Q5_1:
        memcpy(&qh, b + 4, 4);
        return _mm256_or_si256(nibbles32(b + 8), high_bits32(qh));
    default: return nibbles32(b + 2);  /* Q4_0 */
    }
}

static inline int b32_signed(int type) {
    return type == MOED_GGML_Q8_0 || type == MOED_GGML_IQ4_NL;
}

/* the block's scale d (w = d * code + min) */
static inline float b32_d(int type, const uint8_t *b) {
    return type == MOED_GGML_MXFP4 ? e8m0_half_table[b[0]] : _cvtsh_ss(ld16(b));
}

/* eight consecutive blocks' scales d */
static inline __m256 b32_d8(int type, const uint8_t *b) {
    if (type != MOED_GGML_MXFP4) return f16_8(b, b32_bytes(type));
    return _mm256_setr_ps(e8m0_half_table[b[0]], e8m0_half_table[b[17]], e8m0_half_table[b[34]],
                          e8m0_half_table[b[51]], e8m0_half_table[b[68]], e8m0_half_table[b[85]],
                          e8m0_half_table[b[102]], e8m0_half_table[b[119]]);
}

/* the types with a min term: min = -8 d (Q4_0), -16 d (Q5_0), -12 d (MXFP4's offset codes), the stored m
 * (Q4_1, Q5_1) */
static inline int b32_has_min(int type) {
    return type == MOED_GGML_Q4_0 || type == MOED_GGML_Q5_0 || type == MOED_GGML_Q4_1 || type == MOED_GGML_Q5_1
        || type == MOED_GGML_MXFP4;
}

static inline __m256 b32_min8(int type, const uint8_t *b, __m256 d) {
    switch (type) {
    case MOED_GGML_Q4_0: return _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    case MOED_GGML_Q5_0: return _mm256_mul_ps(d, _mm256_set1_ps(-16.0f));
    case MOED_GGML_MXFP4: return _mm256_mul_ps(d, _mm256_set1_ps(-12.0f));
    default: return f16_8(b + 2, b32_bytes(type));  /* Q4_1, Q5_1 */
    }
}

static inline float b32_min(int type, const uint8_t *b, float d) {
    switch (type) {
    case MOED_GGML_Q4_0: return -8.0f * d;
    case MOED_GGML_Q5_0: return -16.0f * d;
    case MOED_GGML_MXFP4: return -12.0f * d;
    default: return _cvtsh_ss(ld16(b + 2));
    }
}

static inline __m256 b32_dot(int type, const uint8_t *b, const int8_t *x) {
    const __m256i codes = b32_codes(type, b), xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_cvtepi32_ps(b32_signed(type) ? sdot(codes, xv) : udot(codes, xv));
}

static inline void dot_b32(int type, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                           const float *xsum, int T, float *y, int64_t ldy) {
    const int64_t groups = K / 32;
    const int bytes = b32_bytes(type), mins = b32_has_min(type);
    float fac[8] __attribute__((aligned(32)));
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, macc = a0;
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8) {
            const uint8_t *b = row + g * bytes;
            if (t == 0) prefetch_block(b, 8 * bytes);
            const __m256 d = b32_d8(type, b);
            _mm256_store_ps(fac, _mm256_mul_ps(d, _mm256_loadu_ps(s + g)));
            if (mins) macc = _mm256_fmadd_ps(b32_min8(type, b, d), _mm256_loadu_ps(su + g), macc);
            for (int j = 0; j < 8; j += 4) {
                const int8_t *x = q + 32 * (g + j);
                a0 = _mm256_fmadd_ps(b32_dot(type, b + j * bytes, x), _mm256_broadcast_ss(fac + j), a0);
                a1 = _mm256_fmadd_ps(b32_dot(type, b + (j + 1) * bytes, x + 32), _mm256_broadcast_ss(fac + j + 1), a1);
                a2 = _mm256_fmadd_ps(b32_dot(type, b + (j + 2) * bytes, x + 64), _mm256_broadcast_ss(fac + j + 2), a2);
                a3 = _mm256_fmadd_ps(b32_dot(type, b + (j + 3) * bytes, x + 96), _mm256_broadcast_ss(fac + j + 3), a3);
            }
        }
        float tail = 0.0f;
        for (; g < groups; g++) {
            const uint8_t *b = row + g * bytes;
            const float d = b32_d(type, b);
            a0 = _mm256_fmadd_ps(b32_dot(type, b, q + 32 * g), _mm256_set1_ps(d * s[g]), a0);
            if (mins) tail += b32_min(type, b, d) * su[g];
        }
        y[(int64_t)t * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + hsum8(macc) + tail;
    }
}

ONE_TYPE(dot_q8_0, dot_b32, MOED_GGML_Q8_0)

ONE_TYPE(dot_q4_0, dot_b32, MOED_GGML_Q4_0)

ONE_TYPE(dot_q4_1, dot_b32, MOED_GGML_Q4_1)

ONE_TYPE(dot_q5_0, dot_b32, MOED_GGML_Q5_0)

ONE_TYPE(dot_q5_1, dot_b32, MOED_GGML_Q5_1)

ONE_TYPE(dot_iq4_nl, dot_b32, MOED_GGML_IQ4_NL)

ONE_TYPE(dot_mxfp4, dot_b32, MOED_GGML_MXFP4)

/* Q4_K / Q5_K: 8 sub-blocks of 32; w = d * sc * q - dmin * m, with one activation scale per super-block
 * (moed_ggml_act_span 256): each sub-block's integer products are multiplied by its 6-bit scale in
 * integers (vpmaddwd with the scale in every 16-bit lane: |pair| <= 2 * 31 * 127, times 63 fits int32),
 * summed over the super-block, and converted once: one multiply-add per 256 weights instead of eight.
 * The min terms of the eight sub-blocks are one multiply-add. */
static inline void dot_q45_k(int k5, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                             const float *xsum, int T, float *y, int64_t ldy) {
    const int64_t nb = K / 256, groups = K / 32, bb = k5 ? 176 : 144;
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * bb;
            if (t == 0) prefetch_block(b, (int)bb);
            uint32_t u[3];
            memcpy(u, b + 4, 12);
            const uint32_t s_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
            const uint32_t s_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
            const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
            /* the eight scales as 16-bit lanes, the same in both 128-bit halves */
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)s_hi, (int)s_lo)));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo)));
            macc = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(_cvtsh_ss(ld16(b + 2)))), _mm256_loadu_ps(su + 8 * i),
                                   macc);
            const uint8_t *qs = b + (k5 ? 48 : 16);
            const int8_t *x8 = q + i * 256;
            __m256i qh = k5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i lo, hi;
                q45k_pair(k5, qs, c, &qh, &lo, &hi);
                i0 = udot_scaled(i0, lo, _mm256_loadu_si256((const __m256i *)(x8 + 64 * c)),
                                 _mm256_shuffle_epi8(sc, scale_pick(2 * c)));
                i1 = udot_scaled(i1, hi, _mm256_loadu_si256((const __m256i *)(x8 + 64 * c + 32)),
                                 _mm256_shuffle_epi8(sc, scale_pick(2 * c + 1)));
            }
            const __m256 f = _mm256_set1_ps(_cvtsh_ss(ld16(b)) * s[8 * i]);
            if (i & 1)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), f, acc1);
            else
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), f, acc);
        }
        y[(int64_t)t * ldy] = hsum8(_mm256_sub_ps(_mm256_add_ps(acc, acc1), macc));
    }
}

ONE_TYPE(dot_q4_k, dot_q45_k, 0)

ONE_TYPE(dot_q5_k, dot_q45_k, 1)

/* NT tokens (1-4, a constant after inlining) of one row: each group's codes decoded once, their |code| and scale
 * pick shared, and per token only the activations' signs, the products and the sum (a prefill chunk multiplies one
 * row with many tokens: decoding per token cost half the work). Token t's accumulators are its own, so each
 * token's integer sums and float additions happen in the same order as with NT = 1. */
static inline __attribute__((always_inline)) void q6_k_tokens(const uint8_t *row, int64_t K, const int8_t *xq,
                                                              const float *xs, const int NT, float *y, int64_t ldy,
                                                              int first) {
    const int64_t nb = K / 256, groups = K / 32;
    const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256 acc[4], acc1[4];
    for (int t = 0; t < NT; t++) acc[t] = acc1[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = row + i * 210;
        if (first) prefetch_block(b, 210);
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(b + 192)), evens_odds));
        __m256i i0[4], i1[4];
        for (int t = 0; t < NT; t++) i0[t] = i1[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int gi = 0; gi < 4; gi++) {
                const __m256i codes = q6k_codes(l0, l1, hb, gi);
                const int g = 4 * h + gi;
                const __m256i u = _mm256_sign_epi8(codes, codes), sg = _mm256_shuffle_epi8(sc, scale_pick(g));
                for (int t = 0; t < NT; t++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)t * K + i * 256 + 32 * g));
                    const __m256i sx = _mm256_sign_epi8(x, codes);
                    if (gi & 1)
                        i1[t] = udot_scaled(i1[t], u, sx, sg);
                    else
                        i0[t] = udot_scaled(i0[t], u, sx, sg);
                }
            }
        }
        const float d = _cvtsh_ss(ld16(b + 208));
        for (int t = 0; t < NT; t++) {
            const __m256 f = _mm256_set1_ps(d * xs[(int64_t)t * groups + 8 * i]);
            if (i & 1)
                acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0[t], i1[t])), f, acc1[t]);
            else
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0[t], i1[t])), f, acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) y[(int64_t)t * ldy] = hsum8(_mm256_add_ps(acc[t], acc1[t]));
}

static void dot_q6_k_one(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 210;
            if (t == 0) prefetch_block(b, 210);
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(b + 192)), evens_odds));
            const int8_t *x8 = q + i * 256;
            __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                for (int gi = 0; gi < 4; gi++) {
                    const __m256i codes = q6k_codes(l0, l1, hb, gi);
                    const int g = 4 * h + gi;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(x8 + 32 * g));
                    const __m256i u = _mm256_sign_epi8(codes, codes), sx = _mm256_sign_epi8(x, codes);
                    const __m256i sg = _mm256_shuffle_epi8(sc, scale_pick(g));
                    if (gi & 1)
                        i1 = udot_scaled(i1, u, sx, sg);
                    else
                        i0 = udot_scaled(i0, u, sx, sg);
                }
            }
            const __m256 f = _mm256_set1_ps(_cvtsh_ss(ld16(b + 208)) * s[8 * i]);
            if (i & 1)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), f, acc1);
            else
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), f, acc);
        }
        y[(int64_t)t * ldy] = hsum8(_mm256_add_ps(acc, acc1));
    }
}

/* Q6_K: two halves of 128; w = d * sc16 * (q - 32), one activation scale per super-block. A group of 32
 * weights is two 16-weight sub-blocks: its pair sums (lanes 0-7 the first, 8-15 the second) are multiplied
 * by a vector holding the first sub-block's scale in the low 128 bits and the second's in the high ones
 * (the scales deinterleaved once: evens low, odds high), summed in integers, converted once per super-block.
 * Tokens four at a time (q6_k_tokens). */
static void dot_q6_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t groups = K / 32;
    int t = 0;
    for (; t + 4 <= T; t += 4)
        q6_k_tokens(row, K, xq + (int64_t)t * K, xs + (int64_t)t * groups, 4, y + (int64_t)t * ldy, ldy, t == 0);
    switch (T - t) {
    case 3: q6_k_tokens(row, K, xq + (int64_t)t * K, xs + (int64_t)t * groups, 3, y + (int64_t)t * ldy, ldy, t == 0); break;
    case 2: q6_k_tokens(row, K, xq + (int64_t)t * K, xs + (int64_t)t * groups, 2, y + (int64_t)t * ldy, ldy, t == 0); break;
    case 1: dot_q6_k_one(row, K, xq + (int64_t)t * K, xs + (int64_t)t * groups, xsum, 1, y + (int64_t)t * ldy, ldy); break;
    default: break;
    }
}

/* NVFP4: per 64 weights four unsigned-E4M3 scales, then 8 bytes per 16 weights (low nibbles weights
 * 0-7, high 8-15); w = ue4m3(d_h) / 2 * (2 e2m1(q)). Each half block is one group of 32: its two
 * 16-weight runs rearranged into weight order by one unpack of the 8-byte halves. The four scales come
 * through a table (one vector per block, times the two groups' activation scales), each group's factor
 * pair spread over the 128-bit halves by one permute; two blocks per step, four accumulators. */
static inline __m256 nvfp4_group(const uint8_t *b, int h, const int8_t *x) {
    const __m256i e2m1 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                          0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4 + 16 * h));
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    const __m256i codes = _mm256_shuffle_epi8(e2m1, _mm256_setr_m128i(_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi)));
    return _mm256_cvtepi32_ps(sdot(codes, _mm256_loadu_si256((const __m256i *)x)));
}

/* the block's four scales times its two groups' activation scales: (u0 s0, u1 s0, u2 s1, u3 s1) */
static inline __m256 nvfp4_factors(const uint8_t *b, const float *s) {
    const __m128 u = _mm_setr_ps(ue4m3_half_table[b[0]], ue4m3_half_table[b[1]], ue4m3_half_table[b[2]],
                                 ue4m3_half_table[b[3]]);
    const __m128 sx = _mm_setr_ps(s[0], s[0], s[1], s[1]);
    return _mm256_castps128_ps256(_mm_mul_ps(u, sx));
}

static void dot_nvfp4(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                      float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 64, groups = K / 32;
    const __m256i first = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), second = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 2 <= nb; i += 2) {
            const uint8_t *b = row + i * 36;
            if (t == 0) prefetch_block(b, 72);
            const __m256 f0 = nvfp4_factors(b, s + 2 * i), f1 = nvfp4_factors(b + 36, s + 2 * i + 2);
            const int8_t *x = q + 64 * i;
            a0 = _mm256_fmadd_ps(nvfp4_group(b, 0, x), _mm256_permutevar8x32_ps(f0, first), a0);
            a1 = _mm256_fmadd_ps(nvfp4_group(b, 1, x + 32), _mm256_permutevar8x32_ps(f0, second), a1);
            a2 = _mm256_fmadd_ps(nvfp4_group(b + 36, 0, x + 64), _mm256_permutevar8x32_ps(f1, first), a2);
            a3 = _mm256_fmadd_ps(nvfp4_group(b + 36, 1, x + 96), _mm256_permutevar8x32_ps(f1, second), a3);
        }
        if (i < nb) {
            const uint8_t *b = row + i * 36;
            const __m256 f0 = nvfp4_factors(b, s + 2 * i);
            a0 = _mm256_fmadd_ps(nvfp4_group(b, 0, q + 64 * i), _mm256_permutevar8x32_ps(f0, first), a0);
            a1 = _mm256_fmadd_ps(nvfp4_group(b, 1, q + 64 * i + 32), _mm256_permutevar8x32_ps(f0, second), a1);
        }
        y[(int64_t)t * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
}

/* IQ4_XS: 8 sub-blocks of 32, w = d (ls - 32) level(q); the eight 6-bit ls of a super-block decoded as one
 * vector (low nibbles from 4 bytes, high 2 bits from a 16-bit word), times d and the eight groups'
 * activation scales, stored and broadcast per group; four accumulators */
static void dot_iq4_xs(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                       float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const __m256i nib_shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), hi_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i pick = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    float fac[8] __attribute__((aligned(32)));
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 136;
            if (t == 0) prefetch_block(b, 136);
            uint32_t sl;
            memcpy(&sl, b + 4, 4);
            const __m256i lbytes = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128((int)sl)), pick);
            const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(lbytes, nib_shift), _mm256_set1_epi32(0xF));
            const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(ld16(b + 2)), hi_shift), _mm256_set1_epi32(3));
            const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
            _mm256_store_ps(fac, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(_cvtsh_ss(ld16(b)))),
                                               _mm256_loadu_ps(s + 8 * i)));
            const int8_t *x = q + i * 256;
            for (int g = 0; g < 8; g += 4) {
                const uint8_t *qs = b + 8 + 16 * g;
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sdot(_mm256_shuffle_epi8(levels, nibbles32(qs)), _mm256_loadu_si256((const __m256i *)(x + 32 * g)))),
                                     _mm256_broadcast_ss(fac + g), a0);
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sdot(_mm256_shuffle_epi8(levels, nibbles32(qs + 16)), _mm256_loadu_si256((const __m256i *)(x + 32 * g + 32)))),
                                     _mm256_broadcast_ss(fac + g + 1), a1);
                a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sdot(_mm256_shuffle_epi8(levels, nibbles32(qs + 32)), _mm256_loadu_si256((const __m256i *)(x + 32 * g + 64)))),
                                     _mm256_broadcast_ss(fac + g + 2), a2);
                a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sdot(_mm256_shuffle_epi8(levels, nibbles32(qs + 48)), _mm256_loadu_si256((const __m256i *)(x + 32 * g + 96)))),
                                     _mm256_broadcast_ss(fac + g + 3), a3);
            }
        }
        y[(int64_t)t * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
}

/* Q2_K: two halves of 128, 2-bit codes at shifts 0/2/4/6; per 16 weights w = d sc q - dmin m (4-bit sc and
 * m), one activation scale per super-block. As Q6_K: a group of 32 is two 16-weight sub-blocks, their
 * scales (and mins) deinterleaved once into a vector whose low 128 bits hold the even sub-blocks', high
 * the odd ones'; the code products and the activation sums (for the mins) are multiplied by them in
 * integers and converted once per super-block. */
static void dot_q2_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i m2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi8(1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 84;
            if (t == 0) prefetch_block(b, 84);
            const __m128i eo = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)b), evens_odds);
            const __m256i sc = _mm256_cvtepu8_epi16(_mm_and_si128(eo, _mm_set1_epi8(0x0F)));
            const __m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(eo, 4), _mm_set1_epi8(0x0F)));
            __m256i isum = _mm256_setzero_si256(), msum = _mm256_setzero_si256();
            for (int n = 0; n < 2; n++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * n));
                for (int j = 0; j < 4; j++) {
                    const int g = 4 * n + j;
                    const __m256i codes = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * j), m2);
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(q + i * 256 + 32 * g));
                    const __m256i pick = scale_pick(g);
                    isum = udot_scaled(isum, codes, x, _mm256_shuffle_epi8(sc, pick));
                    msum = udot_scaled(msum, ones, x, _mm256_shuffle_epi8(mn, pick));
                }
            }
            const float f = s[8 * i];
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(_cvtsh_ss(ld16(b + 80)) * f), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(_cvtsh_ss(ld16(b + 82)) * f), acc);
        }
        y[(int64_t)t * ldy] = hsum8(acc);
    }
}

/* Q3_K: as Q2_K's codes, minus 4 where the hmask bit is clear; per 16 weights w = d (sc - 32) q, the sixteen
 * 6-bit scales decoded from three words at once, deinterleaved and multiplied in integers as in Q2_K */
static void dot_q3_k(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                     float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 256, groups = K / 32;
    const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = row + i * 110;
            if (t == 0) prefetch_block(b, 110);
            uint32_t w[3];
            memcpy(w, b + 96, 12);
            const uint32_t lo4 = 0x0F0F0F0Fu, hi2 = 0x03030303u;
            const __m128i raw = _mm_setr_epi32((int)((w[0] & lo4) | ((w[2] & hi2) << 4)),
                                               (int)((w[1] & lo4) | (((w[2] >> 2) & hi2) << 4)),
                                               (int)(((w[0] >> 4) & lo4) | (((w[2] >> 4) & hi2) << 4)),
                                               (int)(((w[1] >> 4) & lo4) | (((w[2] >> 6) & hi2) << 4)));
            const __m128i sc8 = _mm_sub_epi8(raw, _mm_set1_epi8(32));
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, evens_odds));
            const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
            __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
            for (int n = 0; n < 2; n++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * n));
                for (int j = 0; j < 4; j++) {
                    const int g = 4 * n + j;
                    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * j), m2);
                    const __m256i clear = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(hm, g), one), one);
                    const __m256i codes = _mm256_sub_epi8(low, _mm256_slli_epi16(clear, 2));
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(q + i * 256 + 32 * g));
                    const __m256i u = _mm256_sign_epi8(codes, codes), sx = _mm256_sign_epi8(x, codes);
                    const __m256i sg = _mm256_shuffle_epi8(sc, scale_pick(g));
                    if (j & 1)
                        i1 = udot_scaled(i1, u, sx, sg);
                    else
                        i0 = udot_scaled(i0, u, sx, sg);
                }
            }
            const __m256 f = _mm256_set1_ps(_cvtsh_ss(ld16(b + 108)) * s[8 * i]);
            if (i & 1)
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), f, acc1);
            else
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(i0, i1)), f, acc);
        }
        y[(int64_t)t * ldy] = hsum8(_mm256_add_ps(acc, acc1));
    }
}

#if !GGML_VNNI256  /* built once */

/* ---- rows -> bf16 (prefill GEMMs) ---- */

/* 8 floats -> bf16 bits (round to nearest even; the weights are finite) in the low 16 of each lane */
static inline __m256i bf16_bits(__m256 f) {
    const __m256i b = _mm256_castps_si256(f);
    const __m256i r = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)),
                                       _mm256_set1_epi32(0x7FFF));
    return _mm256_srli_epi32(_mm256_add_epi32(b, r), 16);
}

/* 32 int8 codes -> scale_h * code (+ min_h) (h: first / second 16 weights), in the torch decoders' order (a product,
 * then a sum where the type has a min: no fused multiply-add, so the float32 values are theirs bit for bit), stored
 * as float32 (f32) or rounded to bf16 */
static inline void store32(void *o, int f32, __m256i codes, float s0, float m0, float s1, float m1, int has_min) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    __m256 f[4];
    for (int i = 0; i < 4; i++) {
        const float s = i < 2 ? s0 : s1, m = i < 2 ? m0 : m1;
        f[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])), _mm256_set1_ps(s));
        if (has_min) f[i] = _mm256_add_ps(f[i], _mm256_set1_ps(m));
    }
    if (f32) {
        for (int i = 0; i < 4; i++) _mm256_storeu_ps((float *)o + 8 * i, f[i]);
        return;
    }
    __m256i bits[4];
    for (int i = 0; i < 4; i++) bits[i] = bf16_bits(f[i]);
    const __m256i a = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[0], bits[1]), 0xD8);
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[2], bits[3]), 0xD8);
    _mm256_storeu_si256((__m256i *)o, a);
    _mm256_storeu_si256((__m256i *)((uint16_t *)o + 16), b);
}

/* one row of Q4_K / Q5_K / Q6_K / Q8_0 to bf16 (f32 = 0) or float32 (f32 = 1), weight k at element k of o; 0 when the
 * type has no AVX2 decoder here */
int moed_ggml_row_decode_avx2(int type, const uint8_t *row, int64_t K, void *o, int f32) {
    const size_t elem = f32 ? 4 : 2;
    if (type == MOED_GGML_Q8_0) {
        for (int64_t g = 0; g < K / 32; g++) {
            const uint8_t *b = row + g * 34;
            const float d = f16x(b);
            store32((char *)o + elem * (size_t)(g * 32), f32, _mm256_loadu_si256((const __m256i *)(b + 2)), d, 0.0f, d, 0.0f, 0);
        }
        return 1;
    }
    if (type == MOED_GGML_Q4_K || type == MOED_GGML_Q5_K) {
        const int k5 = type == MOED_GGML_Q5_K;
        for (int64_t i = 0; i < K / 256; i++) {
            const uint8_t *b = row + i * (k5 ? 176 : 144);
            const float d = f16x(b), dmin = f16x(b + 2);
            const uint8_t *qs = b + (k5 ? 48 : 16);
            __m256i qh = k5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i lo, hi;
                q45k_pair(k5, qs, c, &qh, &lo, &hi);
                for (int half = 0; half < 2; half++) {
                    int sc, m;
                    k_scale_min_1(b + 4, 2 * c + half, &sc, &m);
                    const float s = d * (float)sc, mn = -(dmin * (float)m);
                    store32((char *)o + elem * (size_t)(i * 256 + 64 * c + 32 * half), f32, half ? hi : lo, s, mn, s, mn, 1);
                }
            }
        }
        return 1;
    }
    if (type == MOED_GGML_Q6_K) {
        for (int64_t i = 0; i < K / 256; i++) {
            const uint8_t *b = row + i * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = f16x(b + 208);
            for (int h = 0; h < 2; h++) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                for (int gi = 0; gi < 4; gi++) {
                    const __m256i codes = q6k_codes(l0, l1, hb, gi);
                    const int g = 4 * h + gi;
                    store32((char *)o + elem * (size_t)(i * 256 + 32 * g), f32, codes, d * (float)sc[2 * g], 0.0f, d * (float)sc[2 * g + 1],
                            0.0f, 0);
                }
            }
        }
        return 1;
    }
    return 0;
}

#endif  /* !GGML_VNNI256 */

#pragma GCC pop_options

moed_ggml_dot_fn GGML_AVX2_DOT(int type) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_tables);
    switch (type) {
    case MOED_GGML_Q4_K: return dot_q4_k;
    case MOED_GGML_Q5_K: return dot_q5_k;
    case MOED_GGML_Q6_K: return dot_q6_k;
    case MOED_GGML_Q8_0: return dot_q8_0;
    case MOED_GGML_Q4_0: return dot_q4_0;
    case MOED_GGML_Q4_1: return dot_q4_1;
    case MOED_GGML_IQ4_NL: return dot_iq4_nl;
    case MOED_GGML_Q5_0: return dot_q5_0;
    case MOED_GGML_Q5_1: return dot_q5_1;
    case MOED_GGML_MXFP4: return dot_mxfp4;
    case MOED_GGML_NVFP4: return dot_nvfp4;
    case MOED_GGML_IQ4_XS: return dot_iq4_xs;
    case MOED_GGML_Q2_K: return dot_q2_k;
    case MOED_GGML_Q3_K: return dot_q3_k;
    default: return NULL;
    }
}

#else

moed_ggml_dot_fn GGML_AVX2_DOT(int type) {
    (void)type;
    return NULL;
}

#if !GGML_VNNI256
int moed_ggml_row_decode_avx2(int type, const uint8_t *row, int64_t K, void *o, int f32) {
    (void)type; (void)row; (void)K; (void)o; (void)f32;
    return 0;
}

#endif

#endif
