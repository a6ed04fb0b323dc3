/* bf16 strip kernels (see moed_cpu.h): w uint16 bf16 bits [K][N], x float [T][K].
 *
 * Same blocking as strip_fp32.c (columns in SIMD lanes, k outer, K in chunks so that token blocks
 * reuse the chunk's weights from the caches). bf16 -> fp32 with the even/odd trick: a vector of
 * 2n bf16 read as n 32-bit lanes gives the odd columns as (lane & 0xFFFF0000) and the even ones
 * as (lane << 16), so the accumulators hold even and odd columns apart; they are interleaved
 * back when stored (and split again when a later K chunk reloads them). */
#include <stdint.h>
#include <string.h>

#include "moed_cpu.h"

#ifndef MOED_STRIP_KC
#define MOED_STRIP_KC 8 /* rows of K per chunk: each chunk sweeps the whole strip width (DRAM/TLB locality) */
#endif
#ifndef MOED_STRIP_KC1
/* 2 <= T <= 4 (AVX-512; T == 2 on AVX2): 2 rows per chunk. Fewer concurrent row streams measured
 * 1.5x faster from DRAM on one thread (Zen 5: 20 -> 31 GB/s), the same on two; the accumulators'
 * extra L1 traffic is cheap. T == 1 sweeps the rows one by one instead (bf16_sweep_avx2). */
#define MOED_STRIP_KC1 2
#endif
#ifndef MOED_STRIP_HINT
#define MOED_STRIP_HINT _MM_HINT_T0
#endif
#ifndef MOED_STRIP_PF
#define MOED_STRIP_PF 16 /* software prefetch distance, rows of K (0: none) */
#endif
#ifndef MOED_SWEEP_COLS
#define MOED_SWEEP_COLS 1024 /* T == 1: columns of lo and of hi per sweep (8 KiB of accumulators) */
#endif
#ifndef MOED_SWEEP_PF
#define MOED_SWEEP_PF 4096 /* T == 1: software prefetch distance along the stream, bytes */
#endif

