/* The experts' activation over a row (moed_activate_row, moed_cpu.h): h = act(g * sg + bg, u * su + bu).
 *
 * The scalar code is moed_activate per value (libm's expf / tanhf: ~5 ns a value). A decode step runs
 * it on every run expert's intermediate row (8 experts x 768 values for Qwen3-30B-A3B: ~30 us a layer
 * on one thread, as long as reading a 4-bit expert), so AVX2 takes eight values at a time with a
 * polynomial exp (Cephes' expf: range reduction by ln 2 in two parts, a degree-5 polynomial, the
 * exponent added in integers; within 2 ulp of expf over the clamped range). tanh for GeGLU is
 * 1 - 2 / (exp(2z) + 1). The scalar moed_activate is the reference twin (tests/kernels/test_activate.py).
 */
#include "moed_cpu.h"

int moed_cpu_isa(void);

static void row_scalar(int kind, const float *g, const float *u, int64_t n, float sg, float su, const float *bg,
                       const float *bu, float alpha, float limit, float *h) {
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i] * sg, ui = u[i] * su;
        if (bg) gi += bg[i];
        if (bu) ui += bu[i];
        h[i] = moed_activate(kind, gi, ui, alpha, limit);
    }
}

#if MOED_X86
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* e^x, x clamped to [-87.3, 88] (2^n stays a normal float, the product finite) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654475f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* g / (1 + e^(-a g)) */
static inline __m256 gate_sigmoid(__m256 g, __m256 a) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), g))));
}

static inline __m256 act8(int kind, __m256 g, __m256 u, float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (kind == 0) return _mm256_mul_ps(gate_sigmoid(g, one), u);
    if (kind == 3) return _mm256_mul_ps(_mm256_max_ps(g, _mm256_setzero_ps()), u);
    if (kind == 4) {
        /* 0.5 g (1 + tanh(z)) u = g u / (1 + e^(-2z)), z = 0.7978845608 (g + 0.044715 g^3): no cancellation
         * where tanh(z) is near -1 */
        const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                       _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
        return _mm256_div_ps(_mm256_mul_ps(g, u), _mm256_add_ps(one, exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), z))));
    }
    const __m256 lim = _mm256_set1_ps(limit);
    g = _mm256_min_ps(g, lim);
    u = _mm256_max_ps(_mm256_min_ps(u, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
    if (kind == 2) return _mm256_mul_ps(gate_sigmoid(g, one), u);
    return _mm256_mul_ps(_mm256_add_ps(u, one), gate_sigmoid(g, _mm256_set1_ps(alpha)));
}

static void row_avx2(int kind, const float *g, const float *u, int64_t n, float sg, float su, const float *bg,
                     const float *bu, float alpha, float limit, float *h) {
    const __m256 vsg = _mm256_set1_ps(sg), vsu = _mm256_set1_ps(su);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), vsg), ui = _mm256_mul_ps(_mm256_loadu_ps(u + i), vsu);
        if (bg) gi = _mm256_add_ps(gi, _mm256_loadu_ps(bg + i));
        if (bu) ui = _mm256_add_ps(ui, _mm256_loadu_ps(bu + i));
        _mm256_storeu_ps(h + i, act8(kind, gi, ui, alpha, limit));
    }
    row_scalar(kind, g + i, u + i, n - i, sg, su, bg ? bg + i : NULL, bu ? bu + i : NULL, alpha, limit, h + i);
}

#pragma GCC pop_options
#endif

void moed_activate_row_isa(int isa, int kind, const float *g, const float *u, int64_t n, float sg, float su,
                           const float *bg, const float *bu, float alpha, float limit, float *h) {
#if MOED_X86
    if (isa >= MOED_ISA_AVX2) {
        row_avx2(kind, g, u, n, sg, su, bg, bu, alpha, limit, h);
        return;
    }
#endif
    (void)isa;
    row_scalar(kind, g, u, n, sg, su, bg, bu, alpha, limit, h);
}

void moed_activate_row(int kind, const float *g, const float *u, int64_t n, float sg, float su, const float *bg,
                       const float *bu, float alpha, float limit, float *h) {
    moed_activate_row_isa(moed_cpu_isa(), kind, g, u, n, sg, su, bg, bu, alpha, limit, h);
}
