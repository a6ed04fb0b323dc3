/* AVX2 kernels of the x8 layouts (ggml_x8.h): eight rows per call, one 32-bit lane per row.
 *
 * Per 32-byte load: 4 codes of each of 8 rows in the low nibbles and 4 more in the high ones; each half
 * times one broadcast of 4 activations (vpmaddubsw: unsigned codes 0..15 times int8, pairs summed to
 * int16), eight such products summed in int16 (8 * 2 * 15 * 127 < 2^15) and widened once per 32
 * weights by vpmaddwd against 1 (Q4_0) or against the sub-block's integer scale (Q4_K). Q4_0 then takes
 * one conversion and two multiply-adds per 8 rows x 32 weights; Q4_K one of each per 8 rows x 256
 * weights, its mins summed in integers against the activations' sub-block sums. MXFP4 is Q4_0's with its
 * codes through a table and its E8M0 scales made in integers; Q4_1 Q4_0's with its m times the activation
 * sums; Q5_K Q4_K's with the fifth bits OR-ed in (four products a sum). The signed codes (Q8_0, the IQ4
 * levels) go through vpmaddubsw as |code| times the activation with the code's sign, each product widened
 * (IQ4_XS against its sub-block scale). */
#include <string.h>

#include "ggml_rows.h"
#include "ggml_x8.h"
#include "moed_cpu.h"

#if MOED_X86
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#ifndef GGML_X8_PF
#define GGML_X8_PF 8192
#endif

static inline void prefetch(const uint8_t *p, int bytes) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + GGML_X8_PF + l, _MM_HINT_T1);
}

/* four int8 activations as every 32-bit lane */
static inline __m256i act4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* a prefill call's T > 1 tokens through a kernel's NT-token form: EXPR (using t_, the first token, and nt_, a
 * constant count) for each four tokens, then once for the rest */
#define X8_TOKEN_TILES(T, EXPR)                                                                 \
    do {                                                                                        \
        int t_ = 0;                                                                             \
        for (; t_ + 4 <= (T); t_ += 4) { const int nt_ = 4; EXPR; }                             \
        switch ((T) - t_) {                                                                     \
        case 3: { const int nt_ = 3; EXPR; break; }                                             \
        case 2: { const int nt_ = 2; EXPR; break; }                                             \
        case 1: { const int nt_ = 1; EXPR; break; }                                             \
        default: break;                                                                         \
        }                                                                                       \
    } while (0)

/* the int16 pair sums of 32 bytes of nibbles: low nibbles times a4lo, high nibbles times a4hi, added to lo / hi */
static inline void nibble_products(const uint8_t *p, __m256i a4lo, __m256i a4hi, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_add_epi16(*lo, _mm256_maddubs_epi16(_mm256_and_si256(v, m4), a4lo));
    *hi = _mm256_add_epi16(*hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), a4hi));
}

/* MXFP4: the codes are E2M1 values doubled plus 12 through a table (unsigned 0..24: vpmaddubsw's unsigned
 * side; the 12 comes back as a min term), four products of a half summed in int16 (4 * 2 * 24 * 127 < 2^15),
 * the scale 2^(e - 128) (with the 1/2 of the doubled codes) made from the 8 exponent bytes in integers */
static inline __m256 e8m0_half8(const uint8_t *e8) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);  /* e = 0, 1: 2^-128, 2^-127 */
    return _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}

/* the fifth bits (Q5_0, Q5_1, Q5_K): bit `bit` of each qh byte as 16 */
static inline __m256i fifth_bit(__m256i qh, int bit) {
    const __m256i m16 = _mm256_set1_epi8(16);
    if (bit < 4) return _mm256_and_si256(_mm256_slli_epi16(qh, 4 - bit), m16);
    return _mm256_and_si256(_mm256_srli_epi16(qh, bit - 4), m16);
}

/* per kind of dot8_b32 (Q4_0, MXFP4, Q4_1, Q5_0, Q5_1): x8 block bytes, head bytes before the codes, code offset */
static const int b32_bytes[5] = {144, 136, 160, 176, 192}, b32_head[5] = {16, 8, 32, 48, 64};
static const float b32_min[5] = {-8.0f, -12.0f, 0.0f, -16.0f, 0.0f};

/* MXFP4's E2M1 codes as doubled values plus 12 (unsigned 0..24), by nibble */
static inline __m256i e2m1_offset_codes(void) {
    return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
}