void moed_strip_bf16_scalar(const moed_matrix *mw, const moed_act *a, int64_t j0, int64_t j1,
                            float *lo, float *hi, int64_t ld) {
    const uint16_t *w = (const uint16_t *)mw->w;
    const int64_t K = mw->K, N = mw->N, H = N / 2, W = j1 - j0, xK = a->K;
    for (int t = 0; t < a->T; t++) {
        float *restrict ol = lo + (int64_t)t * ld;
        float *restrict oh = hi + (int64_t)t * ld;
        const float *xt = a->x + (int64_t)t * xK;
        for (int64_t c = 0; c < W; c++) ol[c] = oh[c] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float xv = xt[k];
            const uint16_t *restrict rl = w + k * N + j0;
            const uint16_t *restrict rh = rl + H;
            for (int64_t c = 0; c < W; c++) {
                ol[c] += xv * moed_bf16_to_f32(rl[c]);
                oh[c] += xv * moed_bf16_to_f32(rh[c]);
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

/* 16 bf16 (n of them valid, n clipped to 0..16; the rest read as 0) without reading past n */
MOED_INLINE __m256i bf16_load16_part(const uint16_t *p, int64_t n) {
    uint16_t buf[16] = {0};
    if (n > 0) memcpy(buf, p, (size_t)(n > 16 ? 16 : n) * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* 16 columns held as even (e) / odd (o) lanes -> p[0..n) */
MOED_INLINE void bf16_store16_avx2(float *p, __m256 e, __m256 o, int64_t n, const int MASKED) {
    const __m256 l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o); /* 0-3|8-11, 4-7|12-15 */
    const __m256 a = _mm256_permute2f128_ps(l, h, 0x20), b = _mm256_permute2f128_ps(l, h, 0x31);
    if (!MASKED) {
        _mm256_storeu_ps(p, a);
        _mm256_storeu_ps(p + 8, b);
    } else if (n > 0) {
        float buf[16];
        _mm256_storeu_ps(buf, a);
        _mm256_storeu_ps(buf + 8, b);
        memcpy(p, buf, (size_t)(n > 16 ? 16 : n) * sizeof(float));
    }
}

/* p[0..n) -> even / odd lanes */
MOED_INLINE void bf16_load16_avx2(const float *p, __m256 *e, __m256 *o, int64_t n, const int MASKED) {
    __m256 a, b;
    if (!MASKED) {
        a = _mm256_loadu_ps(p);
        b = _mm256_loadu_ps(p + 8);
    } else {
        float buf[16] = {0};
        if (n > 0) memcpy(buf, p, (size_t)(n > 16 ? 16 : n) * sizeof(float));
        a = _mm256_loadu_ps(buf);
        b = _mm256_loadu_ps(buf + 8);
    }
    /* shuffle gives columns 0 2 8 10 | 4 6 12 14; the 64-bit permute puts them in order */
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* one block: NU units (16 columns each) of lo and of hi, TB tokens, rows [0, kn) of a chunk */
MOED_INLINE void bf16_blk_avx2(const uint16_t *wl, const uint16_t *wh, int64_t N, int64_t kn,
                               const float *x, int64_t xK, float *ol, float *oh, int64_t ld, int first,
                               int64_t rem, const int NU, const int TB, const int MASKED) {
    __m256 le[2][2], lod[2][2], he[2][2], hod[2][2]; /* [TB][NU] */
    const __m256i himask = _mm256_set1_epi32((int)0xFFFF0000u);
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            if (first) {
                le[t][u] = lod[t][u] = he[t][u] = hod[t][u] = _mm256_setzero_ps();
            } else {
                bf16_load16_avx2(ol + t * ld + 16 * u, &le[t][u], &lod[t][u], rem - 16 * u, MASKED);
                bf16_load16_avx2(oh + t * ld + 16 * u, &he[t][u], &hod[t][u], rem - 16 * u, MASKED);
            }
        }
    for (int64_t k = 0; k < kn; k++) {
        const uint16_t *rl = wl + k * N, *rh = wh + k * N;
        if (MOED_STRIP_PF > 0) {
            const uintptr_t pl = (uintptr_t)rl + (uintptr_t)(MOED_STRIP_PF * N * 2), ph = (uintptr_t)rh + (uintptr_t)(MOED_STRIP_PF * N * 2);
#pragma GCC unroll 8
            for (int i = 0; i < (NU + 1) / 2; i++) {
                _mm_prefetch((const char *)(pl + 64 * i), MOED_STRIP_HINT);
                _mm_prefetch((const char *)(ph + 64 * i), MOED_STRIP_HINT);
            }
        }
        __m256 vle[2], vlo[2], vhe[2], vho[2];
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            const __m256i rawl = MASKED ? bf16_load16_part(rl + 16 * u, rem - 16 * u)
                                        : _mm256_loadu_si256((const __m256i *)(rl + 16 * u));
            const __m256i rawh = MASKED ? bf16_load16_part(rh + 16 * u, rem - 16 * u)
                                        : _mm256_loadu_si256((const __m256i *)(rh + 16 * u));
            vle[u] = _mm256_castsi256_ps(_mm256_slli_epi32(rawl, 16));
            vlo[u] = _mm256_castsi256_ps(_mm256_and_si256(rawl, himask));
            vhe[u] = _mm256_castsi256_ps(_mm256_slli_epi32(rawh, 16));
            vho[u] = _mm256_castsi256_ps(_mm256_and_si256(rawh, himask));
        }
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) {
            const __m256 xb = _mm256_broadcast_ss(x + t * xK + k);
#pragma GCC unroll 4
            for (int u = 0; u < NU; u++) {
                le[t][u] = _mm256_fmadd_ps(vle[u], xb, le[t][u]);
                lod[t][u] = _mm256_fmadd_ps(vlo[u], xb, lod[t][u]);
                he[t][u] = _mm256_fmadd_ps(vhe[u], xb, he[t][u]);
                hod[t][u] = _mm256_fmadd_ps(vho[u], xb, hod[t][u]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            bf16_store16_avx2(ol + t * ld + 16 * u, le[t][u], lod[t][u], rem - 16 * u, MASKED);
            bf16_store16_avx2(oh + t * ld + 16 * u, he[t][u], hod[t][u], rem - 16 * u, MASKED);
        }
}

/* T == 1: the rows of the block front to back, each row's lo columns then its hi columns, so
 * the matrix is read as one contiguous stream (the lo/hi blocks above read 4 streams 1.5-4 KiB
 * apart). The accumulators live in L1 in the kernel's split even/odd layout (no shuffles per
 * row), MOED_SWEEP_COLS columns of lo and of hi at a time; each column still adds its rows in k
 * order with one FMA each, so the bits are those of the blocks. In-process A/B on Zen 5, 2
 * threads, 8 experts a call: 33-35 -> 39-41 GB/s (the speed of the same bytes in row-major). */
MOED_INLINE void bf16_sweep_unit_avx2(const uint16_t *r, float *ac, __m256 xb, int64_t n, const int MASKED) {
    const __m256i himask = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i raw = MASKED ? bf16_load16_part(r, n) : _mm256_loadu_si256((const __m256i *)r);
    __m256 e = _mm256_load_ps(ac), o = _mm256_load_ps(ac + 8);
    e = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), xb, e);
    o = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(raw, himask)), xb, o);
    _mm256_store_ps(ac, e);
    _mm256_store_ps(ac + 8, o);
}

static void bf16_sweep_avx2(const uint16_t *w, int64_t K, int64_t N, int64_t j0, int64_t W, const float *x,
                            float *lo, float *hi) {
    float acc[2 * MOED_SWEEP_COLS] __attribute__((aligned(64)));
    const int64_t H = N / 2;
    for (int64_t c0 = 0; c0 < W; c0 += MOED_SWEEP_COLS) {
        const int64_t cw = W - c0 < MOED_SWEEP_COLS ? W - c0 : MOED_SWEEP_COLS, full = cw / 16 * 16;
        const int64_t used = (cw + 15) / 16 * 16;
        for (int64_t i = 0; i < used; i += 8) {
            _mm256_store_ps(acc + i, _mm256_setzero_ps());
            _mm256_store_ps(acc + MOED_SWEEP_COLS + i, _mm256_setzero_ps());
        }
        for (int64_t k = 0; k < K; k++) {
            const __m256 xb = _mm256_set1_ps(x[k]);
            for (int h = 0; h < 2; h++) {
                const uint16_t *r = w + k * N + j0 + c0 + h * H;
                float *ac = acc + h * MOED_SWEEP_COLS;
                int64_t c = 0;
                for (; c < full; c += 16) {
                    if ((c & 31) == 0) _mm_prefetch((const char *)(r + c) + MOED_SWEEP_PF, MOED_STRIP_HINT);
                    bf16_sweep_unit_avx2(r + c, ac + c, xb, 16, 0);
                }
                if (c < cw) bf16_sweep_unit_avx2(r + c, ac + c, xb, cw - c, 1);
            }
        }
        for (int h = 0; h < 2; h++) {
            float *out = (h ? hi : lo) + c0;
            const float *ac = acc + h * MOED_SWEEP_COLS;
            for (int64_t c = 0; c < cw; c += 16)
                bf16_store16_avx2(out + c, _mm256_load_ps(ac + c), _mm256_load_ps(ac + c + 8), cw - c, c + 16 > cw);
        }
    }
}

#define BF16_AVX2_CALL(NU, TB)                                                                     \
    do {                                                                                           \
        if (rem >= 16 * (NU))                                                                      \
            bf16_blk_avx2(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NU, TB, 0);               \
        else                                                                                       \
            bf16_blk_avx2(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NU, TB, 1);               \
    } while (0)

void moed_strip_bf16_avx2(const moed_matrix *mw, const moed_act *a, int64_t j0, int64_t j1,
                          float *lo, float *hi, int64_t ld) {
    const uint16_t *w = (const uint16_t *)mw->w;
    const int64_t K = mw->K, N = mw->N, H = N / 2, W = j1 - j0, xK = a->K;
    const int T = a->T;
    if (T == 1) {
        bf16_sweep_avx2(w, K, N, j0, W, a->x, lo, hi);
        return;
    }
    /* 16 columns of lo + 16 of hi x 2 tokens */
    const int64_t CB = 16;
    const int64_t KC = T <= 2 ? MOED_STRIP_KC1 : MOED_STRIP_KC;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = K - k0 < KC ? K - k0 : KC;
        const int first = k0 == 0;
        for (int64_t c0 = 0; c0 < W; c0 += CB) {
            const int64_t rem = W - c0;
            const uint16_t *wl = w + k0 * N + j0 + c0, *wh = wl + H;
            int t0 = 0;
            for (; t0 + 2 <= T; t0 += 2) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                BF16_AVX2_CALL(1, 2);
            }
            if (t0 < T) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                BF16_AVX2_CALL(1, 1);
            }
        }
    }
}

