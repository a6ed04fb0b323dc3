/* FP8 rows in the ggml bank: two moed block types beside the GGUF ones (ggml_rows.h), for checkpoints whose
 * experts are float8_e4m3fn with a scale per block (no GGUF type holds them):
 *   FP8_B128  (MOED_GGML_FP8_B128)  block of 128 weights = float32 scale + 128 e4m3 codes (132 bytes): a
 *             block-scaled FP8 checkpoint's 128 x 128 blocks (DeepSeek-V3 / V3.2, Qwen3-FP8), the block's
 *             scale repeated on each of its rows
 *   MXFP8     (MOED_GGML_MXFP8)     block of 32 weights = E8M0 scale + 32 e4m3 codes (33 bytes): OCP MX
 *             (compressed-tensors mxfp8), scale 2^(e - 127)
 * The codes are not integers, so these types multiply float activations (moed_ggml_fdot, not the int8 ones of
 * the integer-code types): an e4m3 byte s.eeee.mmm becomes the fp16 bits s.0eeee.mmm0000000, the value / 256
 * for normals and subnormals alike (rows_fp8.c), in three integer ops (shift left 7, then move bit 14 to 15 by
 * adding it to itself), and F16C widens 16 at a time; 256 and the block scale are one float per block. A row
 * is decoded once for up to 16 tokens. The torch twin (moed.kernels.ggml_rows_format.rows_product_reference)
 * multiplies the rows decoded by moed.kernels.fp8_block_format with the same float activations. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <string.h>

#include "ggml_rows.h"
#include "moed_cpu.h"

#define MAXT 16 /* tokens per dot call (MAX_TOKENS) */

static inline float rd_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }

/* 2^(e - 127) as float32 (e = 0: 2^-127, a subnormal; 255: NaN, the OCP MX NaN) */
static inline float e8m0(uint8_t e) {
    union { uint32_t u; float f; } r;
    r.u = e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : (uint32_t)e << 23;
    return r.f;
}

static inline float fp8_value(uint8_t b) {
    return moed_f16_to_f32((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))) * 256.0f;
}

int moed_ggml_fp8_block(int type, int *weights, int *bytes, int *head) {
    if (type == MOED_GGML_FP8_B128) { *weights = 128; *bytes = 132; *head = 4; return 1; }
    if (type == MOED_GGML_MXFP8) { *weights = 32; *bytes = 33; *head = 1; return 1; }
    return 0;
}

static inline float block_scale(int type, const uint8_t *b) {
    return type == MOED_GGML_FP8_B128 ? rd_f32(b) : e8m0(b[0]);
}

/* 2^(e - 127) for every E8M0 byte, read by address (the SIMD kernels broadcast it straight from memory) */
static float E8M0[256];
static void init_e8m0(void) {
    for (int e = 0; e < 256; e++) E8M0[e] = e8m0((uint8_t)e);
}

/* the block's scale as an address: the FP8_B128 block's own float, or the MXFP8 byte's table entry */
static inline const float *scale_at(int type, const uint8_t *b) {
    return type == MOED_GGML_FP8_B128 ? (const float *)(const void *)b : &E8M0[b[0]];
}

static inline void fdot_scalar(int type, const uint8_t *row, int64_t K, const float *x, int T, float *y,
                               int64_t ldy) {
    int bw, bb, head;
    moed_ggml_fp8_block(type, &bw, &bb, &head);
    for (int t = 0; t < T; t++) {
        const float *xt = x + (int64_t)t * K;
        float acc = 0.0f;
        for (int64_t b = 0; b < K / bw; b++) {
            const uint8_t *blk = row + b * bb;
            float part = 0.0f;
            for (int l = 0; l < bw; l++) part += fp8_value(blk[head + l]) * xt[b * bw + l];
            acc += block_scale(type, blk) * part;
        }
        y[(int64_t)t * ldy] = acc;
    }
}

