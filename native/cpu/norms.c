/* RMSNorm of a few rows (decode), optionally after the residual add, on the calling thread: the
 * work is a few microseconds, less than waking the pool. moed.layers.norms is the reference:
 *   x_out = x + delta (when delta is given), h = w * (x_out * 1/sqrt(mean(x_out^2) + eps))
 * in float32; w float32 or bf16 bits. Also the SwiGLU and sigmoid gate of dense MLPs at decode. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "moed_cpu.h"

int moed_add_rms_norm(const float *x, const float *delta, const void *w, int w_bf16, int64_t rows, int64_t D,
                      float eps, float *x_out, float *h) {
    if (!x || !w || !h || rows < 1 || D < 1 || (delta && !x_out)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        float *hr = h + r * D;
        const float *src = xr;
        if (delta) {
            float *o = x_out + r * D;
            const float *dr = delta + r * D;
            for (int64_t i = 0; i < D; i++) o[i] = xr[i] + dr[i];
            src = o;
        }
        float part[8] = {0};  /* eight partial sums: the loop vectorises */
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
            for (int l = 0; l < 8; l++) part[l] += src[i + l] * src[i + l];
        float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        for (; i < D; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        if (w_bf16) {
            const uint16_t *wb = (const uint16_t *)w;
            for (int64_t k = 0; k < D; k++) hr[k] = moed_bf16_to_f32(wb[k]) * (src[k] * inv);
        } else {
            const float *wf = (const float *)w;
            for (int64_t k = 0; k < D; k++) hr[k] = wf[k] * (src[k] * inv);
        }
    }
    return 0;
}

/* SwiGLU of a few rows (decode; dense MLPs and shared experts): h = silu(g) * u = g / (1 + e^-g) * u, by the
 * MoE kernels' activation code (activate.c), so both give the same bits for the same inputs. */
int moed_swiglu(const float *g, const float *u, int64_t n, float *h) {
    if (!g || !u || !h || n < 0) return -1;
    moed_activate_row(0, g, u, n, 1.0f, 1.0f, NULL, NULL, 0.0f, 0.0f, h);
    return 0;
}

/* y[r][:] = sigmoid(z[r]) * y[r][:] for rows r (Qwen2-MoE's gate on the shared expert) */
int moed_sigmoid_scale(const float *z, int64_t rows, int64_t D, float *y) {
    if (!z || !y || rows < 0 || D < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float s = 1.0f / (1.0f + expf(-z[r]));
        for (int64_t i = 0; i < D; i++) y[r * D + i] = s * y[r * D + i];
    }
    return 0;
}