/* dot8_b32 for NT tokens at once (prefill, NT a constant after inlining, at most 4): each block's codes and scale
 * decoded once, per token only the products, sums and its float terms, in dot8_b32's order (the same floats) */
static inline __attribute__((always_inline)) void dot8_b32_tokens(int kind, const uint8_t *g, int64_t K,
                                                                  const int8_t *xq, const float *xs, const float *xsum,
                                                                  const int NT, float *y, int64_t ldy, int first) {
    const int64_t nb = K / 32;
    const int mx = kind == 1, with_m = kind == 2 || kind == 4, five = kind >= 3;
    const int bytes = b32_bytes[kind], head = b32_head[kind];
    const float min = b32_min[kind];
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F), e2m1u = e2m1_offset_codes();
    __m256 acc0[4], acc1[4];
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = g + b * bytes;
        if (first) prefetch(o, bytes);
        __m256i lo[4], hi[4];
        for (int t = 0; t < NT; t++) lo[t] = hi[t] = _mm256_setzero_si256();
        const __m256i H = five ? _mm256_loadu_si256((const __m256i *)(o + head - 32)) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(o + head + 32 * c));
            __m256i l = _mm256_and_si256(v, m4), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                l = _mm256_or_si256(l, fifth_bit(H, c));
                h = _mm256_or_si256(h, fifth_bit(H, 4 + c));
            } else if (mx) {
                l = _mm256_shuffle_epi8(e2m1u, l);
                h = _mm256_shuffle_epi8(e2m1u, h);
            }
            for (int t = 0; t < NT; t++) {
                const int8_t *x = xq + (int64_t)t * K + 32 * b;
                lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(l, act4(x + 4 * c)));
                hi[t] = _mm256_add_epi16(hi[t], _mm256_maddubs_epi16(h, act4(x + 16 + 4 * c)));
            }
        }
        const __m256 d = mx ? e8m0_half8(o) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        const __m256 m = with_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16))) : _mm256_setzero_ps();
        for (int t = 0; t < NT; t++) {
            const float *s = xs + (int64_t)t * nb, *su = xsum + (int64_t)t * nb;
            const __m256i sum = mx || five ? _mm256_add_epi32(_mm256_madd_epi16(lo[t], ones), _mm256_madd_epi16(hi[t], ones))
                                           : _mm256_madd_epi16(_mm256_add_epi16(lo[t], hi[t]), ones);
            const __m256 inner = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(s + b),
                                                 _mm256_set1_ps(min * su[b]));
            if (b & 1) acc1[t] = _mm256_fmadd_ps(d, inner, acc1[t]);
            else acc0[t] = _mm256_fmadd_ps(d, inner, acc0[t]);
            if (with_m) acc1[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(su[b]), acc1[t]);
        }
    }
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + (int64_t)t * ldy, _mm256_add_ps(acc0[t], acc1[t]));
}

/* the 32-weight types with unsigned codes, Q4_0 (kind 0), MXFP4 (1), Q4_1 (2), Q5_0 (3) and Q5_1 (4): per 8 rows
 * x 32 weights, d * (xs * sum(code * xq) + min * xsum) + m * xsum with w = d * (code + min) + m: min -8 (Q4_0),
 * -12 (MXFP4's offset codes), -16 (Q5_0) or 0, m Q4_1's and Q5_1's. Q5_0/Q5_1's fifth bits: 32 bytes, byte
 * 4 r + j bit c the low nibble's of chunk c, bit 4 + c the high one's */
