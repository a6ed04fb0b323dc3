/* dense bf16 kernels (see moed_cpu.h): W bf16 bits [rows][K] row-major, x float [T][K],
 * y[t*ldy + r] = dot(W[r, :], x[t, :]) for r in [r0, r1); any K. The caller prepares x once per
 * call (moed_dense_prepare: the ISA's split layout, shared by every task and every matrix of a
 * fused q/k/v call) so a task only streams its rows.
 *
 * Vectorised along K: up to 2 tokens one row at a time, 3 or more in blocks of 4 rows x up to 4
 * (AVX-512) or 2 (AVX2) tokens (see below; later token blocks find the rows in L1/L2). bf16 ->
 * fp32 with the even/odd trick (a vector of 2n bf16 read as n 32-bit lanes: even k = lane << 16,
 * odd k = lane & 0xFFFF0000); x is split into its even and odd k the same way once per call
 * (moed_dense_prepare). The K tail uses a masked load
 * (AVX-512) or a zero-padded copy (AVX2). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moed_cpu.h"

#ifndef MOED_DENSE_PF
#define MOED_DENSE_PF 4096 /* software prefetch distance along a thread's stream of rows, bytes (0: none) */
#endif

void moed_dense_bf16_scalar(const uint16_t *W, const float *x, int64_t Kp, int T, int64_t K, int64_t r0,
                            int64_t r1, float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *wr = W + r * K;
        for (int t = 0; t < T; t++) {
            const float *xt = x + (int64_t)t * Kp;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            int64_t k = 0;
            for (; k + 4 <= K; k += 4) {
                s0 += moed_bf16_to_f32(wr[k]) * xt[k];
                s1 += moed_bf16_to_f32(wr[k + 1]) * xt[k + 1];
                s2 += moed_bf16_to_f32(wr[k + 2]) * xt[k + 2];
                s3 += moed_bf16_to_f32(wr[k + 3]) * xt[k + 3];
            }
            for (; k < K; k++) s0 += moed_bf16_to_f32(wr[k]) * xt[k];
            y[(int64_t)t * ldy + r] = (s0 + s1) + (s2 + s3);
        }
    }
}

/* chunk of k of the split layout per ISA (scalar: x as it is) */
static int64_t dense_chunk(int isa) { return isa >= MOED_ISA_AVX512 ? 32 : isa == MOED_ISA_AVX2 ? 16 : 1; }

int64_t moed_dense_row_length(int isa, int64_t K) {
    const int64_t C = dense_chunk(isa);
    return (K + C - 1) / C * C;
}

/* x [T][K] -> xs [T][Kp] (Kp = moed_dense_row_length): per chunk of C k, the C/2 even k then the
 * C/2 odd k, zeros past K; the SIMD paths then load them straight. */
void moed_dense_prepare(int isa, const float *x, int T, int64_t K, float *xs) {
    const int64_t C = dense_chunk(isa), Kp = moed_dense_row_length(isa, K), H = C / 2;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * K;
        float *o = xs + (int64_t)t * Kp;
        if (C == 1) {
            memcpy(o, xt, sizeof(float) * (size_t)K);
            continue;
        }
        int64_t c = 0;
        for (; c + C <= K; c += C)
            for (int64_t i = 0; i < H; i++) {
                o[c + i] = xt[c + 2 * i];
                o[c + H + i] = xt[c + 2 * i + 1];
            }
        for (; c < Kp; c += C)
            for (int64_t i = 0; i < C; i++) {
                const int64_t k = c + (i < H ? 2 * i : 2 * (i - H) + 1);
                o[c + i] = k < K ? xt[k] : 0.0f;
            }
    }
}

#if MOED_X86
#include "moed_simd.h"

#define MOED_INLINE static inline __attribute__((always_inline))

