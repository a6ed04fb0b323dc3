/* int4 strip kernels (see moed_cpu.h): q uint8 [K][N/2] (low nibble = column j, high nibble =
 * column j + N/2), scale / min bf16 bits [K/32][N], int8 activations.
 *
 *   out[t][n] = sum_g  scale[g][n] * xs[t][g] * (sum_{k in g} xq[t][k] * q[k][n])  +  min[g][n] * xsum[t][g]
 *
 * The inner sum over a group is exact (integers); groups are combined in fp32 in order g = 0, 1, ...
 *
 * SIMD paths vectorise along columns (the layout is k-major). For four rows k..k+3 of a group the
 * bytes of a column block are interleaved (unpack epi8 then epi16) so that every 32-bit lane holds
 * the bytes (b[k][j], b[k+1][j], b[k+2][j], b[k+3][j]) of one byte-column j; masking / shifting
 * gives the nibbles of column j (low) and j + N/2 (high). maddubs against the broadcast dword
 * (xq[k], .., xq[k+3]) gives two int16 pair sums per column; they are accumulated in int16 over
 * the whole group (8 pair sums of |15*127*2| <= 30480: no overflow) and madd_epi16 with ones adds
 * the two neighbouring int16 lanes of a column into its exact int32 group sum. The unpacks work
 * inside 128-bit lanes, so the column order in a vector is permuted; scales are loaded in the same
 * permuted order and the fp32 accumulators (a small stack buffer) are un-permuted at the end.
 * Loop order: column super-block -> group -> column block -> token block -> 4-row quads, so the
 * rows of a strip are read once from memory per group and re-read from L1 by later token blocks.
 */
#include <string.h>

#include "moed_cpu.h"

/* ------------------------------------------------------------------------------------------ */
/* scalar (portable) path                                                                     */

#define I4_SCALAR_CHUNK 128

void moed_strip_int4_scalar(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                            int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    const uint8_t *W = (const uint8_t *)w->w;
    const uint16_t *S = (const uint16_t *)w->s, *M = (const uint16_t *)w->m;
    const int64_t N = w->N, N2 = w->N / 2, K = a->K, G = a->K / MOED_GROUP;
    int32_t il[I4_SCALAR_CHUNK], ih[I4_SCALAR_CHUNK];
    for (int64_t cb = j0; cb < j1; cb += I4_SCALAR_CHUNK) {
        const int64_t cw = (j1 - cb < I4_SCALAR_CHUNK) ? j1 - cb : I4_SCALAR_CHUNK;
        for (int t = 0; t < a->T; t++) {
            float *ol = lo + (int64_t)t * ld + (cb - j0), *oh = hi + (int64_t)t * ld + (cb - j0);
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G, *xsum = a->xsum + (int64_t)t * G;
            for (int64_t c = 0; c < cw; c++) ol[c] = oh[c] = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                memset(il, 0, sizeof(int32_t) * (size_t)cw);
                memset(ih, 0, sizeof(int32_t) * (size_t)cw);
                for (int i = 0; i < MOED_GROUP; i++) {
                    const int32_t xv = xq[g * MOED_GROUP + i];
                    if (xv == 0) continue;
                    const uint8_t *row = W + (g * MOED_GROUP + i) * N2 + cb;
                    for (int64_t c = 0; c < cw; c++) {
                        il[c] += xv * (int32_t)(row[c] & 15);
                        ih[c] += xv * (int32_t)(row[c] >> 4);
                    }
                }
                const float sx = xs[g], sm = xsum[g];
                const uint16_t *sl = S + g * N + cb, *sh = sl + N2, *ml = M + g * N + cb, *mh = ml + N2;
                for (int64_t c = 0; c < cw; c++) {
                    ol[c] += (float)il[c] * (moed_bf16_to_f32(sl[c]) * sx) + moed_bf16_to_f32(ml[c]) * sm;
                    oh[c] += (float)ih[c] * (moed_bf16_to_f32(sh[c]) * sx) + moed_bf16_to_f32(mh[c]) * sm;
                }
            }
        }
    }
}

#if MOED_X86
#include <immintrin.h>

#include "moed_simd.h"


/* fp32 accumulators of all tokens for one column super-block: T * blocks * (2 * block width) floats */
#define I4_FACC 8192