static inline void dot8_b32(int kind, const uint8_t *g, int64_t K, const int8_t *xq, const float *xs,
                            const float *xsum, int T, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    if (T > 1) {
        X8_TOKEN_TILES(T, dot8_b32_tokens(kind, g, K, xq + (int64_t)t_ * K, xs + (int64_t)t_ * nb, xsum + (int64_t)t_ * nb,
                                          nt_, y + (int64_t)t_ * ldy, ldy, t_ == 0));
        return;
    }
    const int mx = kind == 1, with_m = kind == 2 || kind == 4, five = kind >= 3;
    const int bytes = b32_bytes[kind], head = b32_head[kind];
    const float min = b32_min[kind];
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F), e2m1u = e2m1_offset_codes();
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * nb, *su = xsum + (int64_t)t * nb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = g + b * bytes;
            const int8_t *x = q + 32 * b;
            if (t == 0) prefetch(o, bytes);
            __m256i lo = _mm256_setzero_si256(), hi = lo;
            if (five) {  /* four products of 5-bit codes a sum (4 * 2 * 31 * 127 < 2^15) */
                const __m256i H = _mm256_loadu_si256((const __m256i *)(o + head - 32));
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(o + head + 32 * c));
                    lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_or_si256(_mm256_and_si256(v, m4), fifth_bit(H, c)),
                                                                   act4(x + 4 * c)));
                    hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(
                                                  _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), fifth_bit(H, 4 + c)),
                                                  act4(x + 16 + 4 * c)));
                }
            }
            for (int c = 0; c < 4 && !five; c++) {
                if (!mx) {
                    nibble_products(o + head + 32 * c, act4(x + 4 * c), act4(x + 16 + 4 * c), &lo, &hi);
                    continue;
                }
                const __m256i v = _mm256_loadu_si256((const __m256i *)(o + head + 32 * c));
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_shuffle_epi8(e2m1u, _mm256_and_si256(v, m4)),
                                                               act4(x + 4 * c)));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(
                                              _mm256_shuffle_epi8(e2m1u, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)),
                                              act4(x + 16 + 4 * c)));
            }
            /* Q4_0's eight products fit int16 together (8 * 2 * 15 * 127), MXFP4's four per half */
            const __m256i sum = mx || five ? _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
                                   : _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
            const __m256 inner = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(s + b),
                                                 _mm256_set1_ps(min * su[b]));
            const __m256 d = mx ? e8m0_half8(o) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
            if (b & 1) acc1 = _mm256_fmadd_ps(d, inner, acc1);
            else acc0 = _mm256_fmadd_ps(d, inner, acc0);
            if (with_m) acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16))),
                                            _mm256_set1_ps(su[b]), acc1);
        }
        _mm256_storeu_ps(y + (int64_t)t * ldy, _mm256_add_ps(acc0, acc1));
    }
}

/* the signed products of 32 bytes of IQ4 nibbles through the level table, low nibbles times a4lo and high
 * times a4hi, widened against w16 (ones, or IQ4_XS's sub-block scale) and added to sum: |level| times the
 * activation with the level's sign (a pair sum fits int16, two do not: each is widened) */
static inline __m256i iq4_products(const uint8_t *p, __m256i a4lo, __m256i a4hi, __m256i w16, __m256i sum) {
    const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, m4)),
                  hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(a4lo, lo)), w16));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(a4hi, hi)), w16));
}

/* dot8_signed for NT tokens at once (prefill): each chunk's |code| (Q8_0) or levels (IQ4_NL) decoded once, per token
 * the activations' signs, products and sums, in dot8_signed's order (the same floats) */
static inline __attribute__((always_inline)) void dot8_signed_tokens(int q8, const uint8_t *g, int64_t K,
                                                                     const int8_t *xq, const float *xs, const int NT,
                                                                     float *y, int64_t ldy, int first) {
    const int64_t nb = K / 32, bytes = q8 ? 272 : 144;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    __m256 acc0[4], acc1[4];
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = g + b * bytes;
        if (first) prefetch(o, (int)bytes);
        __m256i sum0[4], sum1[4];
        for (int t = 0; t < NT; t++) sum0[t] = sum1[t] = _mm256_setzero_si256();
        for (int c = 0; c < (q8 ? 8 : 4); c += (q8 ? 2 : 1)) {
            /* Q8_0: chunks c and c + 1 (activations 4c and 4c + 4); IQ4_NL: chunk c's low and high nibbles
             * (activations 4c and 16 + 4c) */
            __m256i w0, w1;
            int a0, a1;
            if (q8) {
                w0 = _mm256_loadu_si256((const __m256i *)(o + 16 + 32 * c));
                w1 = _mm256_loadu_si256((const __m256i *)(o + 48 + 32 * c));
                a0 = 4 * c, a1 = 4 * c + 4;
            } else {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(o + 16 + 32 * c));
                w0 = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, m4));
                w1 = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                a0 = 4 * c, a1 = 16 + 4 * c;
            }
            const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
            for (int t = 0; t < NT; t++) {
                const int8_t *x = xq + (int64_t)t * K + 32 * b;
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(act4(x + a0), w0)), ones),
                              p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(act4(x + a1), w1)), ones);
                if (q8) {
                    sum0[t] = _mm256_add_epi32(sum0[t], p0);
                    sum1[t] = _mm256_add_epi32(sum1[t], p1);
                } else {  /* iq4_products' order: low then high into one sum */
                    sum0[t] = _mm256_add_epi32(_mm256_add_epi32(sum0[t], p0), p1);
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        for (int t = 0; t < NT; t++) {
            const __m256 inner = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sum0[t], sum1[t])),
                                               _mm256_broadcast_ss(xs + (int64_t)t * nb + b));
            if (b & 1) acc1[t] = _mm256_fmadd_ps(d, inner, acc1[t]);
            else acc0[t] = _mm256_fmadd_ps(d, inner, acc0[t]);
        }
    }
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + (int64_t)t * ldy, _mm256_add_ps(acc0[t], acc1[t]));
}

