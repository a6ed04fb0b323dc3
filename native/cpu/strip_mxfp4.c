/* mxfp4 strip kernels (see moed_cpu.h): E2M1 codes uint8 [K][N/2] (low nibble = column j, high
 * nibble = column j + N/2), e8m0 uint8 [K/32][N], int8 activations.
 *
 *   out[t][n] = sum_g  2^(e[g][n] - 128) * xs[t][g] * (sum_{k in g} xq[t][k] * v2[code[k][n]])
 *
 * v2 = 2 * e2m1 value = {0,1,2,3,4,6,8,12} for codes 0..7 and the negatives for 8..15 (code 8 = -0).
 * The inner sum over a group is exact (integers); groups are combined in fp32 in order g = 0, 1, ...
 *
 * The SIMD paths share the structure of strip_int4.c (dword-interleaved 4-row quads, maddubs with
 * the broadcast (xq[k], .., xq[k+3]), permuted column order, stack accumulators). The nibbles are
 * mapped by pshufb to the unsigned v2 + 12 (0..24), so maddubs(v2 + 12, xq) stays exact (a pair
 * sum is at most 2*24*127 = 6096, four quads of them fit int16), and 12 * sum_k xq[k] is
 * subtracted from the exact int32 group sum: sum xq * v2 = sum xq * (v2 + 12) - 12 * sum xq.
 */
#include <string.h>

#include "moed_cpu.h"

static const int8_t MX_V2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) exactly (e = 0: the subnormal 2^-128); e = 255 is refused at load */
static inline float mx_e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e ? (uint32_t)(e - 1) << 23 : (uint32_t)1 << 21;
    return v.f;
}

/* ------------------------------------------------------------------------------------------ */
/* scalar (portable) path                                                                     */

#define MX_SCALAR_CHUNK 128

void moed_strip_mxfp4_scalar(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                             int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    const uint8_t *W = (const uint8_t *)w->w, *E = (const uint8_t *)w->s;
    const int64_t N = w->N, N2 = w->N / 2, K = a->K, G = a->K / MOED_GROUP;
    int32_t il[MX_SCALAR_CHUNK], ih[MX_SCALAR_CHUNK];
    for (int64_t cb = j0; cb < j1; cb += MX_SCALAR_CHUNK) {
        const int64_t cw = (j1 - cb < MX_SCALAR_CHUNK) ? j1 - cb : MX_SCALAR_CHUNK;
        for (int t = 0; t < a->T; t++) {
            float *ol = lo + (int64_t)t * ld + (cb - j0), *oh = hi + (int64_t)t * ld + (cb - j0);
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G;
            for (int64_t c = 0; c < cw; c++) ol[c] = oh[c] = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                memset(il, 0, sizeof(int32_t) * (size_t)cw);
                memset(ih, 0, sizeof(int32_t) * (size_t)cw);
                for (int i = 0; i < MOED_GROUP; i++) {
                    const int32_t xv = xq[g * MOED_GROUP + i];
                    if (xv == 0) continue;
                    const uint8_t *row = W + (g * MOED_GROUP + i) * N2 + cb;
                    for (int64_t c = 0; c < cw; c++) {
                        il[c] += xv * (int32_t)MX_V2[row[c] & 15];
                        ih[c] += xv * (int32_t)MX_V2[row[c] >> 4];
                    }
                }
                const float sx = xs[g];
                const uint8_t *el = E + g * N + cb, *eh = el + N2;
                for (int64_t c = 0; c < cw; c++) {
                    ol[c] += (float)il[c] * (mx_e8m0_half(el[c]) * sx);
                    oh[c] += (float)ih[c] * (mx_e8m0_half(eh[c]) * sx);
                }
            }
        }
    }
}

#if MOED_X86
#include <immintrin.h>

#include "moed_simd.h"


#define MX_FACC 8192 /* fp32 accumulators of one column super-block (all tokens) */
#define MX_TCHUNK 64 /* tokens per internal call */

