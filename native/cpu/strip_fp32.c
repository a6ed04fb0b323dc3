/* fp32 strip kernels (see moed_cpu.h): w float [K][N], x float [T][K].
 *
 * w is k-major, so the SIMD paths vectorise along the columns: for each k, broadcast x[t][k] and
 * FMA it against the row segments w[k][j0 + c ..] (lo) and w[k][N/2 + j0 + c ..] (hi). A block of
 * columns x a few tokens of accumulators stays in registers; K is walked in chunks of KC rows and
 * inside a chunk the token blocks reuse the chunk's weights from the caches, so DRAM reads every
 * weight once whatever T is. Column tails use masked loads and stores. */
#include <stdint.h>
#include <string.h>

#include "moed_cpu.h"

#ifndef MOED_STRIP_KC
#define MOED_STRIP_KC 8 /* rows of K per chunk: each chunk sweeps the whole strip width (DRAM/TLB locality) */
#endif
#ifndef MOED_STRIP_KC1
#define MOED_STRIP_KC1 MOED_STRIP_KC /* the same when one token block covers T */
#endif
#ifndef MOED_STRIP_HINT
#define MOED_STRIP_HINT _MM_HINT_T0
#endif
#ifndef MOED_STRIP_PF
#define MOED_STRIP_PF 16 /* software prefetch distance, rows of K (0: none) */
#endif

void moed_strip_fp32_scalar(const moed_matrix *mw, const moed_act *a, int64_t j0, int64_t j1,
                            float *lo, float *hi, int64_t ld) {
    const float *w = (const float *)mw->w;
    const int64_t K = mw->K, N = mw->N, H = N / 2, W = j1 - j0, xK = a->K;
    for (int t = 0; t < a->T; t++) {
        float *restrict ol = lo + (int64_t)t * ld;
        float *restrict oh = hi + (int64_t)t * ld;
        const float *xt = a->x + (int64_t)t * xK;
        for (int64_t c = 0; c < W; c++) ol[c] = oh[c] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float xv = xt[k];
            const float *restrict rl = w + k * N + j0;
            const float *restrict rh = rl + H;
            for (int64_t c = 0; c < W; c++) {
                ol[c] += xv * rl[c];
                oh[c] += xv * rh[c];
            }
        }
    }
}

#if MOED_X86
#include <immintrin.h>