/* the signed-code 32-weight types, IQ4_NL (q8 0: Q4_0's layout, w = d * level(code)) and Q8_0 (q8 1): per 8 rows
 * x 32 weights, d * xs * sum(code * xq); Q8_0's codes through vpmaddubsw as |code| times the activation with the
 * code's sign (|code| <= 128, |xq| <= 127: a pair sum fits int16), as the IQ4 levels are */
static inline void dot8_signed(int q8, const uint8_t *g, int64_t K, const int8_t *xq, const float *xs,
                               const float *xsum, int T, float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 32, bytes = q8 ? 272 : 144;
    if (T > 1) {
        X8_TOKEN_TILES(T, dot8_signed_tokens(q8, g, K, xq + (int64_t)t_ * K, xs + (int64_t)t_ * nb, nt_,
                                             y + (int64_t)t_ * ldy, ldy, t_ == 0));
        return;
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * nb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = g + b * bytes;
            const int8_t *x = q + 32 * b;
            if (t == 0) prefetch(o, (int)bytes);
            __m256i sum0 = _mm256_setzero_si256(), sum1 = sum0;
            for (int c = 0; c < 8 && q8; c += 2) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(o + 16 + 32 * c)),
                              w1 = _mm256_loadu_si256((const __m256i *)(o + 48 + 32 * c));
                sum0 = _mm256_add_epi32(sum0, _mm256_madd_epi16(
                                                  _mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(act4(x + 4 * c), w0)), ones));
                sum1 = _mm256_add_epi32(sum1, _mm256_madd_epi16(
                                                  _mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(act4(x + 4 * c + 4), w1)), ones));
            }
            for (int c = 0; c < 4 && !q8; c++)
                sum0 = iq4_products(o + 16 + 32 * c, act4(x + 4 * c), act4(x + 16 + 4 * c), ones, sum0);
            const __m256 inner = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sum0, sum1)), _mm256_broadcast_ss(s + b));
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
            if (b & 1) acc1 = _mm256_fmadd_ps(d, inner, acc1);
            else acc0 = _mm256_fmadd_ps(d, inner, acc0);
        }
        _mm256_storeu_ps(y + (int64_t)t * ldy, _mm256_add_ps(acc0, acc1));
    }
}

/* vpshufb masks (the same in both 128-bit halves, rows 0-3 and 4-7): the scale of sub-block s_ (bytes
 * 4 s_ + r_ of a 16-byte half) into both 16-bit halves of lane r_, and the mins of sub-blocks s_, s_ + 1
 * into the low / high 16 bits */
static inline __m256i scale_mask(int s_) {
    const char a = (char)(4 * s_);
    return _mm256_setr_epi8(a, -1, a, -1, a + 1, -1, a + 1, -1, a + 2, -1, a + 2, -1, a + 3, -1, a + 3, -1,
                            a, -1, a, -1, a + 1, -1, a + 1, -1, a + 2, -1, a + 2, -1, a + 3, -1, a + 3, -1);
}

static inline __m256i min_pair_mask(int s_) {
    const char a = (char)(4 * s_), b = (char)(4 * s_ + 4);
    return _mm256_setr_epi8(a, -1, b, -1, a + 1, -1, b + 1, -1, a + 2, -1, b + 2, -1, a + 3, -1, b + 3, -1,
                            a, -1, b, -1, a + 1, -1, b + 1, -1, a + 2, -1, b + 2, -1, a + 3, -1, b + 3, -1);
}

/* IQ4_XS x8: the 6-bit ls of 8 rows x 8 sub-blocks, a byte each: sub-blocks 0-3 in lo, 4-7 in hi */
static inline void iq4_xs8_scales(const uint8_t *B, __m256i *ls_lo, __m256i *ls_hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12),
                  half_shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i L = _mm256_loadu_si256((const __m256i *)(B + 16));
    const __m256i H = _mm256_srlv_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(B + 48))),
                                        half_shift);
    *ls_lo = _mm256_or_si256(_mm256_and_si256(L, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
    *ls_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), m4), _mm256_slli_epi16(_mm256_and_si256(H, m12), 2));
}