/* tokens per internal call (bounds the accumulator buffer) */
#define I4_TCHUNK 64

static void i4_sub_act(const moed_act *a, int t0, moed_act *sub) {
    const int64_t G = a->K / MOED_GROUP;
    *sub = *a;
    sub->T = (a->T - t0 < I4_TCHUNK) ? a->T - t0 : I4_TCHUNK;
    sub->x = a->x + (int64_t)t0 * a->K;
    sub->xq = a->xq + (int64_t)t0 * a->K;
    sub->xs = a->xs + (int64_t)t0 * G;
    sub->xsum = a->xsum + (int64_t)t0 * G;
}

/* element e of permuted vector i (4 vectors of lanes of 4 columns) -> column inside the block */
static inline int i4_perm_col(int i, int e) { return 16 * (e >> 2) + 4 * i + (e & 3); }

static inline int32_t i4_load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Software prefetch of the next group's rows of one column block, a group ahead (one line per
 * row: a misaligned block's second line is the next block's first). The k-major rows of a strip
 * are strided, which the hardware prefetchers follow poorly. Prefetching the scale rows as well
 * measured much slower (Zen 5), so they are left to the hardware. */
#ifndef I4_PF_GROUPS
#define I4_PF_GROUPS 1
#endif
#ifndef I4_PF_HINT
#define I4_PF_HINT _MM_HINT_T1 /* into L2: measured 5-15% faster than into L1 (Zen 5) */
#endif
static inline void i4_prefetch_next(const uint8_t *wp, int64_t N2) {
    const uint8_t *pf = wp + I4_PF_GROUPS * MOED_GROUP * N2;
    for (int k = 0; k < MOED_GROUP; k++) _mm_prefetch((const char *)(pf + k * N2), I4_PF_HINT);
}

/* write the un-permuted accumulators of one block (2*vw floats: lo then hi) for cw columns */
static void i4_store_block(const float *f, int vw, int64_t cw, float *ol, float *oh) {
    const int per = vw / 4; /* floats per permuted vector */
    for (int i = 0; i < 4; i++)
        for (int e = 0; e < per; e++) {
            const int c = i4_perm_col(i, e);
            if (c < cw) {
                ol[c] = f[i * per + e];
                oh[c] = f[vw + i * per + e];
            }
        }
}

/* ---------------------------------------- AVX-512 ---------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

/* bf16 scale rows (lo at p, hi at p + N2) of a 64-byte-column block -> 8 permuted fp32 vectors */
static inline __attribute__((always_inline)) void i4z_scales(const uint16_t *p, int64_t N2, __mmask32 m0,
                                                             __mmask32 m1, float *out) {
    const __m512i z = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const uint16_t *q = p + h * N2;
        __m512i a, b;
        if (m0 == (__mmask32)~0u && m1 == (__mmask32)~0u) {
            a = _mm512_loadu_si512((const void *)q);
            b = _mm512_loadu_si512((const void *)(q + 32));
        } else {
            a = _mm512_maskz_loadu_epi16(m0, q);
            b = _mm512_maskz_loadu_epi16(m1, q + 32);
        }
        const __m512i e = _mm512_shuffle_i64x2(a, b, 0x88), o = _mm512_shuffle_i64x2(a, b, 0xDD);
        _mm512_store_si512((void *)(out + h * 64 + 0), _mm512_unpacklo_epi16(z, e));
        _mm512_store_si512((void *)(out + h * 64 + 16), _mm512_unpackhi_epi16(z, e));
        _mm512_store_si512((void *)(out + h * 64 + 32), _mm512_unpacklo_epi16(z, o));
        _mm512_store_si512((void *)(out + h * 64 + 48), _mm512_unpackhi_epi16(z, o));
    }
}

#define I4Z_VNNI 0
#define I4Z_GROUP i4z_group
#define I4Z_STRIP i4z_strip
#include "strip_int4_avx512_body.h"
#undef I4Z_VNNI
#undef I4Z_GROUP
#undef I4Z_STRIP

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define I4Z_VNNI 1
#define I4Z_GROUP i4v_group
#define I4Z_STRIP i4v_strip
#include "strip_int4_avx512_body.h"
#undef I4Z_VNNI
#undef I4Z_GROUP
#undef I4Z_STRIP

#pragma GCC pop_options