static void fdot_fp8_b128_scalar(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy) {
    fdot_scalar(MOED_GGML_FP8_B128, row, K, x, T, y, ldy);
}

static void fdot_mxfp8_scalar(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy) {
    fdot_scalar(MOED_GGML_MXFP8, row, K, x, T, y, ldy);
}

/* one row's weights as float32 (fp8_block_format's decoding); 0 for a type not of this file */
int moed_ggml_fp8_row_to_f32(int type, const uint8_t *row, int64_t K, float *out) {
    int bw, bb, head;
    if (!moed_ggml_fp8_block(type, &bw, &bb, &head)) return 0;
    for (int64_t b = 0; b < K / bw; b++) {
        const uint8_t *blk = row + b * bb;
        const float d = block_scale(type, blk);
        for (int l = 0; l < bw; l++) out[b * bw + l] = fp8_value(blk[head + l]) * d;
    }
    return 1;
}

#if MOED_X86
#include <immintrin.h>

#ifndef FP8_PF
#define FP8_PF 4096 /* software prefetch distance along a thread's stream of rows, bytes */
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
/* 16 codes -> two vectors of 8 floats, each the e4m3 value / 256 (the integer moves once for sixteen) */
static inline __attribute__((always_inline)) void fp8x16_avx2(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    t = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(t));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(t, 1));
}

static inline __attribute__((always_inline)) void fdot_avx2(int type, const uint8_t *row, int64_t K, const float *x,
                                                            int T, float *y, int64_t ldy) {
    int bw, bb, head;
    moed_ggml_fp8_block(type, &bw, &bb, &head);
    __m256 acc[MAXT];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / bw; b++) {
        const uint8_t *blk = row + b * bb;
        const __m256 d = _mm256_broadcast_ss(scale_at(type, blk));
        _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
        if (bw == 128) _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
        for (int g = 0; g < bw; g += 32) {
            const uint8_t *c = blk + head + g;
            __m256 w0, w1, w2, w3;
            fp8x16_avx2(c, &w0, &w1);
            fp8x16_avx2(c + 16, &w2, &w3);
            for (int t = 0; t < T; t++) {
                const float *xt = x + (int64_t)t * K + b * bw + g;
                __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xt));
                p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), p);
                p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xt + 16), p);
                p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xt + 24), p);
                acc[t] = _mm256_fmadd_ps(p, d, acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        y[(int64_t)t * ldy] = _mm_cvtss_f32(v) * 256.0f;  /* the codes were read as value / 256 */
    }
}

#define FDOT_TOKENS(fn, TYPE)                                                                                     \
    for (int t0 = 0; t0 < T; t0 += MAXT) /* MAXT tokens at a time: the accumulators stay in registers */          \
        fn(TYPE, row, K, x + (int64_t)t0 * K, T - t0 < MAXT ? T - t0 : MAXT, y + (int64_t)t0 * ldy, ldy)

/* 32 codes of one group times 32 activations, two chains */
static inline __attribute__((always_inline)) __m256 group32_avx2(const uint8_t *c, const float *x) {
    __m256 w0, w1, w2, w3;
    fp8x16_avx2(c, &w0, &w1);
    fp8x16_avx2(c + 16, &w2, &w3);
    __m256 p0 = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
    __m256 p1 = _mm256_mul_ps(w1, _mm256_loadu_ps(x + 8));
    p0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), p0);
    p1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), p1);
    return _mm256_add_ps(p0, p1);
}