/* Decode (T <= 2) takes one row at a time over all of K: a thread's rows follow each other in
 * memory, so it reads one contiguous stream, and a software prefetch runs MOED_DENSE_PF bytes
 * ahead along it. A block of 4 rows sharing each x load is 4 streams 4 KiB apart, which the
 * hardware prefetchers serve worse: in-process A/B on Zen 5, 2 threads, T = 1, AVX-512: 41 -> 46
 * GB/s on a 201 MB lm_head, 44 -> 52 GB/s on 4096 x 2048; AVX2 +11-14%. Each token keeps 4
 * independent accumulators (FMA latency). From 3 tokens on, the x loads a row block shares are
 * worth more (T = 4: 49 GB/s in blocks, 38 one row at a time), so T >= 3 keeps the row blocks. */
#define MOED_DENSE_TB 2 /* tokens of one pass over a row */

/* ------------------------------------------------------------------------------------------ AVX2 */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* 16 bf16 (n valid, n < 16; the rest read as 0) without reading past them */
MOED_INLINE __m256i dense_load16_part(const uint16_t *p, int64_t n) {
    uint16_t buf[16] = {0};
    memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* row blocks (T >= 3): one chunk of 16 k (the K tail when TAIL) of R rows */
MOED_INLINE void dense_bstep_avx2(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, int64_t k,
                                 __m256 acc[4][2], __m256 acc2[4], const int R, const int TB, const int tail) {
    const __m256i himask = _mm256_set1_epi32((int)0xFFFF0000u);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const uint16_t *p = w + r * K + k;
        if ((k & 31) == 0)
            _mm_prefetch((const char *)((uintptr_t)p + (uintptr_t)(R * K * 2)), _MM_HINT_T0);
        const __m256i raw = tail ? dense_load16_part(p, K - k) : _mm256_loadu_si256((const __m256i *)p);
        const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(raw, himask));
        if (TB == 1) {
            acc[r][0] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xs + k), acc[r][0]);
            acc2[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + k + 8), acc2[r]);
        } else {
#pragma GCC unroll 4
            for (int t = 0; t < TB; t++) {
                acc[r][t] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xs + t * Kp + k), acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + t * Kp + k + 8), acc[r][t]);
            }
        }
    }
}

/* R rows x TB tokens; w = W + r*K, xs = split x of token t0 (row length Kp), y = y + t0*ldy + r.
 * TB == 1 keeps two accumulators per row (even and odd k) so that the FMA chains are independent. */
MOED_INLINE void dense_blk_avx2(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, float *y,
                                int64_t ldy, const int R, const int TB) {
    __m256 acc[4][2], acc2[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        acc2[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) acc[r][t] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) dense_bstep_avx2(w, xs, K, Kp, k, acc, acc2, R, TB, 0);
    if (k < K) dense_bstep_avx2(w, xs, K, Kp, k, acc, acc2, R, TB, 1);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++)
            y[t * ldy + r] = moed_hsum_avx2(TB == 1 ? _mm256_add_ps(acc[r][0], acc2[r]) : acc[r][t]);
}


/* one chunk of 16 k (the K tail when TAIL) of one row into acc[t][A] (even k) and acc[t][A + 1] (odd) */
MOED_INLINE void dense_step_avx2(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, int64_t k,
                                 __m256 acc[MOED_DENSE_TB][4], const int A, const int TB, const int tail) {
    const __m256i himask = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i raw = tail ? dense_load16_part(w + k, K - k) : _mm256_loadu_si256((const __m256i *)(w + k));
    const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(raw, himask));
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++) {
        acc[t][A] = _mm256_fmadd_ps(e, _mm256_loadu_ps(xs + t * Kp + k), acc[t][A]);
        acc[t][A + 1] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xs + t * Kp + k + 8), acc[t][A + 1]);
    }
}

/* one row w [K], TB tokens of split x (row length Kp) -> y[t * ldy] */
MOED_INLINE void dense_row_avx2(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, float *y,
                                int64_t ldy, const int TB) {
    __m256 acc[MOED_DENSE_TB][4];
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (MOED_DENSE_PF) _mm_prefetch((const char *)(w + k) + MOED_DENSE_PF, _MM_HINT_T0);
        dense_step_avx2(w, xs, K, Kp, k, acc, 0, TB, 0);
        dense_step_avx2(w, xs, K, Kp, k + 16, acc, 2, TB, 0);
    }
    if (k + 16 <= K) {
        dense_step_avx2(w, xs, K, Kp, k, acc, 0, TB, 0);
        k += 16;
    }
    if (k < K) dense_step_avx2(w, xs, K, Kp, k, acc, 2, TB, 1);
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++)
        y[t * ldy] = moed_hsum_avx2(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]),
                                                  _mm256_add_ps(acc[t][2], acc[t][3])));
}