static void mx_sub_act(const moed_act *a, int t0, moed_act *sub) {
    const int64_t G = a->K / MOED_GROUP;
    *sub = *a;
    sub->T = (a->T - t0 < MX_TCHUNK) ? a->T - t0 : MX_TCHUNK;
    sub->x = a->x + (int64_t)t0 * a->K;
    sub->xq = a->xq + (int64_t)t0 * a->K;
    sub->xs = a->xs + (int64_t)t0 * G;
    sub->xsum = a->xsum + (int64_t)t0 * G;
}

static inline int32_t mx_load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* 12 * sum of the 32 xq of token t, group g, for every token */
static void mx_corr(const moed_act *a, int64_t g, int32_t *corr) {
    for (int t = 0; t < a->T; t++) {
        const int8_t *x = a->xq + (int64_t)t * a->K + g * MOED_GROUP;
        int32_t s = 0;
        for (int i = 0; i < MOED_GROUP; i++) s += x[i];
        corr[t] = 12 * s;
    }
}

/* Software prefetch of the next group's rows of one column block, a group ahead (see
 * i4_prefetch_next in strip_int4.c). */
static inline void mx_prefetch_next(const uint8_t *wp, int64_t N2) {
    const uint8_t *pf = wp + MOED_GROUP * N2;
    for (int k = 0; k < MOED_GROUP; k++) _mm_prefetch((const char *)(pf + k * N2), _MM_HINT_T0);
}

/* element e of permuted vector i -> column inside the block; write lo/hi of cw columns */
static void mx_store_block(const float *f, int vw, int64_t cw, float *ol, float *oh) {
    const int per = vw / 4;
    for (int i = 0; i < 4; i++)
        for (int e = 0; e < per; e++) {
            const int c = 16 * (e >> 2) + 4 * i + (e & 3);
            if (c < cw) {
                ol[c] = f[i * per + e];
                oh[c] = f[vw + i * per + e];
            }
        }
}

/* ---------------------------------------- AVX-512 ---------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

/* e8m0 rows (lo at p, hi at p + N2) of a 64-byte-column block -> 8 permuted fp32 2^(e-128) vectors */
static inline __attribute__((always_inline)) void mxz_scales(const uint8_t *p, int64_t N2, int full, __mmask64 bm,
                                                             float *out) {
    const __m512i z = _mm512_setzero_si512(), one = _mm512_set1_epi32(1), sub = _mm512_set1_epi32(1 << 21);
    for (int h = 0; h < 2; h++) {
        /* masked loads from memory are slow on some CPUs (Zen): only for a partial block */
        const __m512i e = full ? _mm512_loadu_si512((const void *)(p + h * N2)) : _mm512_maskz_loadu_epi8(bm, p + h * N2);
        const __m512i u = _mm512_unpacklo_epi8(e, z), v = _mm512_unpackhi_epi8(e, z);
        __m512i d[4];
        d[0] = _mm512_unpacklo_epi16(u, z);
        d[1] = _mm512_unpackhi_epi16(u, z);
        d[2] = _mm512_unpacklo_epi16(v, z);
        d[3] = _mm512_unpackhi_epi16(v, z);
        for (int i = 0; i < 4; i++) {
            const __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(d[i], one), 23);
            const __mmask16 zero = _mm512_cmpeq_epi32_mask(d[i], z);
            _mm512_store_si512((void *)(out + h * 64 + 16 * i), _mm512_mask_mov_epi32(bits, zero, sub));
        }
    }
}

#define MXZ_VNNI 0
#define MXZ_GROUP mxz_group
#define MXZ_STRIP mxz_strip
#include "strip_mxfp4_avx512_body.h"
#undef MXZ_VNNI
#undef MXZ_GROUP
#undef MXZ_STRIP

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define MXZ_VNNI 1
#define MXZ_GROUP mxv_group
#define MXZ_STRIP mxv_strip
#include "strip_mxfp4_avx512_body.h"
#undef MXZ_VNNI
#undef MXZ_GROUP
#undef MXZ_STRIP

#pragma GCC pop_options

