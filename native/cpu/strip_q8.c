/* q8 strip kernels (see moed_cpu.h): qs int8 [K][N], d fp16 bits [K/32][N], int8 activations.
 *
 *   out[t][c] = sum_g d[g][n] * xs[t][g] * (sum_{k in g} xq[t][k] * qs[k][n])
 *
 * The inner sum over a group is exact (int32); groups are combined in fp32 in order g = 0, 1, ...
 * The SIMD paths vectorise along columns (the layout is k-major): for a pair of rows k, k+1 the
 * bytes of consecutive columns are interleaved into (qs[k][n], qs[k+1][n]) int16 pairs and
 * multiplied with the broadcast pair (xq[k], xq[k+1]) by madd_epi16, giving one exact int32 per
 * column. The loop order is: chunk of groups -> column block -> token block -> group, so the
 * weight bytes of a chunk are read from memory once and re-read from L1 by later token blocks;
 * the fp32 accumulators live in the output rows between groups.
 */
#include <string.h>

#include "moed_cpu.h"

/* ------------------------------------------------------------------------------------------ */
/* scalar (portable) path                                                                     */

#define Q8_SCALAR_CHUNK 256

static void q8_cols_scalar(const int8_t *qs, const uint16_t *d, int64_t N, int64_t K, const moed_act *a,
                           int64_t c0, int64_t c1, float *out, int64_t ld) {
    const int64_t G = K / MOED_GROUP, xstride = a->K, sstride = a->K / MOED_GROUP;
    int32_t isum[Q8_SCALAR_CHUNK];
    for (int64_t cb = c0; cb < c1; cb += Q8_SCALAR_CHUNK) {
        const int64_t w = (c1 - cb < Q8_SCALAR_CHUNK) ? c1 - cb : Q8_SCALAR_CHUNK;
        for (int t = 0; t < a->T; t++) {
            float *o = out + (int64_t)t * ld + (cb - c0);
            const int8_t *xq = a->xq + (int64_t)t * xstride;
            const float *xs = a->xs + (int64_t)t * sstride;
            for (int64_t c = 0; c < w; c++) o[c] = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                memset(isum, 0, sizeof(int32_t) * (size_t)w);
                for (int i = 0; i < MOED_GROUP; i++) {
                    const int32_t xv = xq[g * MOED_GROUP + i];
                    if (xv == 0) continue;
                    const int8_t *row = qs + (g * MOED_GROUP + i) * N + cb;
                    for (int64_t c = 0; c < w; c++) isum[c] += xv * (int32_t)row[c];
                }
                const float sx = xs[g];
                const uint16_t *dr = d + g * N + cb;
                for (int64_t c = 0; c < w; c++) o[c] += (float)isum[c] * (moed_f16_to_f32(dr[c]) * sx);
            }
        }
    }
}

void moed_strip_q8_scalar(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                          int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    const int8_t *qs = (const int8_t *)w->w;
    const uint16_t *d = (const uint16_t *)w->s;
    const int64_t N = w->N, h = w->N / 2;
    q8_cols_scalar(qs, d, N, w->K, a, j0, j1, lo, ld);
    q8_cols_scalar(qs, d, N, w->K, a, h + j0, h + j1, hi, ld);
}

#if MOED_X86
#include <immintrin.h>

/* groups per chunk (the weight bytes of KC groups x one column block stay in L1 for the token
 * blocks); the packed activation pairs of a chunk are kept on the stack: T * KC * 64 bytes */
#ifndef Q8_KC
#define Q8_KC 1
#endif
#define Q8_TMAX 64

typedef struct {
    const int8_t *qs;
    const uint16_t *d;
    int64_t N, G;
    const float *xs; /* a->xs */
    int64_t sstride; /* a->K / 32 */
} q8_ctx;

/* software prefetch: the same lines Q8_PFD_BYTES of strip ahead, i.e. some whole chunks of
 * groups ahead in the rows (the hardware prefetchers do not follow this access order well) */
#ifndef Q8_PFD_BYTES
#define Q8_PFD_BYTES 8192
#endif
#ifndef Q8_PFHINT
#define Q8_PFHINT _MM_HINT_NTA
#endif
static int64_t q8_pf_dist(int64_t N, int64_t W) {
    if (Q8_PFD_BYTES <= 0) return 0;
    const int64_t chunk = (int64_t)Q8_KC * MOED_GROUP * W; /* bytes of one chunk of the strip */
    int64_t n = (Q8_PFD_BYTES + chunk - 1) / chunk;
    if (n < 1) n = 1;
    return n * Q8_KC * MOED_GROUP * N;
}