/* dot8_iq4_xs for NT tokens at once (prefill): the scales and each chunk's levels decoded once, per token the
 * activations' signs, products and sums, in dot8_iq4_xs's order (the same floats) */
static inline __attribute__((always_inline)) void dot8_iq4_xs_tokens(const uint8_t *g, int64_t K, const int8_t *xq,
                                                                     const float *xs, const int NT, float *y,
                                                                     int64_t ldy, int first) {
    const int64_t nsb = K / 256, groups = K / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), k32 = _mm256_set1_epi16(32);
    const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    const __m256i sm[4] = {scale_mask(0), scale_mask(1), scale_mask(2), scale_mask(3)};
    __m256 acc[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *B = g + sb * 1088;
        if (first) prefetch(B, 1088);
        __m256i ls_lo, ls_hi;
        iq4_xs8_scales(B, &ls_lo, &ls_hi);
        __m256 part[4];
        for (int t = 0; t < NT; t++) part[t] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int sub = 0; sub < 8; sub++) {
            const __m256i sc = _mm256_sub_epi16(_mm256_shuffle_epi8(sub < 4 ? ls_lo : ls_hi, sm[sub & 3]), k32);
            const uint8_t *Q = B + 64 + 128 * sub;
            __m256i sum[4];
            for (int t = 0; t < NT; t++) sum[t] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(Q + 32 * c));
                const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, m4)),
                              hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                const __m256i ulo = _mm256_abs_epi8(lo), uhi = _mm256_abs_epi8(hi);
                for (int t = 0; t < NT; t++) {  /* iq4_products' order */
                    const int8_t *xx = xq + (int64_t)t * K + 256 * sb + 32 * sub;
                    sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(
                                                          _mm256_maddubs_epi16(ulo, _mm256_sign_epi8(act4(xx + 4 * c), lo)), sc));
                    sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(
                                                          _mm256_maddubs_epi16(uhi, _mm256_sign_epi8(act4(xx + 16 + 4 * c), hi)), sc));
                }
            }
            for (int t = 0; t < NT; t++)
                part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]),
                                          _mm256_broadcast_ss(xs + (int64_t)t * groups + 8 * sb + sub), part[t]);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)B));
        for (int t = 0; t < NT; t++) acc[t] = _mm256_fmadd_ps(d, part[t], acc[t]);
    }
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + (int64_t)t * ldy, acc[t]);
}

/* IQ4_XS: per sub-block of 8 rows x 32 weights, its products widened against (ls - 32) of each row, converted
 * and times the sub-block's activation scale; d once per super-block */
static void dot8_iq4_xs(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                        float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nsb = K / 256, groups = K / 32;
    if (T > 1) {
        X8_TOKEN_TILES(T, dot8_iq4_xs_tokens(g, K, xq + (int64_t)t_ * K, xs + (int64_t)t_ * groups, nt_,
                                             y + (int64_t)t_ * ldy, ldy, t_ == 0));
        return;
    }
    const __m256i k32 = _mm256_set1_epi16(32);
    const __m256i sm[4] = {scale_mask(0), scale_mask(1), scale_mask(2), scale_mask(3)};
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *B = g + sb * 1088;
            if (t == 0) prefetch(B, 1088);
            __m256i ls_lo, ls_hi;
            iq4_xs8_scales(B, &ls_lo, &ls_hi);
            const int8_t *x = q + 256 * sb;
            __m256 part = _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int sub = 0; sub < 8; sub++) {
                const __m256i sc = _mm256_sub_epi16(_mm256_shuffle_epi8(sub < 4 ? ls_lo : ls_hi, sm[sub & 3]), k32);
                const uint8_t *Q = B + 64 + 128 * sub;
                const int8_t *xx = x + 32 * sub;
                __m256i sum = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) sum = iq4_products(Q + 32 * c, act4(xx + 4 * c), act4(xx + 16 + 4 * c), sc, sum);
                part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(s + 8 * sb + sub), part);
            }
            acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)B)), part, acc);
        }
        _mm256_storeu_ps(y + (int64_t)t * ldy, acc);
    }
}