#define MOED_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------ AVX2 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* lane mask for n valid floats of 8 (n clipped to 0..8) */
MOED_INLINE __m256i f32_mask8(int64_t n) {
    n = n < 0 ? 0 : (n > 8 ? 8 : n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* one block: NV vectors (8 columns each) of lo and of hi, TB tokens, rows [0, kn) of a chunk.
 * wl/wh: w[k0][j0 + c0] and w[k0][H + j0 + c0]; x: x[t0][k0]; ol/oh: lo/hi[t0*ld + c0]. */
MOED_INLINE void f32_blk_avx2(const float *wl, const float *wh, int64_t N, int64_t kn, const float *x,
                              int64_t xK, float *ol, float *oh, int64_t ld, int first, int64_t rem,
                              const int NV, const int TB, const int MASKED) {
    __m256 al[4][4], ah[4][4]; /* [TB][NV], fixed sizes so that they live in registers */
    __m256i m[4];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) m[v] = MASKED ? f32_mask8(rem - 8 * v) : _mm256_set1_epi32(-1);
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            if (first) {
                al[t][v] = ah[t][v] = _mm256_setzero_ps();
            } else if (MASKED) {
                al[t][v] = _mm256_maskload_ps(ol + t * ld + 8 * v, m[v]);
                ah[t][v] = _mm256_maskload_ps(oh + t * ld + 8 * v, m[v]);
            } else {
                al[t][v] = _mm256_loadu_ps(ol + t * ld + 8 * v);
                ah[t][v] = _mm256_loadu_ps(oh + t * ld + 8 * v);
            }
        }
    for (int64_t k = 0; k < kn; k++) {
        const float *rl = wl + k * N, *rh = wh + k * N;
        if (MOED_STRIP_PF > 0) {
            const uintptr_t pl = (uintptr_t)rl + (uintptr_t)(MOED_STRIP_PF * N * 4), ph = (uintptr_t)rh + (uintptr_t)(MOED_STRIP_PF * N * 4);
#pragma GCC unroll 8
            for (int i = 0; i < (NV + 1) / 2; i++) {
                _mm_prefetch((const char *)(pl + 64 * i), MOED_STRIP_HINT);
                _mm_prefetch((const char *)(ph + 64 * i), MOED_STRIP_HINT);
            }
        }
        __m256 vl[4], vh[4];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            vl[v] = MASKED ? _mm256_maskload_ps(rl + 8 * v, m[v]) : _mm256_loadu_ps(rl + 8 * v);
            vh[v] = MASKED ? _mm256_maskload_ps(rh + 8 * v, m[v]) : _mm256_loadu_ps(rh + 8 * v);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            const __m256 xb = _mm256_broadcast_ss(x + t * xK + k);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) {
                al[t][v] = _mm256_fmadd_ps(vl[v], xb, al[t][v]);
                ah[t][v] = _mm256_fmadd_ps(vh[v], xb, ah[t][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            if (MASKED) {
                _mm256_maskstore_ps(ol + t * ld + 8 * v, m[v], al[t][v]);
                _mm256_maskstore_ps(oh + t * ld + 8 * v, m[v], ah[t][v]);
            } else {
                _mm256_storeu_ps(ol + t * ld + 8 * v, al[t][v]);
                _mm256_storeu_ps(oh + t * ld + 8 * v, ah[t][v]);
            }
        }
}

#define F32_AVX2_CALL(NV, TB)                                                                      \
    do {                                                                                           \
        if (rem >= 8 * (NV))                                                                       \
            f32_blk_avx2(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NV, TB, 0);                \
        else                                                                                       \
            f32_blk_avx2(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NV, TB, 1);                \
    } while (0)

void moed_strip_fp32_avx2(const moed_matrix *mw, const moed_act *a, int64_t j0, int64_t j1,
                          float *lo, float *hi, int64_t ld) {
    const float *w = (const float *)mw->w;
    const int64_t K = mw->K, N = mw->N, H = N / 2, W = j1 - j0, xK = a->K;
    const int T = a->T;
    /* T == 1: 32 columns of lo + 32 of hi (8 accumulators); else 16 + 16 columns x 2 tokens */
    const int64_t CB = T == 1 ? 32 : 16;
    const int64_t KC = T <= 2 ? MOED_STRIP_KC1 : MOED_STRIP_KC;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = K - k0 < KC ? K - k0 : KC;
        const int first = k0 == 0;
        for (int64_t c0 = 0; c0 < W; c0 += CB) {
            const int64_t rem = W - c0;
            const float *wl = w + k0 * N + j0 + c0, *wh = wl + H;
            if (T == 1) {
                const float *xp = a->x + k0;
                float *ol = lo + c0, *oh = hi + c0;
                F32_AVX2_CALL(4, 1);
                continue;
            }
            int t0 = 0;
            for (; t0 + 2 <= T; t0 += 2) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                F32_AVX2_CALL(2, 2);
            }
            if (t0 < T) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                F32_AVX2_CALL(2, 1);
            }
        }
    }
}

#pragma GCC pop_options

/* --------------------------------------------------------------------------------------- AVX-512 */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

MOED_INLINE __mmask16 f32_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1));
}

