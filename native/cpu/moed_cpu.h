/* moed's native CPU kernels: shared types and the strip-kernel contract.
 *
 * Everything here is plain C11 + pthreads, built by `pip install` (setup.py) with the system
 * compiler and loaded with ctypes by moed/kernels/native_cpu.py. SIMD code is compiled per
 * function with GCC/Clang target pragmas (no -march flag), and chosen at run time from what the
 * CPU reports: MOED_ISA_AVX512VNNI (AVX-512 + VNNI: the int8 strips use vpdpbusd; every other
 * kernel is the AVX-512 one), MOED_ISA_AVX512 (F+BW+VL+DQ), MOED_ISA_AVX2 (AVX2+FMA+F16C),
 * MOED_ISA_SCALAR.
 *
 * Matrix layout (the host expert bank, moed.kernels.*_format): a matrix w[K][N] is k-major
 * ("x @ w"), groups of 32 along K:
 *   fp32  : w  float   [K][N]
 *   bf16  : w  uint16  [K][N]          (bf16 bits)
 *   int4  : w  uint8   [K][N/2]        byte [k][j]: low nibble = column j, high nibble = column j + N/2
 *           s  uint16  [K/32][N]       scale, bf16 bits;  m uint16 [K/32][N] min, bf16 bits
 *           w[k][n] = q * scale + min
 *   q8    : w  int8    [K][N]          s uint16 [K/32][N] d, fp16 bits;  w = qs * d
 *   mxfp4 : w  uint8   [K][N/2]        E2M1 codes, nibbles packed as int4
 *           s  uint8   [K/32][N]       e8m0: w = e2m1(code) * 2^(e - 127)
 *
 * A strip kernel computes, for every token t < a->T and c < j1 - j0,
 *   lo[t*ld + c] = sum_k x[t][k] * w[k][j0 + c]
 *   hi[t*ld + c] = sum_k x[t][k] * w[k][N/2 + j0 + c]
 * (0 <= j0 < j1 <= N/2). Columns j and N/2 + j come together because the int4/mxfp4 byte j holds
 * both, and because gate_up [D][2I] has the gate of column j at j and its up at I + j.
 *
 * fp32 and bf16 strips use the float activations x. int4, q8 and mxfp4 strips use the int8
 * activations: per token and per group g of 32 along K,
 *   xs[g] = max|x[g*32 .. g*32+31]| / 127,  xq[k] = round_half_even(x[k] / xs[g])  (0 when xs is 0)
 *   xsum[g] = xs[g] * (sum of xq over the group)   (the quantised values' sum, as llama.cpp's Q8_1:
 *             int4's min term then carries the same rounding as its scale term)
 * and compute, per column n (the formulas the torch twins in moed.kernels.native_cpu_reference use)
 *   int4 : sum_g  scale[g][n] * xs[g] * (sum_k xq[k] q[k][n])  +  min[g][n] * xsum[g]
 *   q8   : sum_g  d[g][n]     * xs[g] * (sum_k xq[k] qs[k][n])
 *   mxfp4: sum_g  2^(e[g][n]-128) * xs[g] * (sum_k xq[k] v2[code[k][n]])   v2 = 2 * e2m1 value, an integer
 * The inner sums over one group are exact integers; only the float sums over groups round.
 */
#ifndef MOED_CPU_H
#define MOED_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define MOED_GROUP 32

enum { MOED_ISA_SCALAR = 0, MOED_ISA_AVX2 = 1, MOED_ISA_AVX512 = 2, MOED_ISA_AVX512VNNI = 3, MOED_NUM_ISAS = 4 };
enum { MOED_FP32 = 0, MOED_BF16 = 1, MOED_INT4 = 2, MOED_Q8 = 3, MOED_MXFP4 = 4, MOED_NUM_DTYPES = 5 };
/* row-major matrices only (moed_cpu_rows_many / _rows_to_bf16): block-scaled FP8 linears (rows_fp8.c) */
enum { MOED_ROWS_FP8 = 16, MOED_FP8_BLOCK = 128 };
/* a decode-chain linear kept as GGUF block rows (decode_chain.c: moed_cpu_ggml_rows, ggml_rows.h) */
enum { MOED_ROWS_GGML = 17 };

typedef struct {
    const void *w;   /* main array of this one matrix (already offset to the expert) */
    const void *s;   /* scales (int4 scale, q8 d, mxfp4 e8m0), NULL for fp32/bf16 */
    const void *m;   /* int4 min, else NULL */
    int64_t K, N;    /* logical shape; K % 32 == 0 for the grouped dtypes, N even */
} moed_matrix;

typedef struct {
    int T;                /* tokens (rows of x) */
    int64_t K;            /* row length of x / xq; groups per row = K / 32 */
    const float *x;       /* [T][K] float activations (always set) */
    const int8_t *xq;     /* [T][K] int8 activations (set when K % 32 == 0) */
    const float *xs;      /* [T][K/32] */
    const float *xsum;    /* [T][K/32] */
} moed_act;