/* one token (decode): named accumulators, several blocks' chains side by side */
static inline __attribute__((always_inline)) float fdot1_avx2(int type, const uint8_t *row, int64_t K,
                                                              const float *x) {
    int bw, bb, head;
    moed_ggml_fp8_block(type, &bw, &bb, &head);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const int64_t blocks = K / bw;
    int64_t b = 0;
    if (bw == 32) {
        for (; b + 4 <= blocks; b += 4) {
            const uint8_t *blk = row + b * 33;
            const float *xb = x + b * 32;
            _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 128, _MM_HINT_T0);
            a0 = _mm256_fmadd_ps(group32_avx2(blk + 1, xb), _mm256_broadcast_ss(scale_at(type, blk)), a0);
            a1 = _mm256_fmadd_ps(group32_avx2(blk + 34, xb + 32), _mm256_broadcast_ss(scale_at(type, blk + 33)), a1);
            a2 = _mm256_fmadd_ps(group32_avx2(blk + 67, xb + 64), _mm256_broadcast_ss(scale_at(type, blk + 66)), a2);
            a3 = _mm256_fmadd_ps(group32_avx2(blk + 100, xb + 96), _mm256_broadcast_ss(scale_at(type, blk + 99)), a3);
        }
    }
    for (; b < blocks; b++) {
        const uint8_t *blk = row + b * bb;
        const float *xb = x + b * bw;
        _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
        if (bw == 128) _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
        __m256 p = group32_avx2(blk + head, xb);
        for (int g = 32; g < bw; g += 32) p = _mm256_add_ps(p, group32_avx2(blk + head + g, xb + g));
        if (b & 1)
            a1 = _mm256_fmadd_ps(p, _mm256_broadcast_ss(scale_at(type, blk)), a1);
        else
            a0 = _mm256_fmadd_ps(p, _mm256_broadcast_ss(scale_at(type, blk)), a0);
    }
    const __m256 acc = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v) * 256.0f;  /* the codes were read as value / 256 */
}

static void fdot_fp8_b128_avx2(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy) {
    if (T == 1) { y[0] = fdot1_avx2(MOED_GGML_FP8_B128, row, K, x); return; }
    FDOT_TOKENS(fdot_avx2, MOED_GGML_FP8_B128);
}

static void fdot_mxfp8_avx2(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy) {
    if (T == 1) { y[0] = fdot1_avx2(MOED_GGML_MXFP8, row, K, x); return; }
    FDOT_TOKENS(fdot_avx2, MOED_GGML_MXFP8);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
/* 16 codes -> 16 floats, each the e4m3 value / 256 (256-bit integer ops: they may use a third port) */
static inline __attribute__((always_inline)) __m512 fp8x16_avx512(const uint8_t *p) {
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000))));
}

static inline __attribute__((always_inline)) void fdot_avx512(int type, const uint8_t *row, int64_t K,
                                                              const float *x, int T, float *y, int64_t ldy) {
    int bw, bb, head;
    moed_ggml_fp8_block(type, &bw, &bb, &head);
    __m512 acc[MAXT];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / bw; b++) {
        const uint8_t *blk = row + b * bb;
        const __m512 d = _mm512_set1_ps(*scale_at(type, blk));  /* a broadcast load */
        _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
        if (bw == 128) _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
        if (bw == 128) {
            const __m512 w0 = fp8x16_avx512(blk + head), w1 = fp8x16_avx512(blk + head + 16);
            const __m512 w2 = fp8x16_avx512(blk + head + 32), w3 = fp8x16_avx512(blk + head + 48);
            const __m512 w4 = fp8x16_avx512(blk + head + 64), w5 = fp8x16_avx512(blk + head + 80);
            const __m512 w6 = fp8x16_avx512(blk + head + 96), w7 = fp8x16_avx512(blk + head + 112);
            for (int t = 0; t < T; t++) {
                const float *xt = x + (int64_t)t * K + b * 128;
                __m512 p0 = _mm512_mul_ps(w0, _mm512_loadu_ps(xt)), p1 = _mm512_mul_ps(w1, _mm512_loadu_ps(xt + 16));
                p0 = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xt + 32), p0);
                p1 = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xt + 48), p1);
                p0 = _mm512_fmadd_ps(w4, _mm512_loadu_ps(xt + 64), p0);
                p1 = _mm512_fmadd_ps(w5, _mm512_loadu_ps(xt + 80), p1);
                p0 = _mm512_fmadd_ps(w6, _mm512_loadu_ps(xt + 96), p0);
                p1 = _mm512_fmadd_ps(w7, _mm512_loadu_ps(xt + 112), p1);
                acc[t] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), d, acc[t]);
            }
        } else {
            const __m512 w0 = fp8x16_avx512(blk + head), w1 = fp8x16_avx512(blk + head + 16);
            for (int t = 0; t < T; t++) {
                const float *xt = x + (int64_t)t * K + b * 32;
                const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xt)));
                acc[t] = _mm512_fmadd_ps(p, d, acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) y[(int64_t)t * ldy] = _mm512_reduce_add_ps(acc[t]) * 256.0f;  /* codes: value / 256 */
}