/* NVFP4's unsigned E4M3 scale bytes of 8 rows times 1/2, as moed_ue4m3_half (ggml_rows.h) reads them */
static inline __m256 ue4m3_half8(const uint8_t *p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i v = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(119 << 3)), 20));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(0.0009765625f));
    const __m256 f = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), v)));
    return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, _mm256_set1_epi32(0x7F))), f);
}

/* NVFP4: per 16-weight sub-block of 8 rows, two 32-byte loads of doubled E2M1 codes (signed, |code| x the
 * activation with its sign; sixteen products' pair sums fit int16), one widening, and its eight scales
 * times the group's activation scale */
static void dot8_nvfp4(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                       float *y, int64_t ldy) {
    (void)xsum;
    const int64_t nb = K / 64;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    const __m256i e2m1 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                          0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * (K / 32);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = g + b * 288;
            if (t == 0) prefetch(o, 288);
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                const int8_t *x = q + 64 * b + 16 * h;
                __m256i p16 = _mm256_setzero_si256();
                for (int c = 0; c < 2; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(o + 32 + 64 * h + 32 * c));
                    const __m256i lo = _mm256_shuffle_epi8(e2m1, _mm256_and_si256(v, m4)),
                                  hi = _mm256_shuffle_epi8(e2m1, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(act4(x + 4 * c), lo)));
                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(act4(x + 8 + 4 * c), hi)));
                }
                const __m256 f = _mm256_mul_ps(ue4m3_half8(o + 8 * h), _mm256_broadcast_ss(s + 2 * b + h / 2));
                if (h & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), f, acc1);
                else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), f, acc0);
            }
        }
        _mm256_storeu_ps(y + (int64_t)t * ldy, _mm256_add_ps(acc0, acc1));
    }
}

/* Q4_K / Q5_K x8: the 6-bit scales and mins of 8 rows x 8 sub-blocks, one byte each (sc_a / mn_a sub-blocks 0-3,
 * sc_b / mn_b 4-7) */
static inline void k8_scales_mins(const uint8_t *B, __m256i *sc_a, __m256i *sc_b, __m256i *mn_a, __m256i *mn_b) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12),
                  m48 = _mm256_set1_epi8(48);
    const __m256i A0 = _mm256_loadu_si256((const __m256i *)(B + 32)), A1 = _mm256_loadu_si256((const __m256i *)(B + 64)),
                  H = _mm256_loadu_si256((const __m256i *)(B + 96));
    *sc_a = _mm256_or_si256(_mm256_and_si256(A0, m4), _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
    *sc_b = _mm256_or_si256(_mm256_and_si256(A1, m4), _mm256_and_si256(H, m48));
    *mn_a = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(H, m12), 2));
    *mn_b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m48));
}

/* the 8 rows' sum over sub-blocks of min x (the sub-block's integer activation sum: xsum / xs, one scale per 256
 * values), the activation sums as int16 pairs (sub-blocks 2i, 2i + 1) */
static inline __m256i k8_min_sums(__m256i mn_a, __m256i mn_b, float xs0, const float *su) {
    const __m256i mp0 = min_pair_mask(0), mp2 = min_pair_mask(2);
    const __m256 inv = _mm256_set1_ps(xs0 > 0.0f ? 1.0f / xs0 : 0.0f);
    const __m256i bs = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(su), inv));
    const __m256i bp = _mm256_packs_epi32(bs, bs); /* per half: b0 b1 b2 b3 b0 b1 b2 b3 | b4 .. b7 .. */
    return _mm256_add_epi32(
        _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_shuffle_epi8(mn_a, mp0), _mm256_permutevar8x32_epi32(bp, _mm256_set1_epi32(0))),
            _mm256_madd_epi16(_mm256_shuffle_epi8(mn_a, mp2), _mm256_permutevar8x32_epi32(bp, _mm256_set1_epi32(1)))),
        _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_shuffle_epi8(mn_b, mp0), _mm256_permutevar8x32_epi32(bp, _mm256_set1_epi32(4))),
            _mm256_madd_epi16(_mm256_shuffle_epi8(mn_b, mp2), _mm256_permutevar8x32_epi32(bp, _mm256_set1_epi32(5)))));
}

/* NT tokens (a constant after inlining) of Q4_K / Q5_K x8 at once (prefill: an expert's tokens of a chunk): the
 * scales, mins and codes of each sub-block decoded once, and per token only its activation sums' min term, the
 * products and the sums. Each token's integer sums and float additions are in dot8_k's order (the same floats). */
