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
#endif

#endif