/* more than Q8_TMAX tokens (not expected: T <= 64): fn on slices of Q8_TMAX tokens */
static void q8_split_tokens(moed_strip_fn fn, const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1,
                            float *lo, float *hi, int64_t ld) {
    for (int t0 = 0; t0 < a->T; t0 += Q8_TMAX) {
        moed_act s = *a;
        s.T = a->T - t0 < Q8_TMAX ? a->T - t0 : Q8_TMAX;
        s.x = a->x + (int64_t)t0 * a->K;
        s.xq = a->xq + (int64_t)t0 * a->K;
        s.xs = a->xs + (int64_t)t0 * (a->K / MOED_GROUP);
        s.xsum = a->xsum + (int64_t)t0 * (a->K / MOED_GROUP);
        fn(w, &s, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* AVX-512 (F/BW/VL/DQ; no VNNI)                                                              */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

/* xw[t][p] (int32) = the int16 pair (xq[t][g*32+2p], xq[t][g*32+2p+1]) */
static inline __attribute__((always_inline)) void q8_pack_x512(const int8_t *xq, int32_t *xw) {
    _mm512_storeu_si512((void *)xw, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)xq)));
}

/* One group g for NV units of 32 columns at column c and TB tokens. Inside a unit the int32
 * lanes are permuted: vector A holds columns 0-7,16-23, vector B 8-15,24-31 (unpack works in
 * 128-bit lanes); d is loaded the same way, and the output rows hold this permuted layout
 * between groups (unpermuted at the last group). masked: one unit, columns where m is set. */
static inline __attribute__((always_inline)) void q8_group512(const q8_ctx *C, const int NV, const int TB,
                                                              const int masked, const __mmask32 m, int64_t c,
                                                              int64_t g, const int32_t *xw, int64_t xwstride,
                                                              int t0, float *o, int64_t ldo, int first, int last,
                                                              int64_t pfd) {
    __m512i acc[4][4];
    for (int t = 0; t < TB; t++)
        for (int v = 0; v < 2 * NV; v++) acc[t][v] = _mm512_setzero_si512();
    const int64_t N = C->N;
    const int8_t *r = C->qs + g * MOED_GROUP * N + c;
    for (int p = 0; p < MOED_GROUP / 2; p++) {
        __m512i w[4];
        for (int u = 0; u < NV; u++) {
            __m256i a0, a1;
            if (masked) {
                a0 = _mm256_maskz_loadu_epi8(m, r + 32 * u);
                a1 = _mm256_maskz_loadu_epi8(m, r + N + 32 * u);
            } else {
                a0 = _mm256_loadu_si256((const __m256i *)(r + 32 * u));
                a1 = _mm256_loadu_si256((const __m256i *)(r + N + 32 * u));
            }
            w[2 * u] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a0, a1));
            w[2 * u + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a0, a1));
        }
        if (pfd) {
            _mm_prefetch((const char *)(r + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + pfd + (NV == 2 ? 64 : 31)), Q8_PFHINT);
            _mm_prefetch((const char *)(r + N + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + N + pfd + (NV == 2 ? 64 : 31)), Q8_PFHINT);
        }
        for (int t = 0; t < TB; t++) {
            const __m512i xb = _mm512_set1_epi32(xw[t * xwstride + p]);
            for (int v = 0; v < 2 * NV; v++) acc[t][v] = _mm512_add_epi32(acc[t][v], _mm512_madd_epi16(w[v], xb));
        }
        r += 2 * N;
    }
    const uint16_t *dp = C->d + g * N + c;
    for (int u = 0; u < NV; u++) {
        __m256i d0, d1;
        if (masked) {
            d0 = _mm256_maskz_loadu_epi16((__mmask16)(m & 0xFFFFu), dp + 32 * u);
            d1 = _mm256_maskz_loadu_epi16((__mmask16)(m >> 16), dp + 32 * u + 16);
        } else {
            d0 = _mm256_loadu_si256((const __m256i *)(dp + 32 * u));
            d1 = _mm256_loadu_si256((const __m256i *)(dp + 32 * u + 16));
        }
        const __m512 dA = _mm512_cvtph_ps(_mm256_permute2x128_si256(d0, d1, 0x20));
        const __m512 dB = _mm512_cvtph_ps(_mm256_permute2x128_si256(d0, d1, 0x31));
        for (int t = 0; t < TB; t++) {
            const __m512 s = _mm512_set1_ps(C->xs[(int64_t)(t0 + t) * C->sstride + g]);
            float *op = o + (int64_t)t * ldo + 32 * u;
            __m512 fA = _mm512_cvtepi32_ps(acc[t][2 * u]);
            __m512 fB = _mm512_cvtepi32_ps(acc[t][2 * u + 1]);
            if (first) {
                fA = _mm512_mul_ps(fA, _mm512_mul_ps(dA, s));
                fB = _mm512_mul_ps(fB, _mm512_mul_ps(dB, s));
            } else {
                fA = _mm512_fmadd_ps(fA, _mm512_mul_ps(dA, s), _mm512_loadu_ps(op));
                fB = _mm512_fmadd_ps(fB, _mm512_mul_ps(dB, s), _mm512_loadu_ps(op + 16));
            }
            if (last) {
                _mm512_storeu_ps(op, _mm512_shuffle_f32x4(fA, fB, 0x44));
                _mm512_storeu_ps(op + 16, _mm512_shuffle_f32x4(fA, fB, 0xEE));
            } else {
                _mm512_storeu_ps(op, fA);
                _mm512_storeu_ps(op + 16, fB);
            }
        }
    }
}