/* one token (decode): the accumulators are named registers, four blocks' chains side by side */
static inline __attribute__((always_inline)) float fdot1_avx512(int type, const uint8_t *row, int64_t K,
                                                                const float *x) {
    int bw, bb, head;
    moed_ggml_fp8_block(type, &bw, &bb, &head);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    const int64_t blocks = K / bw;
    int64_t b = 0;
    if (bw == 32) {
        for (; b + 4 <= blocks; b += 4) {
            const uint8_t *blk = row + b * bb;
            const float *xb = x + b * 32;
            _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 128, _MM_HINT_T0);
            __m512 p0 = _mm512_mul_ps(fp8x16_avx512(blk + 1), _mm512_loadu_ps(xb));
            __m512 p1 = _mm512_mul_ps(fp8x16_avx512(blk + 34), _mm512_loadu_ps(xb + 32));
            __m512 p2 = _mm512_mul_ps(fp8x16_avx512(blk + 67), _mm512_loadu_ps(xb + 64));
            __m512 p3 = _mm512_mul_ps(fp8x16_avx512(blk + 100), _mm512_loadu_ps(xb + 96));
            p0 = _mm512_fmadd_ps(fp8x16_avx512(blk + 17), _mm512_loadu_ps(xb + 16), p0);
            p1 = _mm512_fmadd_ps(fp8x16_avx512(blk + 50), _mm512_loadu_ps(xb + 48), p1);
            p2 = _mm512_fmadd_ps(fp8x16_avx512(blk + 83), _mm512_loadu_ps(xb + 80), p2);
            p3 = _mm512_fmadd_ps(fp8x16_avx512(blk + 116), _mm512_loadu_ps(xb + 112), p3);
            a0 = _mm512_fmadd_ps(p0, _mm512_set1_ps(*scale_at(type, blk)), a0);
            a1 = _mm512_fmadd_ps(p1, _mm512_set1_ps(*scale_at(type, blk + 33)), a1);
            a2 = _mm512_fmadd_ps(p2, _mm512_set1_ps(*scale_at(type, blk + 66)), a2);
            a3 = _mm512_fmadd_ps(p3, _mm512_set1_ps(*scale_at(type, blk + 99)), a3);
        }
    }
    if (bw == 128) {
        for (; b + 2 <= blocks; b += 2) {  /* two blocks' chains side by side */
            const uint8_t *blk = row + b * 132 + 4, *blk2 = blk + 132;
            const float *xb = x + b * 128, *xb2 = xb + 128;
            _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + FP8_PF + 192, _MM_HINT_T0);
            __m512 p0 = _mm512_mul_ps(fp8x16_avx512(blk), _mm512_loadu_ps(xb));
            __m512 p1 = _mm512_mul_ps(fp8x16_avx512(blk + 16), _mm512_loadu_ps(xb + 16));
            __m512 q0 = _mm512_mul_ps(fp8x16_avx512(blk2), _mm512_loadu_ps(xb2));
            __m512 q1 = _mm512_mul_ps(fp8x16_avx512(blk2 + 16), _mm512_loadu_ps(xb2 + 16));
            for (int g = 32; g < 128; g += 32) {
                p0 = _mm512_fmadd_ps(fp8x16_avx512(blk + g), _mm512_loadu_ps(xb + g), p0);
                p1 = _mm512_fmadd_ps(fp8x16_avx512(blk + g + 16), _mm512_loadu_ps(xb + g + 16), p1);
                q0 = _mm512_fmadd_ps(fp8x16_avx512(blk2 + g), _mm512_loadu_ps(xb2 + g), q0);
                q1 = _mm512_fmadd_ps(fp8x16_avx512(blk2 + g + 16), _mm512_loadu_ps(xb2 + g + 16), q1);
            }
            a0 = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), _mm512_set1_ps(*scale_at(type, blk - 4)), a0);
            a1 = _mm512_fmadd_ps(_mm512_add_ps(q0, q1), _mm512_set1_ps(*scale_at(type, blk2 - 4)), a1);
        }
    }
    for (; b < blocks; b++) {
        const uint8_t *blk = row + b * bb;
        const float *xb = x + b * bw;
        _mm_prefetch((const char *)blk + FP8_PF, _MM_HINT_T0);
        if (bw == 128) _mm_prefetch((const char *)blk + FP8_PF + 64, _MM_HINT_T0);
        __m512 p0 = _mm512_mul_ps(fp8x16_avx512(blk + head), _mm512_loadu_ps(xb));
        __m512 p1 = _mm512_mul_ps(fp8x16_avx512(blk + head + 16), _mm512_loadu_ps(xb + 16));
        for (int g = 32; g < bw; g += 32) {
            p0 = _mm512_fmadd_ps(fp8x16_avx512(blk + head + g), _mm512_loadu_ps(xb + g), p0);
            p1 = _mm512_fmadd_ps(fp8x16_avx512(blk + head + g + 16), _mm512_loadu_ps(xb + g + 16), p1);
        }
        a0 = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), _mm512_set1_ps(*scale_at(type, blk)), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) * 256.0f;
}