void moed_dense_bf16_avx2(const uint16_t *W, const float *xs, int64_t Kp, int T, int64_t K, int64_t r0,
                          int64_t r1, float *y, int64_t ldy) {
    if (T >= 3) {
        for (int64_t r = r0; r < r1; r += 4) {
            const int full = r + 4 <= r1;
            const uint16_t *w = W + r * K;
            int t = 0;
            for (; t + 2 <= T; t += 2) {
                if (full)
                    dense_blk_avx2(w, xs + t * Kp, K, Kp, y + (int64_t)t * ldy + r, ldy, 4, 2);
                else
                    for (int64_t q = r; q < r1; q++)
                        dense_blk_avx2(W + q * K, xs + t * Kp, K, Kp, y + (int64_t)t * ldy + q, ldy, 1, 2);
            }
            if (t < T) {
                if (full)
                    dense_blk_avx2(w, xs + t * Kp, K, Kp, y + (int64_t)t * ldy + r, ldy, 4, 1);
                else
                    for (int64_t q = r; q < r1; q++)
                        dense_blk_avx2(W + q * K, xs + t * Kp, K, Kp, y + (int64_t)t * ldy + q, ldy, 1, 1);
            }
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        if (T == 1)
            dense_row_avx2(W + r * K, xs, K, Kp, y + r, ldy, 1);
        else
            dense_row_avx2(W + r * K, xs, K, Kp, y + r, ldy, 2);
    }
}

#pragma GCC pop_options

/* --------------------------------------------------------------------------------------- AVX-512 */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

/* row blocks (T >= 3): one chunk of 32 k (m: valid lanes when MASKED) of R rows; xs: split x (row length Kp) */
MOED_INLINE void dense_bstep_avx512(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, int64_t k,
                                   __mmask32 m, __m512 acc[4][4], __m512 acc2[4], const int R, const int TB,
                                   const int MASKED) {
    const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 xe[4], xo[4];
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++) {
        xe[t] = _mm512_loadu_ps(xs + t * Kp + k);
        xo[t] = _mm512_loadu_ps(xs + t * Kp + k + 16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const uint16_t *p = w + r * K + k;
        _mm_prefetch((const char *)((uintptr_t)p + (uintptr_t)(R * K * 2)), _MM_HINT_T0);
        const __m512i raw = MASKED ? _mm512_maskz_loadu_epi16(m, p) : _mm512_loadu_si512((const void *)p);
        const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(raw, himask));
        if (TB == 1) {
            acc[r][0] = _mm512_fmadd_ps(e, xe[0], acc[r][0]);
            acc2[r] = _mm512_fmadd_ps(o, xo[0], acc2[r]);
        } else {
#pragma GCC unroll 4
            for (int t = 0; t < TB; t++) {
                acc[r][t] = _mm512_fmadd_ps(e, xe[t], acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(o, xo[t], acc[r][t]);
            }
        }
    }
}

MOED_INLINE void dense_blk_avx512(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, float *y,
                                  int64_t ldy, const int R, const int TB) {
    __m512 acc[4][4], acc2[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        acc2[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++) acc[r][t] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) dense_bstep_avx512(w, xs, K, Kp, k, 0, acc, acc2, R, TB, 0);
    if (k < K) dense_bstep_avx512(w, xs, K, Kp, k, (__mmask32)((1u << (K - k)) - 1), acc, acc2, R, TB, 1);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < TB; t++)
            y[t * ldy + r] = _mm512_reduce_add_ps(TB == 1 ? _mm512_add_ps(acc[r][0], acc2[r]) : acc[r][t]);
}