void moed_strip_mxfp4_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                             int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    for (int t0 = 0; t0 < a->T; t0 += MX_TCHUNK) {
        moed_act sub;
        mx_sub_act(a, t0, &sub);
        mxz_strip(w, &sub, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

void moed_strip_mxfp4_avx512vnni(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                                 float *hi, int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    for (int t0 = 0; t0 < a->T; t0 += MX_TCHUNK) {
        moed_act sub;
        mx_sub_act(a, t0, &sub);
        mxv_strip(w, &sub, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

/* ------------------------------------------ AVX2 ------------------------------------------ */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* e8m0 rows (lo at p, hi at p + N2) of a 32-byte-column block -> 8 permuted fp32 2^(e-128) vectors */
static inline __attribute__((always_inline)) void mxy_scales(const uint8_t *p, int64_t N2, float *out) {
    const __m256i z = _mm256_setzero_si256(), one = _mm256_set1_epi32(1), sub = _mm256_set1_epi32(1 << 21);
    for (int h = 0; h < 2; h++) {
        const __m256i e = _mm256_loadu_si256((const __m256i *)(p + h * N2));
        const __m256i u = _mm256_unpacklo_epi8(e, z), v = _mm256_unpackhi_epi8(e, z);
        __m256i d[4];
        d[0] = _mm256_unpacklo_epi16(u, z);
        d[1] = _mm256_unpackhi_epi16(u, z);
        d[2] = _mm256_unpacklo_epi16(v, z);
        d[3] = _mm256_unpackhi_epi16(v, z);
        for (int i = 0; i < 4; i++) {
            const __m256i bits = _mm256_slli_epi32(_mm256_sub_epi32(d[i], one), 23);
            const __m256i zero = _mm256_cmpeq_epi32(d[i], z);
            _mm256_store_si256((__m256i *)(out + h * 32 + 8 * i), _mm256_blendv_epi8(bits, sub, zero));
        }
    }
}

/* rows of one quad -> the 8 offset-value vectors (lo Q0..3, hi Q0..3) */
static inline __attribute__((always_inline)) void mxy_quad(const uint8_t *r, int64_t N2, __m256i wv[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i tab = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i r0 = _mm256_loadu_si256((const __m256i *)r);
    const __m256i r1 = _mm256_loadu_si256((const __m256i *)(r + N2));
    const __m256i r2 = _mm256_loadu_si256((const __m256i *)(r + 2 * N2));
    const __m256i r3 = _mm256_loadu_si256((const __m256i *)(r + 3 * N2));
    const __m256i A = _mm256_unpacklo_epi8(r0, r1), B = _mm256_unpackhi_epi8(r0, r1);
    const __m256i C = _mm256_unpacklo_epi8(r2, r3), D = _mm256_unpackhi_epi8(r2, r3);
    __m256i Q[4];
    Q[0] = _mm256_unpacklo_epi16(A, C);
    Q[1] = _mm256_unpackhi_epi16(A, C);
    Q[2] = _mm256_unpacklo_epi16(B, D);
    Q[3] = _mm256_unpackhi_epi16(B, D);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        wv[i] = _mm256_shuffle_epi8(tab, _mm256_and_si256(Q[i], m4));
        wv[4 + i] = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(Q[i], 4), m4));
    }
}

static inline __attribute__((always_inline)) void mxy_finish(const __m256i a32[8], float xs, int32_t corr,
                                                             const float *sf, float *f) {
    const __m256 vs = _mm256_set1_ps(xs);
    const __m256i vc = _mm256_set1_epi32(corr);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const __m256 is = _mm256_cvtepi32_ps(_mm256_sub_epi32(a32[i], vc));
        __m256 F = _mm256_load_ps(f + 8 * i);
        F = _mm256_fmadd_ps(is, _mm256_mul_ps(_mm256_load_ps(sf + 8 * i), vs), F);
        _mm256_store_ps(f + 8 * i, F);
    }
}

/* one group x one 32-byte-column block, one token, straight from the rows -> int32 group sums
 * (with the +12 offset) */
static inline __attribute__((always_inline)) void mxy_group1(const uint8_t *wp, int64_t N2, const int8_t *xq,
                                                             __m256i a32[8]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[8];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 4 * h; q < 4 * h + 4; q++) {
            __m256i wv[8];
            mxy_quad(wp + (int64_t)(4 * q) * N2, N2, wv);
            const __m256i X = _mm256_set1_epi32(mx_load_i32(xq + 4 * q));
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(wv[i], X));
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const __m256i s = _mm256_madd_epi16(acc[i], ones);
            a32[i] = h ? _mm256_add_epi32(a32[i], s) : s;
        }
    }
}