void moed_strip_int4_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                            int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    for (int t0 = 0; t0 < a->T; t0 += I4_TCHUNK) {
        moed_act sub;
        i4_sub_act(a, t0, &sub);
        i4z_strip(w, &sub, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

void moed_strip_int4_avx512vnni(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                                float *hi, int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    for (int t0 = 0; t0 < a->T; t0 += I4_TCHUNK) {
        moed_act sub;
        i4_sub_act(a, t0, &sub);
        i4v_strip(w, &sub, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

/* ------------------------------------------ AVX2 ------------------------------------------ */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* bf16 scale rows (lo at p, hi at p + N2) of a 32-byte-column block -> 8 permuted fp32 vectors */
static inline __attribute__((always_inline)) void i4y_scales(const uint16_t *p, int64_t N2, float *out) {
    const __m256i z = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const uint16_t *q = p + h * N2;
        const __m256i a = _mm256_loadu_si256((const __m256i *)q), b = _mm256_loadu_si256((const __m256i *)(q + 16));
        const __m256i e = _mm256_permute2x128_si256(a, b, 0x20), o = _mm256_permute2x128_si256(a, b, 0x31);
        _mm256_store_si256((__m256i *)(out + h * 32 + 0), _mm256_unpacklo_epi16(z, e));
        _mm256_store_si256((__m256i *)(out + h * 32 + 8), _mm256_unpackhi_epi16(z, e));
        _mm256_store_si256((__m256i *)(out + h * 32 + 16), _mm256_unpacklo_epi16(z, o));
        _mm256_store_si256((__m256i *)(out + h * 32 + 24), _mm256_unpackhi_epi16(z, o));
    }
}

/* rows of one quad -> the 4 permuted dword-interleaved vectors */
static inline __attribute__((always_inline)) void i4y_quad(const uint8_t *r, int64_t N2, __m256i Q[4]) {
    const __m256i r0 = _mm256_loadu_si256((const __m256i *)r);
    const __m256i r1 = _mm256_loadu_si256((const __m256i *)(r + N2));
    const __m256i r2 = _mm256_loadu_si256((const __m256i *)(r + 2 * N2));
    const __m256i r3 = _mm256_loadu_si256((const __m256i *)(r + 3 * N2));
    const __m256i A = _mm256_unpacklo_epi8(r0, r1), B = _mm256_unpackhi_epi8(r0, r1);
    const __m256i C = _mm256_unpacklo_epi8(r2, r3), D = _mm256_unpackhi_epi8(r2, r3);
    Q[0] = _mm256_unpacklo_epi16(A, C);
    Q[1] = _mm256_unpackhi_epi16(A, C);
    Q[2] = _mm256_unpacklo_epi16(B, D);
    Q[3] = _mm256_unpackhi_epi16(B, D);
}

/* one quad's nibbles (lo Q0..3, hi Q0..3) times the token's 4 activations X, added to acc[8] (int16) */
static inline __attribute__((always_inline)) void i4y_quad_add(const __m256i Q[4], __m256i X, __m256i acc[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m256i wl = _mm256_and_si256(Q[i], m4);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(Q[i], 4), m4);
        acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(wl, X));
        acc[4 + i] = _mm256_add_epi16(acc[4 + i], _mm256_maddubs_epi16(wh, X));
    }
}

static inline __attribute__((always_inline)) void i4y_finish(const __m256i acc[8], float xs, float xsum,
                                                             const float *sf, const float *mf, float *f) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 vs = _mm256_set1_ps(xs), vm = _mm256_set1_ps(xsum);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const __m256 is = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i], ones));
        __m256 F = _mm256_load_ps(f + 8 * i);
        F = _mm256_fmadd_ps(is, _mm256_mul_ps(_mm256_load_ps(sf + 8 * i), vs), F);
        F = _mm256_fmadd_ps(_mm256_load_ps(mf + 8 * i), vm, F);
        _mm256_store_ps(f + 8 * i, F);
    }
}

/* one group x one 32-byte-column block, one token, straight from the rows */
static inline __attribute__((always_inline)) void i4y_group1(const uint8_t *wp, int64_t N2, const int8_t *xq,
                                                             __m256i acc[8]) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        __m256i Q[4];
        i4y_quad(wp + (int64_t)(4 * q) * N2, N2, Q);
        const __m256i X = _mm256_set1_epi32(i4_load_i32(xq + 4 * q));
        i4y_quad_add(Q, X, acc);
    }
}