#define DENSE_AVX512_TOKENS(R, w, yr)                                                              \
    do {                                                                                           \
        int t = 0;                                                                                 \
        for (; t + 4 <= T; t += 4)                                                                 \
            dense_blk_avx512(w, xs + t * Kp, K, Kp, yr + (int64_t)t * ldy, ldy, R, 4);             \
        switch (T - t) {                                                                           \
        case 1: dense_blk_avx512(w, xs + t * Kp, K, Kp, yr + (int64_t)t * ldy, ldy, R, 1); break;  \
        case 2: dense_blk_avx512(w, xs + t * Kp, K, Kp, yr + (int64_t)t * ldy, ldy, R, 2); break;  \
        case 3: dense_blk_avx512(w, xs + t * Kp, K, Kp, yr + (int64_t)t * ldy, ldy, R, 3); break;  \
        default: break;                                                                            \
        }                                                                                          \
    } while (0)


/* one chunk of 32 k (m: valid lanes when MASKED) of one row into acc[t][A] (even k), acc[t][A + 1] (odd) */
MOED_INLINE void dense_step_avx512(const uint16_t *w, const float *xs, int64_t Kp, int64_t k, __mmask32 m,
                                   __m512 acc[MOED_DENSE_TB][4], const int A, const int TB, const int MASKED) {
    const __m512i himask = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i raw = MASKED ? _mm512_maskz_loadu_epi16(m, w + k) : _mm512_loadu_si512((const void *)(w + k));
    const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(raw, himask));
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++) {
        acc[t][A] = _mm512_fmadd_ps(e, _mm512_loadu_ps(xs + t * Kp + k), acc[t][A]);
        acc[t][A + 1] = _mm512_fmadd_ps(o, _mm512_loadu_ps(xs + t * Kp + k + 16), acc[t][A + 1]);
    }
}

MOED_INLINE void dense_row_avx512(const uint16_t *w, const float *xs, int64_t K, int64_t Kp, float *y,
                                  int64_t ldy, const int TB) {
    __m512 acc[MOED_DENSE_TB][4];
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (MOED_DENSE_PF) {
            _mm_prefetch((const char *)(w + k) + MOED_DENSE_PF, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + k) + MOED_DENSE_PF + 64, _MM_HINT_T0);
        }
        dense_step_avx512(w, xs, Kp, k, 0, acc, 0, TB, 0);
        dense_step_avx512(w, xs, Kp, k + 32, 0, acc, 2, TB, 0);
    }
    if (k + 32 <= K) {
        dense_step_avx512(w, xs, Kp, k, 0, acc, 0, TB, 0);
        k += 32;
    }
    if (k < K) dense_step_avx512(w, xs, Kp, k, (__mmask32)((1u << (K - k)) - 1), acc, 2, TB, 1);
#pragma GCC unroll 4
    for (int t = 0; t < TB; t++)
        y[t * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                                        _mm512_add_ps(acc[t][2], acc[t][3])));
}

void moed_dense_bf16_avx512(const uint16_t *W, const float *xs, int64_t Kp, int T, int64_t K, int64_t r0,
                            int64_t r1, float *y, int64_t ldy) {
    if (T >= 3) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) DENSE_AVX512_TOKENS(4, W + r * K, y + r);
        for (; r < r1; r++) DENSE_AVX512_TOKENS(1, W + r * K, y + r);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        if (T == 1)
            dense_row_avx512(W + r * K, xs, K, Kp, y + r, ldy, 1);
        else
            dense_row_avx512(W + r * K, xs, K, Kp, y + r, ldy, 2);
    }
}

#pragma GCC pop_options

#else /* not x86: the SIMD names run the portable code */

void moed_dense_bf16_avx2(const uint16_t *W, const float *x, int64_t Kp, int T, int64_t K, int64_t r0,
                          int64_t r1, float *y, int64_t ldy) {
    moed_dense_bf16_scalar(W, x, Kp, T, K, r0, r1, y, ldy);
}
void moed_dense_bf16_avx512(const uint16_t *W, const float *x, int64_t Kp, int T, int64_t K, int64_t r0,
                            int64_t r1, float *y, int64_t ldy) {
    moed_dense_bf16_scalar(W, x, Kp, T, K, r0, r1, y, ldy);
}

#endif