#define Q8_DEF512(NAME, NV, TB, MASKED)                                                                          \
    static void NAME(const q8_ctx *C, __mmask32 m, int64_t c, int64_t g, const int32_t *xw, int64_t xwstride,    \
                     int t0, float *o, int64_t ldo, int first, int last, int64_t pfd) {                          \
        q8_group512(C, NV, TB, MASKED, m, c, g, xw, xwstride, t0, o, ldo, first, last, pfd);                     \
    }
typedef void (*q8_blk512_fn)(const q8_ctx *, __mmask32, int64_t, int64_t, const int32_t *, int64_t, int, float *,
                             int64_t, int, int, int64_t);
Q8_DEF512(q8b512_2_1, 2, 1, 0)
Q8_DEF512(q8b512_2_2, 2, 2, 0)
Q8_DEF512(q8b512_2_3, 2, 3, 0)
Q8_DEF512(q8b512_2_4, 2, 4, 0)
Q8_DEF512(q8b512_1_1, 1, 1, 0)
Q8_DEF512(q8b512_1_2, 1, 2, 0)
Q8_DEF512(q8b512_1_3, 1, 3, 0)
Q8_DEF512(q8b512_1_4, 1, 4, 0)
Q8_DEF512(q8b512_m_1, 1, 1, 1)
Q8_DEF512(q8b512_m_2, 1, 2, 1)
Q8_DEF512(q8b512_m_3, 1, 3, 1)
Q8_DEF512(q8b512_m_4, 1, 4, 1)
static const q8_blk512_fn q8_tab512[3][4] = {
    {q8b512_2_1, q8b512_2_2, q8b512_2_3, q8b512_2_4},
    {q8b512_1_1, q8b512_1_2, q8b512_1_3, q8b512_1_4},
    {q8b512_m_1, q8b512_m_2, q8b512_m_3, q8b512_m_4},
};

/* columns [c0, c1) of the matrix into out[t*ld + (c - c0)] */
static void q8_cols512(const q8_ctx *C, const moed_act *a, int64_t c0, int64_t c1, float *out, int64_t ld) {
    const int64_t G = C->G, W = c1 - c0, xstride = a->K;
    const int T = a->T;
    const int64_t n64 = W / 64, n32 = (W % 64) / 32, rem = W % 32;
    const __mmask32 mrem = (__mmask32)((1ull << rem) - 1);
    int32_t xw[Q8_TMAX * Q8_KC * 16] __attribute__((aligned(64)));
    float tail[Q8_TMAX * 32] __attribute__((aligned(64)));
    const int64_t pfd = q8_pf_dist(C->N, W);
    for (int64_t gc = 0; gc < G; gc += Q8_KC) {
        const int kc = (int)(G - gc < Q8_KC ? G - gc : Q8_KC);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < kc; j++)
                q8_pack_x512(a->xq + (int64_t)t * xstride + (gc + j) * MOED_GROUP, xw + (t * Q8_KC + j) * 16);
        for (int64_t b = 0; b < n64 + n32 + (rem > 0); b++) {
            const int kind = b < n64 ? 0 : (b < n64 + n32 ? 1 : 2);
            const int64_t c = c0 + (b < n64 ? 64 * b : 64 * n64 + 32 * (b - n64));
            for (int t0 = 0; t0 < T; t0 += 4) {
                const int tb = T - t0 < 4 ? T - t0 : 4;
                const q8_blk512_fn fn = q8_tab512[kind][tb - 1];
                float *o = kind == 2 ? tail + t0 * 32 : out + (int64_t)t0 * ld + (c - c0);
                const int64_t ldo = kind == 2 ? 32 : ld;
                for (int j = 0; j < kc; j++) {
                    const int64_t g = gc + j;
                    fn(C, mrem, c, g, xw + (t0 * Q8_KC + j) * 16, Q8_KC * 16, t0, o, ldo, g == 0, g == G - 1,
                       t0 == 0 ? pfd : 0);
                }
            }
        }
    }
    if (rem > 0) {
        const int64_t cc = W - rem;
        for (int t = 0; t < T; t++)
            _mm512_mask_storeu_ps(out + (int64_t)t * ld + cc, (__mmask16)(mrem & 0xFFFFu), _mm512_load_ps(tail + t * 32));
        if (rem > 16)
            for (int t = 0; t < T; t++)
                _mm512_mask_storeu_ps(out + (int64_t)t * ld + cc + 16, (__mmask16)(mrem >> 16),
                                      _mm512_load_ps(tail + t * 32 + 16));
    }
}