#pragma GCC pop_options

/* --------------------------------------------------------------------------------------- AVX-512 */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

MOED_INLINE __mmask32 bf16_mask32(int64_t n) {
    return n >= 32 ? (__mmask32)0xFFFFFFFFu : (n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1));
}

/* 32 columns held as even / odd lanes -> p[0..32) under mask m */
MOED_INLINE void bf16_store32_avx512(float *p, __m512 e, __m512 o, __mmask32 m, const int MASKED) {
    const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 a = _mm512_permutex2var_ps(e, i0, o), b = _mm512_permutex2var_ps(e, i1, o);
    if (MASKED) {
        _mm512_mask_storeu_ps(p, (__mmask16)m, a);
        _mm512_mask_storeu_ps(p + 16, (__mmask16)(m >> 16), b);
    } else {
        _mm512_storeu_ps(p, a);
        _mm512_storeu_ps(p + 16, b);
    }
}

MOED_INLINE void bf16_load32_avx512(const float *p, __m512 *e, __m512 *o, __mmask32 m, const int MASKED) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 a = MASKED ? _mm512_maskz_loadu_ps((__mmask16)m, p) : _mm512_loadu_ps(p);
    const __m512 b = MASKED ? _mm512_maskz_loadu_ps((__mmask16)(m >> 16), p + 16) : _mm512_loadu_ps(p + 16);
    *e = _mm512_permutex2var_ps(a, ie, b);
    *o = _mm512_permutex2var_ps(a, io, b);
}