/* one group x one 32-byte-column block -> the 64 nibble vectors (8 quads x lo Q0..3, hi Q0..3) */
static inline __attribute__((always_inline)) void i4y_unpack(const uint8_t *wp, int64_t N2, __m256i *nb) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        __m256i Q[4];
        i4y_quad(wp + (int64_t)(4 * q) * N2, N2, Q);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            _mm256_store_si256(nb + 8 * q + i, _mm256_and_si256(Q[i], m4));
            _mm256_store_si256(nb + 8 * q + 4 + i, _mm256_and_si256(_mm256_srli_epi16(Q[i], 4), m4));
        }
    }
}

/* one group x one block, one token, from the unpacked nibbles */
static inline __attribute__((always_inline)) void i4y_groupn(const __m256i *nb, const int8_t *xq, __m256i acc[8]) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
        const __m256i X = _mm256_set1_epi32(i4_load_i32(xq + 4 * q));
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(_mm256_load_si256(nb + 8 * q + i), X));
    }
}

/* One token (T = 1, decode), one group, blocks [0, nb) of 32 byte-columns from wg: the group's rows
 * swept a quad at a time, front to back (4 streams; the block-by-block order reads 32 rows x 32
 * bytes per block, 32 streams N2 apart, which the prefetchers serve badly), the int16 sums of every
 * block in L1 (accb: 8 vectors per block, added in the same quad order as i4y_group1: the same
 * integers, so the same bits), then each block's float step as i4y_group1 + i4y_finish do it. */
#ifndef I4Y_LIN
/* software prefetch distance (bytes) when a sweep window is whole rows (nb * 32 == N2): the group's
 * rows are then one contiguous stretch consumed at 128 bytes per block step, and the prefetch runs
 * that far ahead of it (0: the next quad's rows only). Zen 3, one thread, 64 experts' gate_up out
 * of cache: 4.9 -> 8.0 GB/s */
#define I4Y_LIN 8192
#endif
#ifndef I4Y_SPF
#define I4Y_SPF 1 /* prefetch a window's scale and min rows before its sweep */
#endif
#ifndef I4Y_SWB
#define I4Y_SWB 32 /* blocks per sweep window: 32 x 256 bytes of int16 sums */
#endif
static inline __attribute__((always_inline)) void i4y_sweep1(const uint8_t *wg, int64_t N2, int64_t nb,
                                                             const int8_t *xq, __m256i *accb) {
    for (int64_t i = 0; i < 8 * nb; i++) accb[i] = _mm256_setzero_si256();
    const int whole = 32 * nb == N2;
    for (int q = 0; q < 8; q++) {
        const __m256i X = _mm256_set1_epi32(i4_load_i32(xq + 4 * q));
        const uint8_t *rq = wg + (int64_t)(4 * q) * N2;
        for (int64_t b = 0; b < nb; b++) {
            moed_quad_sweep_prefetch(rq, N2, b, q, whole, I4Y_LIN);
            __m256i Q[4];
            i4y_quad(rq + 32 * b, N2, Q);
            __m256i *acc = accb + 8 * b;
            i4y_quad_add(Q, X, acc);
        }
    }
}