MOED_INLINE void f32_blk_avx512(const float *wl, const float *wh, int64_t N, int64_t kn, const float *x,
                                int64_t xK, float *ol, float *oh, int64_t ld, int first, int64_t rem,
                                const int NV, const int TB, const int MASKED) {
    __m512 al[4][4], ah[4][4]; /* [TB][NV], fixed sizes so that they live in registers */
    __mmask16 m[4];
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) m[v] = MASKED ? f32_mask16(rem - 16 * v) : (__mmask16)0xFFFF;
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            if (first) {
                al[t][v] = ah[t][v] = _mm512_setzero_ps();
            } else if (MASKED) {
                al[t][v] = _mm512_maskz_loadu_ps(m[v], ol + t * ld + 16 * v);
                ah[t][v] = _mm512_maskz_loadu_ps(m[v], oh + t * ld + 16 * v);
            } else {
                al[t][v] = _mm512_loadu_ps(ol + t * ld + 16 * v);
                ah[t][v] = _mm512_loadu_ps(oh + t * ld + 16 * v);
            }
        }
    for (int64_t k = 0; k < kn; k++) {
        const float *rl = wl + k * N, *rh = wh + k * N;
        if (MOED_STRIP_PF > 0) {
            const uintptr_t pl = (uintptr_t)rl + (uintptr_t)(MOED_STRIP_PF * N * 4), ph = (uintptr_t)rh + (uintptr_t)(MOED_STRIP_PF * N * 4);
#pragma GCC unroll 8
            for (int i = 0; i < NV; i++) {
                _mm_prefetch((const char *)(pl + 64 * i), MOED_STRIP_HINT);
                _mm_prefetch((const char *)(ph + 64 * i), MOED_STRIP_HINT);
            }
        }
        __m512 vl[4], vh[4];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            vl[v] = MASKED ? _mm512_maskz_loadu_ps(m[v], rl + 16 * v) : _mm512_loadu_ps(rl + 16 * v);
            vh[v] = MASKED ? _mm512_maskz_loadu_ps(m[v], rh + 16 * v) : _mm512_loadu_ps(rh + 16 * v);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            const __m512 xb = _mm512_set1_ps(x[t * xK + k]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) {
                al[t][v] = _mm512_fmadd_ps(vl[v], xb, al[t][v]);
                ah[t][v] = _mm512_fmadd_ps(vh[v], xb, ah[t][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            if (MASKED) {
                _mm512_mask_storeu_ps(ol + t * ld + 16 * v, m[v], al[t][v]);
                _mm512_mask_storeu_ps(oh + t * ld + 16 * v, m[v], ah[t][v]);
            } else {
                _mm512_storeu_ps(ol + t * ld + 16 * v, al[t][v]);
                _mm512_storeu_ps(oh + t * ld + 16 * v, ah[t][v]);
            }
        }
}

#define F32_AVX512_CALL(NV, TB)                                                                    \
    do {                                                                                           \
        if (rem >= 16 * (NV))                                                                      \
            f32_blk_avx512(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NV, TB, 0);              \
        else                                                                                       \
            f32_blk_avx512(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NV, TB, 1);              \
    } while (0)

void moed_strip_fp32_avx512(const moed_matrix *mw, const moed_act *a, int64_t j0, int64_t j1,
                            float *lo, float *hi, int64_t ld) {
    const float *w = (const float *)mw->w;
    const int64_t K = mw->K, N = mw->N, H = N / 2, W = j1 - j0, xK = a->K;
    const int T = a->T;
    /* T == 1: 64 columns of lo + 64 of hi (8 accumulators); else 32 + 32 columns x 4 tokens */
    const int64_t CB = T == 1 ? 64 : 32;
    const int64_t KC = T <= 4 ? MOED_STRIP_KC1 : MOED_STRIP_KC;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = K - k0 < KC ? K - k0 : KC;
        const int first = k0 == 0;
        for (int64_t c0 = 0; c0 < W; c0 += CB) {
            const int64_t rem = W - c0;
            const float *wl = w + k0 * N + j0 + c0, *wh = wl + H;
            if (T == 1) {
                const float *xp = a->x + k0;
                float *ol = lo + c0, *oh = hi + c0;
                F32_AVX512_CALL(4, 1);
                continue;
            }
            int t0 = 0;
            for (; t0 + 4 <= T; t0 += 4) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                F32_AVX512_CALL(2, 4);
            }
            if (t0 < T) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                switch (T - t0) {
                case 1: F32_AVX512_CALL(2, 1); break;
                case 2: F32_AVX512_CALL(2, 2); break;
                default: F32_AVX512_CALL(2, 3); break;
                }
            }
        }
    }
}

#pragma GCC pop_options

#else /* not x86: the SIMD names run the portable code */

void moed_strip_fp32_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                          float *hi, int64_t ld) {
    moed_strip_fp32_scalar(w, a, j0, j1, lo, hi, ld);
}
void moed_strip_fp32_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                            float *hi, int64_t ld) {
    moed_strip_fp32_scalar(w, a, j0, j1, lo, hi, ld);
}

#endif