static inline __attribute__((always_inline)) void dot8_k_tokens(int five, const uint8_t *g, int64_t K,
                                                                const int8_t *xq, const float *xs, const float *xsum,
                                                                const int NT, float *y, int64_t ldy, int first) {
    const int64_t nsb = K / 256, groups = K / 32;
    const int64_t bytes = five ? 1408 : 1152, at = five ? 384 : 128;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i sm0 = scale_mask(0), sm1 = scale_mask(1), sm2 = scale_mask(2), sm3 = scale_mask(3);
    __m256 acc[4];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *B = g + sb * bytes;
        if (first) prefetch(B, (int)bytes);
        __m256i sc_a, sc_b, mn_a, mn_b;
        k8_scales_mins(B, &sc_a, &sc_b, &mn_a, &mn_b);
        __m256i msum[4], isum[4];
        for (int t = 0; t < NT; t++) {
            msum[t] = k8_min_sums(mn_a, mn_b, xs[(int64_t)t * groups + 8 * sb], xsum + (int64_t)t * groups + 8 * sb);
            isum[t] = _mm256_setzero_si256();
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const uint8_t *Q = B + at + 256 * p;
            const int64_t xo = 256 * sb + 64 * p;
            const __m256i sc = p < 2 ? sc_a : sc_b;
            const __m256i slo = _mm256_shuffle_epi8(sc, (p & 1) ? sm2 : sm0),
                          shi = _mm256_shuffle_epi8(sc, (p & 1) ? sm3 : sm1);
            for (int c0 = 0; c0 < 8; c0 += five ? 4 : 8) {  /* 4-bit codes: eight products an int16 sum, 5-bit four */
                __m256i lo[4], hi[4];
                for (int t = 0; t < NT; t++) lo[t] = hi[t] = _mm256_setzero_si256();
                for (int c = c0; c < c0 + (five ? 4 : 8); c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(Q + 32 * c));
                    __m256i l, h;
                    if (five) {
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(B + 128 + 32 * c));
                        l = _mm256_or_si256(_mm256_and_si256(v, m4), fifth_bit(qh, 2 * p));
                        h = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), fifth_bit(qh, 2 * p + 1));
                    } else {
                        l = _mm256_and_si256(v, m4);
                        h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                    for (int t = 0; t < NT; t++) {
                        const int8_t *x = xq + (int64_t)t * K + xo;
                        lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(l, act4(x + 4 * c)));
                        hi[t] = _mm256_add_epi16(hi[t], _mm256_maddubs_epi16(h, act4(x + 32 + 4 * c)));
                    }
                }
                for (int t = 0; t < NT; t++)
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(lo[t], slo),
                                                                         _mm256_madd_epi16(hi[t], shi)));
            }
        }
        const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)B)),
                     dmh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(B + 16)));
        for (int t = 0; t < NT; t++) {
            const __m256 xv = _mm256_set1_ps(xs[(int64_t)t * groups + 8 * sb]);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dh, xv), _mm256_cvtepi32_ps(isum[t]), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmh, xv), _mm256_cvtepi32_ps(msum[t]), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + (int64_t)t * ldy, acc[t]);
}