static void i4y_strip(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                      int64_t ld) {
    enum { VW = 32, BF = 2 * VW };
    const int64_t jv = j0 + (j1 - j0) / VW * VW; /* [jv, j1): scalar tail */
    if (jv < j1) moed_strip_int4_scalar(w, a, jv, j1, lo + (jv - j0), hi + (jv - j0), ld);
    if (jv == j0) return;
    const uint8_t *W = (const uint8_t *)w->w;
    const uint16_t *S = (const uint16_t *)w->s, *M = (const uint16_t *)w->m;
    const int64_t N = w->N, N2 = w->N / 2, K = a->K, G = a->K / MOED_GROUP;
    const int T = a->T;
    _Alignas(64) float facc[I4_FACC];
    _Alignas(64) float sfm[2 * BF];
    _Alignas(64) __m256i nbuf[64];
    int64_t nbmax = I4_FACC / BF / T;
    if (nbmax < 1) nbmax = 1;
    for (int64_t sb = j0; sb < jv; sb += nbmax * VW) {
        int64_t nb = (jv - sb) / VW;
        if (nb > nbmax) nb = nbmax;
        const int64_t fst = nb * BF;
        memset(facc, 0, sizeof(float) * (size_t)(fst * T));
        if (T == 1 && I4Y_SWB > 0) {
            _Alignas(64) __m256i accb[8 * (I4Y_SWB > 0 ? I4Y_SWB : 1)];
            for (int64_t g = 0; g < G; g++)
                for (int64_t b0 = 0; b0 < nb; b0 += I4Y_SWB) {
                    const int64_t nw = nb - b0 < I4Y_SWB ? nb - b0 : I4Y_SWB;
#if I4Y_SPF
                    /* the scale and min rows this window's float step reads after the sweep */
                    for (int h = 0; h < 2; h++)
                        for (int64_t c = 0; c < nw * VW; c += 32) {
                            _mm_prefetch((const char *)(S + g * N + h * N2 + sb + b0 * VW + c), _MM_HINT_T0);
                            _mm_prefetch((const char *)(M + g * N + h * N2 + sb + b0 * VW + c), _MM_HINT_T0);
                        }
#endif
                    i4y_sweep1(W + g * MOED_GROUP * N2 + sb + b0 * VW, N2, nw, a->xq + g * MOED_GROUP, accb);
                    for (int64_t b = b0; b < b0 + nw; b++) {
                        const int64_t c0 = sb + b * VW;
                        i4y_scales(S + g * N + c0, N2, sfm);
                        i4y_scales(M + g * N + c0, N2, sfm + BF);
                        i4y_finish(accb + 8 * (b - b0), a->xs[g], a->xsum[g], sfm, sfm + BF, facc + b * BF);
                    }
                }
        }
        for (int64_t g = 0; g < G && !(T == 1 && I4Y_SWB > 0); g++) {
            const uint8_t *wg = W + g * MOED_GROUP * N2;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW;
                i4y_scales(S + g * N + c0, N2, sfm);
                i4y_scales(M + g * N + c0, N2, sfm + BF);
                const uint8_t *wp = wg + c0;
                /* one prefetch per cache line: every other 32-byte block, and the last */
                if (g + 1 < G && ((b & 1) == 0 || b == nb - 1)) i4_prefetch_next(wp, N2);
                __m256i acc[8];
                if (T == 1) {
                    i4y_group1(wp, N2, a->xq + g * MOED_GROUP, acc);
                    i4y_finish(acc, a->xs[g], a->xsum[g], sfm, sfm + BF, facc + b * BF);
                } else {
                    i4y_unpack(wp, N2, nbuf);
                    for (int t = 0; t < T; t++) {
                        i4y_groupn(nbuf, a->xq + (int64_t)t * K + g * MOED_GROUP, acc);
                        i4y_finish(acc, a->xs[(int64_t)t * G + g], a->xsum[(int64_t)t * G + g], sfm, sfm + BF,
                                   facc + (int64_t)t * fst + b * BF);
                    }
                }
            }
        }
        for (int t = 0; t < T; t++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW;
                i4_store_block(facc + (int64_t)t * fst + b * BF, VW, VW, lo + (int64_t)t * ld + (c0 - j0),
                               hi + (int64_t)t * ld + (c0 - j0));
            }
    }
}

#pragma GCC pop_options

void moed_strip_int4_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                          int64_t ld) {
    if (j1 <= j0 || a->T <= 0) return;
    for (int t0 = 0; t0 < a->T; t0 += I4_TCHUNK) {
        moed_act sub;
        i4_sub_act(a, t0, &sub);
        i4y_strip(w, &sub, j0, j1, lo + (int64_t)t0 * ld, hi + (int64_t)t0 * ld, ld);
    }
}

#else /* !MOED_X86 */

void moed_strip_int4_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                          int64_t ld) {
    moed_strip_int4_scalar(w, a, j0, j1, lo, hi, ld);
}

void moed_strip_int4_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                            int64_t ld) {
    moed_strip_int4_scalar(w, a, j0, j1, lo, hi, ld);
}

void moed_strip_int4_avx512vnni(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                                float *hi, int64_t ld) {
    moed_strip_int4_scalar(w, a, j0, j1, lo, hi, ld);
}

#endif