typedef void (*moed_strip_fn)(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1,
                              float *lo, float *hi, int64_t ld);

/* dense row-major weights (attention, lm_head, router): y[t*ldy + r] = sum_k x[t][k] * W[r*K + k]
 * for rows r in [r0, r1); W is bf16 bits [rows][K]; any K. xs is x prepared by moed_dense_prepare
 * for the same ISA, rows of Kp = moed_dense_row_length(isa, K) floats. */
typedef void (*moed_dense_fn)(const uint16_t *W, const float *xs, int64_t Kp, int T, int64_t K, int64_t r0,
                              int64_t r1, float *y, int64_t ldy);
int64_t moed_dense_row_length(int isa, int64_t K);
void moed_dense_prepare(int isa, const float *x, int T, int64_t K, float *xs);

/* One function per (dtype, isa); the scalar ones are the portable path and always exist. A
 * file compiled without SIMD support (non-x86) defines the avx2/avx512 names as NULL-returning
 * through moed_strip_table(). */
void moed_strip_fp32_scalar(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_fp32_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_fp32_avx512(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_bf16_scalar(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_bf16_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_bf16_avx512(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_int4_scalar(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_int4_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_int4_avx512(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_int4_avx512vnni(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_q8_scalar(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_q8_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_q8_avx512(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_q8_avx512vnni(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_mxfp4_scalar(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_mxfp4_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_mxfp4_avx512(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_strip_mxfp4_avx512vnni(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, float *, int64_t);
void moed_dense_bf16_scalar(const uint16_t *, const float *, int64_t, int, int64_t, int64_t, int64_t, float *, int64_t);
void moed_dense_bf16_avx2(const uint16_t *, const float *, int64_t, int, int64_t, int64_t, int64_t, float *, int64_t);
void moed_dense_bf16_avx512(const uint16_t *, const float *, int64_t, int, int64_t, int64_t, int64_t, float *, int64_t);

/* int8 activations of T rows (see above); K % 32 == 0 */
void moed_quantize_act(const float *x, int T, int64_t K, int8_t *xq, float *xs, float *xsum);
/* the same with one scale per `span` values (32 or 256, K % span == 0), written to each of its 32-groups'
 * xs: llama.cpp's Q8_K form for the K-quant kernels, which multiply a super-block's integer sums by its
 * integer scales before one float multiply (ggml_rows.h) */
void moed_quantize_act_span(const float *x, int T, int64_t K, int span, int8_t *xq, float *xs, float *xsum);
/* the same by the code of one ISA (AVX2 and up: eight values at a time; the same bytes as the scalar code) */
void moed_quantize_act_span_isa(int isa, const float *x, int T, int64_t K, int span, int8_t *xq, float *xs,
                                float *xsum);

/* the expert activation of gate g and up u: 0 silu(g) * u; 1 gpt-oss's clamped SwiGLU */
/* kind 0: SwiGLU; 1: gpt-oss's (gate <= limit, |up| <= limit, sigmoid(alpha g) gate, up + 1); 2: DeepSeek-V4's
 * (SwiGLU on gate <= limit and |up| <= limit); 3: relu2 (Nemotron-H: max(gate, 0) * up, gate = up); 4: Gemma-4's
 * GeGLU (gelu with the tanh approximation) */
static inline float moed_activate(int kind, float g, float u, float alpha, float limit) {
    if (kind == 0) return g / (1.0f + expf(-g)) * u;
    if (kind == 3) return (g > 0.0f ? g : 0.0f) * u; /* relu2: gate and up hold the same matrix */
    if (kind == 4) return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * u; /* GeGLU */
    g = g < limit ? g : limit;
    u = u < limit ? u : limit;
    u = u > -limit ? u : -limit;
    if (kind == 2) return g / (1.0f + expf(-g)) * u;
    return (u + 1.0f) * (g / (1.0f + expf(-g * alpha)));
}

/* h[i] = moed_activate(kind, g[i] * sg + bg[i], u[i] * su + bu[i]) for i < n (bg, bu may be NULL): activate.c,
 * eight values at a time at AVX2 and up (a polynomial exp, within a few ulp of the scalar code) */
void moed_activate_row(int kind, const float *g, const float *u, int64_t n, float sg, float su, const float *bg,
                       const float *bu, float alpha, float limit, float *h);
void moed_activate_row_isa(int isa, int kind, const float *g, const float *u, int64_t n, float sg, float su,
                           const float *bg, const float *bu, float alpha, float limit, float *h);

static inline float moed_bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}
float moed_f16_to_f32(uint16_t h); /* exact, subnormals included (in quant_act.c) */

/* SIMD availability on this build: x86-64 with GCC/Clang target pragmas */
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MOED_X86 1
#else
#define MOED_X86 0
#endif

#endif