/* Q4_K (five 0) and Q5_K (five 1): w = d sc code - dmin m per sub-block of 32, one activation scale per 256 */
static inline void dot8_k(int five, const uint8_t *g, int64_t K, const int8_t *xq, const float *xs,
                          const float *xsum, int T, float *y, int64_t ldy) {
    if (T > 1) {
        const int64_t groups_ = K / 32;
        X8_TOKEN_TILES(T, dot8_k_tokens(five, g, K, xq + (int64_t)t_ * K, xs + (int64_t)t_ * groups_,
                                        xsum + (int64_t)t_ * groups_, nt_, y + (int64_t)t_ * ldy, ldy, t_ == 0));
        return;
    }
    const int64_t nsb = K / 256, groups = K / 32;
    const int64_t bytes = five ? 1408 : 1152, at = five ? 384 : 128;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i sm0 = scale_mask(0), sm1 = scale_mask(1), sm2 = scale_mask(2), sm3 = scale_mask(3);
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups, *su = xsum + (int64_t)t * groups;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *B = g + sb * bytes;
            if (t == 0) prefetch(B, (int)bytes);
            __m256i sc_a, sc_b, mn_a, mn_b;
            k8_scales_mins(B, &sc_a, &sc_b, &mn_a, &mn_b);
            const float xs0 = s[8 * sb];
            const __m256i msum = k8_min_sums(mn_a, mn_b, xs0, su + 8 * sb);
            /* sum over sub-blocks of scale * sum(code * xq) */
            __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                const uint8_t *Q = B + at + 256 * p;
                const int8_t *x = q + 256 * sb + 64 * p;
                const __m256i sc = p < 2 ? sc_a : sc_b;
                const __m256i slo = _mm256_shuffle_epi8(sc, (p & 1) ? sm2 : sm0),
                              shi = _mm256_shuffle_epi8(sc, (p & 1) ? sm3 : sm1);
                if (!five) {  /* eight products of 4-bit codes fit int16 (8 * 2 * 15 * 127) */
                    __m256i lo = _mm256_setzero_si256(), hi = lo;
                    for (int c = 0; c < 8; c++) nibble_products(Q + 32 * c, act4(x + 4 * c), act4(x + 32 + 4 * c), &lo, &hi);
                    isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(lo, slo), _mm256_madd_epi16(hi, shi)));
                    continue;
                }
                /* 5-bit codes: four products a sum (4 * 2 * 31 * 127 < 2^15) */
                for (int c0 = 0; c0 < 8; c0 += 4) {
                    __m256i lo = _mm256_setzero_si256(), hi = lo;
                    for (int c = c0; c < c0 + 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(Q + 32 * c)),
                                      qh = _mm256_loadu_si256((const __m256i *)(B + 128 + 32 * c));
                        const __m256i l5 = _mm256_or_si256(_mm256_and_si256(v, m4), fifth_bit(qh, 2 * p)),
                                      h5 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                           fifth_bit(qh, 2 * p + 1));
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(l5, act4(x + 4 * c)));
                        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(h5, act4(x + 32 + 4 * c)));
                    }
                    isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(lo, slo), _mm256_madd_epi16(hi, shi)));
                }
            }
            const __m256 xv = _mm256_set1_ps(xs0);
            const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)B)), xv);
            const __m256 dm = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(B + 16))), xv);
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc);
            acc = _mm256_fnmadd_ps(dm, _mm256_cvtepi32_ps(msum), acc);
        }
        _mm256_storeu_ps(y + (int64_t)t * ldy, acc);
    }
}

/* the kernels of a kind (a kernel pointer carries no kind: one function each) */
#define DOT8_KIND(name, fn, kind)                                                                                    \
    static void name(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,     \
                     float *y, int64_t ldy) {                                                                        \
        fn(kind, g, K, xq, xs, xsum, T, y, ldy);                                                                     \
    }
DOT8_KIND(dot8_q4_0, dot8_b32, 0)
DOT8_KIND(dot8_mxfp4, dot8_b32, 1)
DOT8_KIND(dot8_q4_1, dot8_b32, 2)
DOT8_KIND(dot8_q5_0, dot8_b32, 3)
DOT8_KIND(dot8_q5_1, dot8_b32, 4)
DOT8_KIND(dot8_iq4_nl, dot8_signed, 0)
DOT8_KIND(dot8_q8_0, dot8_signed, 1)
DOT8_KIND(dot8_q4_k, dot8_k, 0)
DOT8_KIND(dot8_q5_k, dot8_k, 1)

#pragma GCC pop_options

moed_ggml_dot8_fn moed_ggml_dot8_avx2(int x8type) {
    switch (x8type) {
    case MOED_GGML_Q4_0_X8: return dot8_q4_0;
    case MOED_GGML_Q4_1_X8: return dot8_q4_1;
    case MOED_GGML_Q5_0_X8: return dot8_q5_0;
    case MOED_GGML_Q5_1_X8: return dot8_q5_1;
    case MOED_GGML_Q8_0_X8: return dot8_q8_0;
    case MOED_GGML_Q4_K_X8: return dot8_q4_k;
    case MOED_GGML_Q5_K_X8: return dot8_q5_k;
    case MOED_GGML_IQ4_NL_X8: return dot8_iq4_nl;
    case MOED_GGML_IQ4_XS_X8: return dot8_iq4_xs;
    case MOED_GGML_MXFP4_X8: return dot8_mxfp4;
    case MOED_GGML_NVFP4_X8: return dot8_nvfp4;
    default: return NULL;
    }
}

#else

moed_ggml_dot8_fn moed_ggml_dot8_avx2(int x8type) {
    (void)x8type;
    return NULL;
}

#endif