/* one group x one block -> the 64 offset-value vectors */
static inline __attribute__((always_inline)) void mxy_unpack(const uint8_t *wp, int64_t N2, __m256i *nb) {
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        __m256i wv[8];
        mxy_quad(wp + (int64_t)(4 * q) * N2, N2, wv);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm256_store_si256(nb + 8 * q + i, wv[i]);
    }
}

static inline __attribute__((always_inline)) void mxy_groupn(const __m256i *nb, const int8_t *xq, __m256i a32[8]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[8];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 4 * h; q < 4 * h + 4; q++) {
            const __m256i X = _mm256_set1_epi32(mx_load_i32(xq + 4 * q));
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(_mm256_load_si256(nb + 8 * q + i), X));
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const __m256i s = _mm256_madd_epi16(acc[i], ones);
            a32[i] = h ? _mm256_add_epi32(a32[i], s) : s;
        }
    }
}

/* One token (T = 1, decode), one group, blocks [0, nb) of 32 byte-columns from wg: the group's rows
 * swept a quad at a time, front to back, the int16 sums of every block in L1 (acc16) and folded into
 * int32 (acc32) after each half of 4 quads, in the same quad order as mxy_group1 (the same
 * integers, so the same bits). When the window is whole rows (32 * nb == N2) the group is one
 * contiguous stretch consumed at 128 bytes per block step and is prefetched MXY_LIN bytes ahead of
 * it; otherwise the next quad's rows. The block-by-block order of mxy_group1 reads 32 rows x 32
 * bytes per block (32 streams N2 apart). */
#ifndef MXY_LIN
#define MXY_LIN 8192
#endif
#ifndef MXY_SWB
#define MXY_SWB 32 /* blocks per sweep window (0: block by block) */
#endif
static inline __attribute__((always_inline)) void mxy_sweep1(const uint8_t *wg, int64_t N2, int64_t nb,
                                                             const int8_t *xq, __m256i *acc16, __m256i *acc32) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int whole = 32 * nb == N2;
    for (int h = 0; h < 2; h++) {
        for (int64_t i = 0; i < 8 * nb; i++) acc16[i] = _mm256_setzero_si256();
        for (int q = 4 * h; q < 4 * h + 4; q++) {
            const __m256i X = _mm256_set1_epi32(mx_load_i32(xq + 4 * q));
            const uint8_t *rq = wg + (int64_t)(4 * q) * N2;
            for (int64_t b = 0; b < nb; b++) {
                moed_quad_sweep_prefetch(rq, N2, b, q, whole, MXY_LIN);
                __m256i wv[8];
                mxy_quad(rq + 32 * b, N2, wv);
                __m256i *acc = acc16 + 8 * b;
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(wv[i], X));
            }
        }
        for (int64_t i = 0; i < 8 * nb; i++) {
            const __m256i s = _mm256_madd_epi16(acc16[i], ones);
            acc32[i] = h ? _mm256_add_epi32(acc32[i], s) : s;
        }
    }
}