/* one block: NU units (32 columns each) of lo and of hi, TB tokens, rows [0, kn) of a chunk */
MOED_INLINE void bf16_blk_avx512(const uint16_t *wl, const uint16_t *wh, int64_t N, int64_t kn,
                                 const float *x, int64_t xK, float *ol, float *oh, int64_t ld, int first,
                                 int64_t rem, const int NU, const int TB, const int MASKED) {
    __m512 le[4][4], lod[4][4], he[4][4], hod[4][4]; /* [TB][NU] */
    __mmask32 m[4];
    const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);
#pragma GCC unroll 4
    for (int u = 0; u < NU; u++) m[u] = MASKED ? bf16_mask32(rem - 32 * u) : (__mmask32)0xFFFFFFFFu;
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            if (first) {
                le[t][u] = lod[t][u] = he[t][u] = hod[t][u] = _mm512_setzero_ps();
            } else {
                bf16_load32_avx512(ol + t * ld + 32 * u, &le[t][u], &lod[t][u], m[u], MASKED);
                bf16_load32_avx512(oh + t * ld + 32 * u, &he[t][u], &hod[t][u], m[u], MASKED);
            }
        }
    for (int64_t k = 0; k < kn; k++) {
        const uint16_t *rl = wl + k * N, *rh = wh + k * N;
        if (MOED_STRIP_PF > 0) {
            const uintptr_t pl = (uintptr_t)rl + (uintptr_t)(MOED_STRIP_PF * N * 2), ph = (uintptr_t)rh + (uintptr_t)(MOED_STRIP_PF * N * 2);
#pragma GCC unroll 8
            for (int i = 0; i < NU; i++) {
                _mm_prefetch((const char *)(pl + 64 * i), MOED_STRIP_HINT);
                _mm_prefetch((const char *)(ph + 64 * i), MOED_STRIP_HINT);
            }
        }
        __m512 vle[4], vlo[4], vhe[4], vho[4];
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            const __m512i rawl = MASKED ? _mm512_maskz_loadu_epi16(m[u], rl + 32 * u)
                                        : _mm512_loadu_si512((const void *)(rl + 32 * u));
            const __m512i rawh = MASKED ? _mm512_maskz_loadu_epi16(m[u], rh + 32 * u)
                                        : _mm512_loadu_si512((const void *)(rh + 32 * u));
            vle[u] = _mm512_castsi512_ps(_mm512_slli_epi32(rawl, 16));
            vlo[u] = _mm512_castsi512_ps(_mm512_and_si512(rawl, himask));
            vhe[u] = _mm512_castsi512_ps(_mm512_slli_epi32(rawh, 16));
            vho[u] = _mm512_castsi512_ps(_mm512_and_si512(rawh, himask));
        }
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) {
            const __m512 xb = _mm512_set1_ps(x[t * xK + k]);
#pragma GCC unroll 4
            for (int u = 0; u < NU; u++) {
                le[t][u] = _mm512_fmadd_ps(vle[u], xb, le[t][u]);
                lod[t][u] = _mm512_fmadd_ps(vlo[u], xb, lod[t][u]);
                he[t][u] = _mm512_fmadd_ps(vhe[u], xb, he[t][u]);
                hod[t][u] = _mm512_fmadd_ps(vho[u], xb, hod[t][u]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++)
#pragma GCC unroll 4
        for (int u = 0; u < NU; u++) {
            bf16_store32_avx512(ol + t * ld + 32 * u, le[t][u], lod[t][u], m[u], MASKED);
            bf16_store32_avx512(oh + t * ld + 32 * u, he[t][u], hod[t][u], m[u], MASKED);
        }
}

/* T == 1: one contiguous stream, accumulators in L1 (see bf16_sweep_avx2) */
MOED_INLINE void bf16_sweep_unit_avx512(const uint16_t *r, float *ac, __m512 xb, __mmask32 m, const int MASKED) {
    const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i raw = MASKED ? _mm512_maskz_loadu_epi16(m, r) : _mm512_loadu_si512((const void *)r);
    __m512 e = _mm512_load_ps(ac), o = _mm512_load_ps(ac + 16);
    e = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), xb, e);
    o = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(raw, himask)), xb, o);
    _mm512_store_ps(ac, e);
    _mm512_store_ps(ac + 16, o);
}