void moed_strip_q8_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                          int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    if (a->T > Q8_TMAX) {  /* not expected (T <= 64) */
        q8_split_tokens(moed_strip_q8_avx512, w, a, j0, j1, lo, hi, ld);
        return;
    }
    q8_ctx C = {(const int8_t *)w->w, (const uint16_t *)w->s, w->N, w->K / MOED_GROUP, a->xs, a->K / MOED_GROUP};
    const int64_t h = w->N / 2;
    q8_cols512(&C, a, j0, j1, lo, ld);
    q8_cols512(&C, a, h + j0, h + j1, hi, ld);
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------------------------ */
/* AVX-512 VNNI                                                                               */
/* vpdpbusd adds the products of 4 adjacent unsigned bytes and 4 signed bytes into one int32:
 * one instruction per 16 columns x 4 rows, where the path above needs an unpack, a widening and
 * a madd + add per 16 columns x 2 rows (it is compute-bound on one core: ~20 GB/s from L2). The
 * 4 rows k..k+3 of 64 columns are interleaved into (k, k+1, k+2, k+3) byte quads per column by
 * two rounds of in-lane unpacks; the weights are made unsigned by flipping their sign bit
 * (w + 128), so the sum carries 128 * (sum of the group's xq), which is subtracted (exact). The
 * int32 sum per group is then the same integer as above and the fp32 steps are the same: same
 * bits. Inside a unit of 64 columns the lanes are permuted: vector q, 128-bit lane l holds
 * columns 16l + 4q .. 16l + 4q + 3 (d is permuted the same way; the output rows hold this order
 * between groups and get the natural one at the last group). */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

/* the 4 x 4 transpose of 128-bit lanes (its own inverse): lane l of out q = lane q of in l */
static inline __attribute__((always_inline)) void q8_lanes4(__m512 v[4]) {
    const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
    const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
    v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
    v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
    v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
    v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

/* One group g of one unit of 64 columns at column c for TB tokens; xw[t * 8 + q] = the 4 bytes
 * xq[t][g*32 + 4q ..], xoff[t] = 128 * sum of the group's xq. */
static inline __attribute__((always_inline)) void q8_group_vnni(const q8_ctx *C, const int TB, int64_t c, int64_t g,
                                                                const int32_t *xw, const int32_t *xoff, int t0,
                                                                float *o, int64_t ldo, int first, int last,
                                                                int64_t pfd) {
    __m512i acc[4][4];
    for (int t = 0; t < TB; t++)
        for (int v = 0; v < 4; v++) acc[t][v] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t N = C->N;
    const int8_t *r = C->qs + g * MOED_GROUP * N + c;
    for (int q = 0; q < MOED_GROUP / 4; q++) {
        const __m512i r0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)r), flip);
        const __m512i r1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(r + N)), flip);
        const __m512i r2 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(r + 2 * N)), flip);
        const __m512i r3 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(r + 3 * N)), flip);
        if (pfd) {
            _mm_prefetch((const char *)(r + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + N + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + 2 * N + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + 3 * N + pfd), Q8_PFHINT);
        }
        const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
        const __m512i e = _mm512_unpacklo_epi8(r2, r3), f = _mm512_unpackhi_epi8(r2, r3);
        const __m512i w[4] = {_mm512_unpacklo_epi16(a, e), _mm512_unpackhi_epi16(a, e), _mm512_unpacklo_epi16(b, f),
                              _mm512_unpackhi_epi16(b, f)};
        for (int t = 0; t < TB; t++) {
            const __m512i xb = _mm512_set1_epi32(xw[t * 8 + q]);
            for (int v = 0; v < 4; v++) acc[t][v] = _mm512_dpbusd_epi32(acc[t][v], w[v], xb);
        }
        r += 4 * N;
    }
    const uint16_t *dp = C->d + g * N + c;
    __m512 dv[4];
    for (int l = 0; l < 4; l++) dv[l] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + 16 * l)));
    q8_lanes4(dv);
    for (int t = 0; t < TB; t++) {
        const __m512 s = _mm512_set1_ps(C->xs[(int64_t)(t0 + t) * C->sstride + g]);
        const __m512i off = _mm512_set1_epi32(xoff[t]);
        float *op = o + (int64_t)t * ldo;
        __m512 fv[4];
        for (int v = 0; v < 4; v++) {
            fv[v] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][v], off));
            if (first)
                fv[v] = _mm512_mul_ps(fv[v], _mm512_mul_ps(dv[v], s));
            else
                fv[v] = _mm512_fmadd_ps(fv[v], _mm512_mul_ps(dv[v], s), _mm512_loadu_ps(op + 16 * v));
        }
        if (last) q8_lanes4(fv);
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(op + 16 * v, fv[v]);
    }
}

#define Q8_DEFVNNI(NAME, TB)                                                                                     \
    static void NAME(const q8_ctx *C, int64_t c, int64_t g, const int32_t *xw, const int32_t *xoff, int t0,       \
                     float *o, int64_t ldo, int first, int last, int64_t pfd) {                                  \
        q8_group_vnni(C, TB, c, g, xw, xoff, t0, o, ldo, first, last, pfd);                                       \
    }
typedef void (*q8_blkvnni_fn)(const q8_ctx *, int64_t, int64_t, const int32_t *, const int32_t *, int, float *,
                              int64_t, int, int, int64_t);
Q8_DEFVNNI(q8bv_1, 1)
Q8_DEFVNNI(q8bv_2, 2)
Q8_DEFVNNI(q8bv_3, 3)
Q8_DEFVNNI(q8bv_4, 4)
static const q8_blkvnni_fn q8_tabvnni[4] = {q8bv_1, q8bv_2, q8bv_3, q8bv_4};