static void mxy_strip(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                      int64_t ld) {
    enum { VW = 32, BF = 2 * VW };
    const int64_t jv = j0 + (j1 - j0) / VW * VW; /* [jv, j1): scalar tail */
    if (jv < j1) moed_strip_mxfp4_scalar(w, a, jv, j1, lo + (jv - j0), hi + (jv - j0), ld);
    if (jv == j0) return;
    const uint8_t *W = (const uint8_t *)w->w, *E = (const uint8_t *)w->s;
    const int64_t N = w->N, N2 = w->N / 2, K = a->K, G = a->K / MOED_GROUP;
    const int T = a->T;
    _Alignas(64) float facc[MX_FACC];
    _Alignas(64) float sf[BF];
    _Alignas(64) __m256i nbuf[64];
    int32_t corr[MX_TCHUNK];
    int64_t nbmax = MX_FACC / BF / T;
    if (nbmax < 1) nbmax = 1;
    for (int64_t sb = j0; sb < jv; sb += nbmax * VW) {
        int64_t nb = (jv - sb) / VW;
        if (nb > nbmax) nb = nbmax;
        const int64_t fst = nb * BF;
        memset(facc, 0, sizeof(float) * (size_t)(fst * T));
        if (T == 1 && MXY_SWB > 0) {
            _Alignas(64) __m256i acc16[8 * (MXY_SWB > 0 ? MXY_SWB : 1)], acc32[8 * (MXY_SWB > 0 ? MXY_SWB : 1)];
            for (int64_t g = 0; g < G; g++) {
                mx_corr(a, g, corr);
                for (int64_t b0 = 0; b0 < nb; b0 += MXY_SWB) {
                    const int64_t nw = nb - b0 < MXY_SWB ? nb - b0 : MXY_SWB;
                    mxy_sweep1(W + g * MOED_GROUP * N2 + sb + b0 * VW, N2, nw, a->xq + g * MOED_GROUP, acc16, acc32);
                    for (int64_t b = b0; b < b0 + nw; b++) {
                        mxy_scales(E + g * N + sb + b * VW, N2, sf);
                        mxy_finish(acc32 + 8 * (b - b0), a->xs[g], corr[0], sf, facc + b * BF);
                    }
                }
            }
        }
        for (int64_t g = 0; g < G && !(T == 1 && MXY_SWB > 0); g++) {
            const uint8_t *wg = W + g * MOED_GROUP * N2;
            mx_corr(a, g, corr);
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW;
                mxy_scales(E + g * N + c0, N2, sf);
                const uint8_t *wp = wg + c0;
                /* one prefetch per cache line: every other 32-byte block, and the last */
                if (g + 1 < G && ((b & 1) == 0 || b == nb - 1)) mx_prefetch_next(wp, N2);
                __m256i a32[8];
                if (T == 1) {
                    mxy_group1(wp, N2, a->xq + g * MOED_GROUP, a32);
                    mxy_finish(a32, a->xs[g], corr[0], sf, facc + b * BF);
                } else {
                    mxy_unpack(wp, N2, nbuf);
                    for (int t = 0; t < T; t++) {
                        mxy_groupn(nbuf, a->xq + (int64_t)t * K + g * MOED_GROUP, a32);
                        mxy_finish(a32, a->xs[(int64_t)t * G + g], corr[t], sf, facc + (int64_t)t * fst + b * BF);
                    }
                }
            }
        }
        for (int t = 0; t < T; t++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW;
                mx_store_block(facc + (int64_t)t * fst + b * BF, VW, VW, lo + (int64_t)t * ld + (c0 - j0),
                               hi + (int64_t)t * ld + (c0 - j0));
            }
    }
}

#pragma GCC pop_options

void moed_strip_mxfp4_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                           int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    for (int t0 = 0; t0 < a->T; t0 += MX_TCHUNK) {
        moed_act sub;
        mx_sub_act(a, t0, &sub);
        mxy_strip(w, &sub, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

#else /* !MOED_X86 */

void moed_strip_mxfp4_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                           int64_t ld) {
    moed_strip_mxfp4_scalar(w, a, j0, j1, lo, hi, ld);
}

void moed_strip_mxfp4_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                             int64_t ld) {
    moed_strip_mxfp4_scalar(w, a, j0, j1, lo, hi, ld);
}

void moed_strip_mxfp4_avx512vnni(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                                 float *hi, int64_t ld) {
    moed_strip_mxfp4_scalar(w, a, j0, j1, lo, hi, ld);
}

#endif
