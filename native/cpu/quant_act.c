/* int8 activations for the quantised strips, and exact fp16 decoding (see moed_cpu.h). */
#include <math.h>
#include <string.h>

#include "moed_cpu.h"

void moed_quantize_act_span(const float *x, int T, int64_t K, int span, int8_t *xq, float *xs, float *xsum) {
    const int64_t groups = K / MOED_GROUP;
    const int per = span / MOED_GROUP;  /* groups sharing one scale */
    for (int t = 0; t < T; t++) {
        for (int64_t g0 = 0; g0 < groups; g0 += per) {
            const float *v = x + (int64_t)t * K + g0 * MOED_GROUP;
            float amax = 0.0f;
            for (int i = 0; i < span; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float scale = amax / 127.0f;
            for (int64_t g = g0; g < g0 + per; g++) {
                const float *u = x + (int64_t)t * K + g * MOED_GROUP;
                int8_t *q = xq + (int64_t)t * K + g * MOED_GROUP;
                int isum = 0;
                if (scale > 0.0f) {
                    for (int i = 0; i < MOED_GROUP; i++) {
                        /* the division, not a reciprocal multiply: the torch twin does the same */
                        /* round half to even: |u / scale| <= 127, so adding and taking off 1.5 * 2^23
                         * leaves the nearest integer (default FP mode), as nearbyintf would, without a
                         * libm call per element (the loop vectorises) */
                        float r = (u[i] / scale + 12582912.0f) - 12582912.0f;
                        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                        q[i] = (int8_t)r;
                        isum += q[i];
                    }
                } else {
                    memset(q, 0, MOED_GROUP);
                }
                /* the sum of the *quantised* values (llama.cpp's Q8_1 does the same): int4's min term
                 * then sees the same rounded activations as its scale term, and their errors cancel */
                xs[(int64_t)t * groups + g] = scale;
                xsum[(int64_t)t * groups + g] = scale * (float)isum;
            }
        }
    }
}

void moed_quantize_act(const float *x, int T, int64_t K, int8_t *xq, float *xs, float *xsum) {
    moed_quantize_act_span(x, T, K, MOED_GROUP, xq, xs, xsum);
}

float moed_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);  /* subnormal (or zero): exact */
        return sign ? -f : f;
    }
    if (exp == 31)
        v.u = sign | 0x7F800000u | (man << 13);
    else
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    return v.f;
}