static void fdot_fp8_b128_avx512(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy) {
    if (T == 1) { y[0] = fdot1_avx512(MOED_GGML_FP8_B128, row, K, x); return; }
    FDOT_TOKENS(fdot_avx512, MOED_GGML_FP8_B128);
}

static void fdot_mxfp8_avx512(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy) {
    if (T == 1) { y[0] = fdot1_avx512(MOED_GGML_MXFP8, row, K, x); return; }
    FDOT_TOKENS(fdot_avx512, MOED_GGML_MXFP8);
}
#pragma GCC pop_options
#endif

/* the float-activation dot of an FP8 row type for an ISA (AVX-512 from MOED_ISA_AVX512: no VNNI needed), NULL
 * for every other type */
moed_ggml_fdot_fn moed_ggml_fdot(int type, int isa) {
    if (type != MOED_GGML_FP8_B128 && type != MOED_GGML_MXFP8) return NULL;
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_e8m0);
    const int b128 = type == MOED_GGML_FP8_B128;
#if MOED_X86
    if (isa >= MOED_ISA_AVX512) return b128 ? fdot_fp8_b128_avx512 : fdot_mxfp8_avx512;
    if (isa >= MOED_ISA_AVX2) return b128 ? fdot_fp8_b128_avx2 : fdot_mxfp8_avx2;
#else
    (void)isa;
#endif
    return b128 ? fdot_fp8_b128_scalar : fdot_mxfp8_scalar;
}

/* one row, one ISA, for the tests: y[t] = row . x[t] (float activations x [T][K]) */
int moed_ggml_fdot_one(int type, int isa, const uint8_t *row, int64_t K, const float *x, int T, float *y) {
    moed_ggml_fdot_fn f = moed_ggml_fdot(type, isa);
    int bw, bb, head;
    if (!f || !row || !x || !y || T < 1 || !moed_ggml_fp8_block(type, &bw, &bb, &head) || K < bw || K % bw) return -1;
    f(row, K, x, T, y, 1);
    return 0;
}