static void bf16_sweep_avx512(const uint16_t *w, int64_t K, int64_t N, int64_t j0, int64_t W, const float *x,
                              float *lo, float *hi) {
    float acc[2 * MOED_SWEEP_COLS] __attribute__((aligned(64)));
    const int64_t H = N / 2;
    for (int64_t c0 = 0; c0 < W; c0 += MOED_SWEEP_COLS) {
        const int64_t cw = W - c0 < MOED_SWEEP_COLS ? W - c0 : MOED_SWEEP_COLS, full = cw / 32 * 32;
        const int64_t used = (cw + 31) / 32 * 32;
        const __mmask32 tail = bf16_mask32(cw - full);
        for (int64_t i = 0; i < used; i += 16) {
            _mm512_store_ps(acc + i, _mm512_setzero_ps());
            _mm512_store_ps(acc + MOED_SWEEP_COLS + i, _mm512_setzero_ps());
        }
        for (int64_t k = 0; k < K; k++) {
            const __m512 xb = _mm512_set1_ps(x[k]);
            for (int h = 0; h < 2; h++) {
                const uint16_t *r = w + k * N + j0 + c0 + h * H;
                float *ac = acc + h * MOED_SWEEP_COLS;
                for (int64_t c = 0; c < full; c += 32) {
                    _mm_prefetch((const char *)(r + c) + MOED_SWEEP_PF, MOED_STRIP_HINT);
                    bf16_sweep_unit_avx512(r + c, ac + c, xb, 0, 0);
                }
                if (tail) bf16_sweep_unit_avx512(r + full, ac + full, xb, tail, 1);
            }
        }
        for (int h = 0; h < 2; h++) {
            float *out = (h ? hi : lo) + c0;
            const float *ac = acc + h * MOED_SWEEP_COLS;
            for (int64_t c = 0; c < full; c += 32)
                bf16_store32_avx512(out + c, _mm512_load_ps(ac + c), _mm512_load_ps(ac + c + 16), 0, 0);
            if (tail)
                bf16_store32_avx512(out + full, _mm512_load_ps(ac + full), _mm512_load_ps(ac + full + 16), tail, 1);
        }
    }
}