/* One token (decode): the rows of a quad are swept front to back over both halves' columns, the
 * int32 sums of the group in L1 (acc: the lo units then the hi units, permuted as above), so the
 * weights are read as 4 streams of adjacent rows instead of 32 short strided pieces per unit (in
 * a harness alternating both on Zen 5, 2 threads, 500 MB of weights: 10-20% faster than the
 * AVX-512 path, e.g. 38 -> 45 GB/s). The next quad's lines are prefetched (into L1) while this one
 * is swept. Whole units of 64 columns: W % 64 == 0 columns from j0 in each half. */
#ifndef Q8_SWC
#define Q8_SWC 1024 /* columns per half and sweep window */
#endif
#ifndef Q8_SWPF
#define Q8_SWPF _MM_HINT_T0
#endif
static void q8_sweep_vnni(const q8_ctx *C, const moed_act *a, int64_t j0, int64_t W, float *lo, float *hi) {
    _Alignas(64) int32_t acc[2 * Q8_SWC];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t N = C->N, H = N / 2, G = C->G, U = W / 64;
    for (int64_t g = 0; g < G; g++) {
        const int8_t *xq = a->xq + g * MOED_GROUP;
        int32_t xw[8], sum = 0;
        for (int k = 0; k < MOED_GROUP; k++) sum += xq[k];
        memcpy(xw, xq, MOED_GROUP);
        const __m512i off = _mm512_set1_epi32(128 * sum);
        memset(acc, 0, sizeof(int32_t) * (size_t)(2 * W));
        const int8_t *rg = C->qs + g * MOED_GROUP * N + j0;
        for (int q = 0; q < MOED_GROUP / 4; q++) {
            const __m512i xb = _mm512_set1_epi32(xw[q]);
            const int8_t *rq = rg + 4 * q * N;
            for (int half = 0; half < 2; half++) {
                const int8_t *p = rq + half * H;
                int32_t *ac = acc + half * W;
                for (int64_t u = 0; u < U; u++, p += 64, ac += 64) {
                    _mm_prefetch((const char *)(p + 4 * N), Q8_SWPF);
                    _mm_prefetch((const char *)(p + 5 * N), Q8_SWPF);
                    _mm_prefetch((const char *)(p + 6 * N), Q8_SWPF);
                    _mm_prefetch((const char *)(p + 7 * N), Q8_SWPF);
                    const __m512i r0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)p), flip);
                    const __m512i r1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + N)), flip);
                    const __m512i r2 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 2 * N)), flip);
                    const __m512i r3 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 3 * N)), flip);
                    const __m512i x0 = _mm512_unpacklo_epi8(r0, r1), x1 = _mm512_unpackhi_epi8(r0, r1);
                    const __m512i x2 = _mm512_unpacklo_epi8(r2, r3), x3 = _mm512_unpackhi_epi8(r2, r3);
                    _mm512_store_si512((void *)ac, _mm512_dpbusd_epi32(_mm512_load_si512((const void *)ac),
                                                                       _mm512_unpacklo_epi16(x0, x2), xb));
                    _mm512_store_si512((void *)(ac + 16), _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(ac + 16)),
                                                                              _mm512_unpackhi_epi16(x0, x2), xb));
                    _mm512_store_si512((void *)(ac + 32), _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(ac + 32)),
                                                                              _mm512_unpacklo_epi16(x1, x3), xb));
                    _mm512_store_si512((void *)(ac + 48), _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(ac + 48)),
                                                                              _mm512_unpackhi_epi16(x1, x3), xb));
                }
            }
        }
        const __m512 s = _mm512_set1_ps(C->xs[g]);
        const int first = g == 0, last = g == G - 1;
        for (int half = 0; half < 2; half++) {
            const uint16_t *dp = C->d + g * N + half * H + j0;
            float *op = half ? hi : lo;
            const int32_t *ac = acc + half * W;
            for (int64_t u = 0; u < U; u++, dp += 64, op += 64, ac += 64) {
                __m512 dv[4], fv[4];
                for (int l = 0; l < 4; l++) dv[l] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + 16 * l)));
                q8_lanes4(dv);
                for (int v = 0; v < 4; v++) {
                    fv[v] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512((const void *)(ac + 16 * v)), off));
                    if (first)
                        fv[v] = _mm512_mul_ps(fv[v], _mm512_mul_ps(dv[v], s));
                    else
                        fv[v] = _mm512_fmadd_ps(fv[v], _mm512_mul_ps(dv[v], s), _mm512_loadu_ps(op + 16 * v));
                }
                if (last) q8_lanes4(fv);
                for (int v = 0; v < 4; v++) _mm512_storeu_ps(op + 16 * v, fv[v]);
            }
        }
    }
}

