/* Small SIMD helpers shared by the kernel files (x86 with GCC/Clang only; each is compiled for
 * its own target, so it inlines into any function whose target includes that one). */
#ifndef MOED_SIMD_H
#define MOED_SIMD_H

#include "moed_cpu.h"

#if MOED_X86
#include <immintrin.h>

/* the sum of the 8 lanes */
static inline __attribute__((always_inline, target("avx2"))) float moed_hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The prefetch of the AVX2 one-token quad sweeps (int4, mxfp4) at block b of quad q, rq the quad's
 * first row: when the window is whole rows the group is one contiguous stretch consumed at 128
 * bytes per block step, prefetched lin bytes ahead of it; otherwise the next quad's rows. */
static inline __attribute__((always_inline, target("avx2"))) void
moed_quad_sweep_prefetch(const uint8_t *rq, int64_t N2, int64_t b, int q, int whole, int64_t lin) {
    if (lin && whole) {
        _mm_prefetch((const char *)(rq + 128 * b + lin), _MM_HINT_T0);
        _mm_prefetch((const char *)(rq + 128 * b + lin + 64), _MM_HINT_T0);
    } else if (q < 7 && (b & 1) == 0) {
        for (int k = 4; k < 8; k++) _mm_prefetch((const char *)(rq + k * N2 + 32 * b), _MM_HINT_T0);
    }
}

/* 64 bytes of each of the rows r, r + ld, r + 2 ld, r + 3 ld (only the bytes set in bm unless
 * full) interleaved so that every 32-bit lane holds the 4 rows' bytes of one byte-column: the
 * 4-row quads of the int8 strips. The unpacks work inside 128-bit lanes: lane l of Q[q] holds
 * byte-columns 16l + 4q .. 16l + 4q + 3. */
static inline __attribute__((always_inline, target("avx512f,avx512bw"))) void
moed_quad_bytes512(const uint8_t *r, int64_t ld, int full, __mmask64 bm, __m512i Q[4]) {
    __m512i r0, r1, r2, r3;
    if (full) {
        r0 = _mm512_loadu_si512((const void *)r);
        r1 = _mm512_loadu_si512((const void *)(r + ld));
        r2 = _mm512_loadu_si512((const void *)(r + 2 * ld));
        r3 = _mm512_loadu_si512((const void *)(r + 3 * ld));
    } else {
        r0 = _mm512_maskz_loadu_epi8(bm, r);
        r1 = _mm512_maskz_loadu_epi8(bm, r + ld);
        r2 = _mm512_maskz_loadu_epi8(bm, r + 2 * ld);
        r3 = _mm512_maskz_loadu_epi8(bm, r + 3 * ld);
    }
    const __m512i A = _mm512_unpacklo_epi8(r0, r1), B = _mm512_unpackhi_epi8(r0, r1);
    const __m512i C = _mm512_unpacklo_epi8(r2, r3), D = _mm512_unpackhi_epi8(r2, r3);
    Q[0] = _mm512_unpacklo_epi16(A, C);
    Q[1] = _mm512_unpackhi_epi16(A, C);
    Q[2] = _mm512_unpacklo_epi16(B, D);
    Q[3] = _mm512_unpackhi_epi16(B, D);
}
#endif

#endif