#define BF16_AVX512_CALL(NU, TB)                                                                   \
    do {                                                                                           \
        if (rem >= 32 * (NU))                                                                      \
            bf16_blk_avx512(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NU, TB, 0);             \
        else                                                                                       \
            bf16_blk_avx512(wl, wh, N, kn, xp, xK, ol, oh, ld, first, rem, NU, TB, 1);             \
    } while (0)

void moed_strip_bf16_avx512(const moed_matrix *mw, const moed_act *a, int64_t j0, int64_t j1,
                            float *lo, float *hi, int64_t ld) {
    const uint16_t *w = (const uint16_t *)mw->w;
    const int64_t K = mw->K, N = mw->N, H = N / 2, W = j1 - j0, xK = a->K;
    const int T = a->T;
    if (T == 1) {
        bf16_sweep_avx512(w, K, N, j0, W, a->x, lo, hi);
        return;
    }
    /* 32 columns of lo + 32 of hi x 4 tokens */
    const int64_t CB = 32;
    const int64_t KC = T <= 4 ? MOED_STRIP_KC1 : MOED_STRIP_KC;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = K - k0 < KC ? K - k0 : KC;
        const int first = k0 == 0;
        for (int64_t c0 = 0; c0 < W; c0 += CB) {
            const int64_t rem = W - c0;
            const uint16_t *wl = w + k0 * N + j0 + c0, *wh = wl + H;
            int t0 = 0;
            for (; t0 + 4 <= T; t0 += 4) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                BF16_AVX512_CALL(1, 4);
            }
            if (t0 < T) {
                const float *xp = a->x + (int64_t)t0 * xK + k0;
                float *ol = lo + (int64_t)t0 * ld + c0, *oh = hi + (int64_t)t0 * ld + c0;
                switch (T - t0) {
                case 1: BF16_AVX512_CALL(1, 1); break;
                case 2: BF16_AVX512_CALL(1, 2); break;
                default: BF16_AVX512_CALL(1, 3); break;
                }
            }
        }
    }
}

#pragma GCC pop_options

#else /* not x86: the SIMD names run the portable code */

void moed_strip_bf16_avx2(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                          float *hi, int64_t ld) {
    moed_strip_bf16_scalar(w, a, j0, j1, lo, hi, ld);
}
void moed_strip_bf16_avx512(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo,
                            float *hi, int64_t ld) {
    moed_strip_bf16_scalar(w, a, j0, j1, lo, hi, ld);
}

#endif