/* columns [c0, c1): whole units of 64 here, the rest by the AVX-512 path (the same bits) */
static void q8_cols_vnni(const q8_ctx *C, const moed_act *a, int64_t c0, int64_t c1, float *out, int64_t ld) {
    const int64_t G = C->G, W = c1 - c0, n64 = W / 64, xstride = a->K;
    const int T = a->T;
    if (n64 > 0) {
        int32_t xw[Q8_TMAX * 8], xoff[Q8_TMAX];
        const int64_t pfd = q8_pf_dist(C->N, 64 * n64);
        for (int64_t g = 0; g < G; g++) {
            for (int t = 0; t < T; t++) {
                const int8_t *xq = a->xq + (int64_t)t * xstride + g * MOED_GROUP;
                int32_t sum = 0;
                for (int k = 0; k < MOED_GROUP; k++) sum += xq[k];
                memcpy(xw + t * 8, xq, MOED_GROUP);
                xoff[t] = 128 * sum;
            }
            for (int64_t b = 0; b < n64; b++)
                for (int t0 = 0; t0 < T; t0 += 4) {
                    const int tb = T - t0 < 4 ? T - t0 : 4;
                    q8_tabvnni[tb - 1](C, c0 + 64 * b, g, xw + t0 * 8, xoff + t0, t0, out + (int64_t)t0 * ld + 64 * b,
                                       ld, g == 0, g == G - 1, t0 == 0 ? pfd : 0);
                }
        }
    }
    if (W > 64 * n64) q8_cols512(C, a, c0 + 64 * n64, c1, out + 64 * n64, ld);
}

void moed_strip_q8_avx512vnni(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                              int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    if (a->T > Q8_TMAX) {  /* not expected (T <= 64) */
        q8_split_tokens(moed_strip_q8_avx512vnni, w, a, j0, j1, lo, hi, ld);
        return;
    }
    q8_ctx C = {(const int8_t *)w->w, (const uint16_t *)w->s, w->N, w->K / MOED_GROUP, a->xs, a->K / MOED_GROUP};
    const int64_t h = w->N / 2;
    if (a->T == 1) {
        for (int64_t c = j0; c + 64 <= j1; c += Q8_SWC) {
            const int64_t W = (j1 - c < Q8_SWC ? j1 - c : Q8_SWC) / 64 * 64;
            q8_sweep_vnni(&C, a, c, W, lo + (c - j0), hi + (c - j0));
        }
        const int64_t done = (j1 - j0) / 64 * 64;
        if (done < j1 - j0) {
            q8_cols512(&C, a, j0 + done, j1, lo + done, ld);
            q8_cols512(&C, a, h + j0 + done, h + j1, hi + done, ld);
        }
        return;
    }
    q8_cols_vnni(&C, a, j0, j1, lo, ld);
    q8_cols_vnni(&C, a, h + j0, h + j1, hi, ld);
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------------------------ */
/* AVX2 (+FMA, F16C)                                                                          */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline __attribute__((always_inline)) void q8_pack_x256(const int8_t *xq, int32_t *xw) {
    const __m128i v0 = _mm_loadu_si128((const __m128i *)xq);
    const __m128i v1 = _mm_loadu_si128((const __m128i *)(xq + 16));
    _mm256_storeu_si256((__m256i *)xw, _mm256_cvtepi8_epi16(v0));
    _mm256_storeu_si256((__m256i *)(xw + 8), _mm256_cvtepi8_epi16(v1));
}

/* the float step of one group for 8 columns: op = isum * (d * xs)  (+ op unless first) */
static inline __attribute__((always_inline)) void q8y_float_step(__m256i isum, __m256 dv, __m256 s, float *op,
                                                                 int first) {
    __m256 f = _mm256_cvtepi32_ps(isum);
    if (first)
        f = _mm256_mul_ps(f, _mm256_mul_ps(dv, s));
    else
        f = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, s), _mm256_loadu_ps(op));
    _mm256_storeu_ps(op, f);
}

/* One group g for NV units of 16 columns at column c and TB tokens; column order is natural. */
static inline __attribute__((always_inline)) void q8_group256(const q8_ctx *C, const int NV, const int TB, int64_t c,
                                                              int64_t g, const int32_t *xw, int64_t xwstride,
                                                              int t0, float *o, int64_t ldo, int first,
                                                              int64_t pfd) {
    __m256i acc[4][8];
    for (int t = 0; t < TB; t++)
        for (int v = 0; v < 2 * NV; v++) acc[t][v] = _mm256_setzero_si256();
    const int64_t N = C->N;
    const int8_t *r = C->qs + g * MOED_GROUP * N + c;
    for (int p = 0; p < MOED_GROUP / 2; p++) {
        __m256i w[8];
        for (int u = 0; u < NV; u++) {
            const __m128i a0 = _mm_loadu_si128((const __m128i *)(r + 16 * u));
            const __m128i a1 = _mm_loadu_si128((const __m128i *)(r + N + 16 * u));
            w[2 * u] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a0, a1));
            w[2 * u + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a0, a1));
        }
        if (pfd) {
            _mm_prefetch((const char *)(r + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + pfd + 16 * NV - 1), Q8_PFHINT);
            _mm_prefetch((const char *)(r + N + pfd), Q8_PFHINT);
            _mm_prefetch((const char *)(r + N + pfd + 16 * NV - 1), Q8_PFHINT);
        }
        for (int t = 0; t < TB; t++) {
            const __m256i xb = _mm256_set1_epi32(xw[t * xwstride + p]);
            for (int v = 0; v < 2 * NV; v++) acc[t][v] = _mm256_add_epi32(acc[t][v], _mm256_madd_epi16(w[v], xb));
        }
        r += 2 * N;
    }
    const uint16_t *dp = C->d + g * N + c;
    for (int v = 0; v < 2 * NV; v++) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + 8 * v)));
        for (int t = 0; t < TB; t++)
            q8y_float_step(acc[t][v], dv, _mm256_set1_ps(C->xs[(int64_t)(t0 + t) * C->sstride + g]),
                           o + (int64_t)t * ldo + 8 * v, first);
    }
}

#define Q8_DEF256(NAME, NV, TB)                                                                                  \
    static void NAME(const q8_ctx *C, int64_t c, int64_t g, const int32_t *xw, int64_t xwstride, int t0,         \
                     float *o, int64_t ldo, int first, int64_t pfd) {                                            \
        q8_group256(C, NV, TB, c, g, xw, xwstride, t0, o, ldo, first, pfd);                                      \
    }
typedef void (*q8_blk256_fn)(const q8_ctx *, int64_t, int64_t, const int32_t *, int64_t, int, float *, int64_t, int,
                             int64_t);
Q8_DEF256(q8b256_4_1, 4, 1)
Q8_DEF256(q8b256_2_1, 2, 1)
Q8_DEF256(q8b256_2_2, 2, 2)
Q8_DEF256(q8b256_1_1, 1, 1)
Q8_DEF256(q8b256_1_2, 1, 2)
Q8_DEF256(q8b256_1_3, 1, 3)
Q8_DEF256(q8b256_1_4, 1, 4)

/* columns [c0, c1) (c1 - c0 >= 16) into out[t*ld + (c - c0)] */
static void q8_cols256(const q8_ctx *C, const moed_act *a, int64_t c0, int64_t c1, float *out, int64_t ld) {
    const int64_t G = C->G, W = c1 - c0, xstride = a->K;
    const int T = a->T;
    /* T == 1: blocks of 64 columns (8 accumulators); else blocks of 32 columns x 2 tokens */
    const int64_t bw = T == 1 ? 64 : 32;
    const int64_t nw = W / bw, n16 = (W % bw) / 16, rem = W % 16;
    int32_t xw[Q8_TMAX * Q8_KC * 16] __attribute__((aligned(32)));
    const int64_t pfd = q8_pf_dist(C->N, W);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && rem == 0) break;
        for (int64_t gc = 0; gc < G; gc += Q8_KC) {
            const int kc = (int)(G - gc < Q8_KC ? G - gc : Q8_KC);
            for (int t = 0; t < T; t++)
                for (int j = 0; j < kc; j++)
                    q8_pack_x256(a->xq + (int64_t)t * xstride + (gc + j) * MOED_GROUP, xw + (t * Q8_KC + j) * 16);
            const int64_t nb = pass == 0 ? nw + n16 : 1;
            for (int64_t b = 0; b < nb; b++) {
                const int wide = pass == 0 && b < nw;
                /* pass 1: the 16 columns ending at c1, over all of K after everything else (the
                 * columns it shares with the previous block get bit-identical values) */
                const int64_t c = pass == 1 ? c1 - 16 : c0 + (b < nw ? bw * b : bw * nw + 16 * (b - nw));
                const int tmax = wide ? (bw == 64 ? 1 : 2) : 4;
                for (int t0 = 0; t0 < T; t0 += tmax) {
                    const int tb = T - t0 < tmax ? T - t0 : tmax;
                    q8_blk256_fn fn;
                    if (wide)
                        fn = bw == 64 ? q8b256_4_1 : tb == 1 ? q8b256_2_1 : q8b256_2_2;
                    else
                        fn = tb == 1 ? q8b256_1_1 : tb == 2 ? q8b256_1_2 : tb == 3 ? q8b256_1_3 : q8b256_1_4;
                    float *o = out + (int64_t)t0 * ld + (c - c0);
                    for (int j = 0; j < kc; j++)
                        fn(C, c, gc + j, xw + (t0 * Q8_KC + j) * 16, Q8_KC * 16, t0, o, ld, gc + j == 0,
                           t0 == 0 && pass == 0 ? pfd : 0);
                }
            }
        }
    }
}

/* One token (T = 1, decode): the rows of each group swept front to back, a pair of rows at a time
 * (rows k and k + 1 follow each other in memory: one stream per thread), the columns' int32 sums
 * in an L1 buffer, then the group's float step exactly as q8_group256 does it (the same bits). The
 * column blocks of q8_cols256 read 32 rows x 64 bytes per group (32 streams 2*N apart), which the
 * prefetchers serve badly. Whole units of 16 columns: W % 16 == 0 columns from j0 in each half. */
#ifndef Q8Y_LIN
/* software prefetch distance (bytes) when the sweep covers whole rows (W == N / 2): a pair of rows
 * is then one contiguous stretch of 2N bytes consumed at 32 bytes per step (0: two rows ahead) */
#define Q8Y_LIN 8192
#endif
#ifndef Q8Y_SPF
#define Q8Y_SPF 1 /* prefetch a group's scale rows before its sweep */
#endif
#ifndef Q8Y_SWC
#define Q8Y_SWC 1024 /* columns per half and sweep window */
#endif
static void q8_sweep256(const q8_ctx *C, const moed_act *a, int64_t j0, int64_t W, float *lo, float *hi) {
    _Alignas(32) int32_t acc[2 * Q8Y_SWC];
    int32_t xw[16] __attribute__((aligned(32)));
    const int64_t N = C->N, H = N / 2, G = C->G, U = W / 16;
    for (int64_t g = 0; g < G; g++) {
        q8_pack_x256(a->xq + g * MOED_GROUP, xw);
#if Q8Y_SPF
        /* the scale rows the float step reads after the sweep */
        for (int half = 0; half < 2; half++)
            for (int64_t c = 0; c < W; c += 32) _mm_prefetch((const char *)(C->d + g * N + half * H + j0 + c), _MM_HINT_T0);
#endif
        memset(acc, 0, sizeof(int32_t) * (size_t)(2 * W));
        const int8_t *rg = C->qs + g * MOED_GROUP * N + j0;
        for (int p = 0; p < MOED_GROUP / 2; p++) {
            const __m256i xb = _mm256_set1_epi32(xw[p]);
            const int8_t *rp = rg + 2 * p * N;
            for (int half = 0; half < 2; half++) {
                const int8_t *r = rp + half * H;
                int32_t *ac = acc + half * W;
                for (int64_t u = 0; u < U; u++, r += 16, ac += 16) {
#if Q8Y_LIN
                    if (W == H) {
                        if ((u & 1) == 0) _mm_prefetch((const char *)(rp + 32 * (half * U + u) + Q8Y_LIN), _MM_HINT_T0);
                    } else
#endif
                    if ((u & 3) == 0) {
                        _mm_prefetch((const char *)(r + 2 * N), _MM_HINT_T0);
                        _mm_prefetch((const char *)(r + 3 * N), _MM_HINT_T0);
                    }
                    const __m128i a0 = _mm_loadu_si128((const __m128i *)r);
                    const __m128i a1 = _mm_loadu_si128((const __m128i *)(r + N));
                    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a0, a1));
                    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a0, a1));
                    _mm256_store_si256((__m256i *)ac, _mm256_add_epi32(_mm256_load_si256((const __m256i *)ac),
                                                                        _mm256_madd_epi16(w0, xb)));
                    _mm256_store_si256((__m256i *)(ac + 8), _mm256_add_epi32(_mm256_load_si256((const __m256i *)(ac + 8)),
                                                                              _mm256_madd_epi16(w1, xb)));
                }
            }
        }
        const __m256 s = _mm256_set1_ps(C->xs[g]);
        const int first = g == 0;
        for (int half = 0; half < 2; half++) {
            const uint16_t *dp = C->d + g * N + half * H + j0;
            float *op = half ? hi : lo;
            const int32_t *ac = acc + half * W;
            for (int64_t v = 0; v < 2 * U; v++, dp += 8, op += 8, ac += 8)
                q8y_float_step(_mm256_load_si256((const __m256i *)ac), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dp)),
                               s, op, first);
        }
    }
}

void moed_strip_q8_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                        int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    if (j1 - j0 < 16) {
        moed_strip_q8_scalar(w, a, j0, j1, lo, hi, ld);
        return;
    }
    if (a->T > Q8_TMAX) {  /* not expected (T <= 64) */
        q8_split_tokens(moed_strip_q8_avx2, w, a, j0, j1, lo, hi, ld);
        return;
    }
    q8_ctx C = {(const int8_t *)w->w, (const uint16_t *)w->s, w->N, w->K / MOED_GROUP, a->xs, a->K / MOED_GROUP};
    const int64_t h = w->N / 2;
    if (a->T == 1 && Q8Y_SWC > 0) {
        for (int64_t c = j0; c + 16 <= j1; c += Q8Y_SWC) {
            const int64_t W = (j1 - c < Q8Y_SWC ? j1 - c : Q8Y_SWC) / 16 * 16;
            q8_sweep256(&C, a, c, W, lo + (c - j0), hi + (c - j0));
        }
        const int64_t done = (j1 - j0) / 16 * 16;
        if (done < j1 - j0) {  /* the last columns: the 16 ending at j1, as q8_cols256's pass 1 */
            q8_cols256(&C, a, j1 - 16, j1, lo + (j1 - 16 - j0), ld);
            q8_cols256(&C, a, h + j1 - 16, h + j1, hi + (j1 - 16 - j0), ld);
        }
        return;
    }
    q8_cols256(&C, a, j0, j1, lo, ld);
    q8_cols256(&C, a, h + j0, h + j1, hi, ld);
}

#pragma GCC pop_options

#else /* !MOED_X86 */

void moed_strip_q8_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                        int64_t ld) {
    moed_strip_q8_scalar(w, a, j0, j1, lo, hi, ld);
}
void moed_strip_q8_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                          int64_t ld) {
    moed_strip_q8_scalar(w, a, j0, j1, lo, hi, ld);
}
void moed_strip_q8_avx512vnni(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                              float *hi, int64_t ld) {
    moed_strip_q8_scalar(w, a, j0, j1, lo, hi, ld);
}

#endif
