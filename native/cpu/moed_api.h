/* The library's entry points (the functions Python calls through ctypes, in the .c files here) and the
 * expert bank they read, declared once so that C callers (decode_chain.c) use the same ones.
 * Every entry point returns 0, -1 for bad arguments, -2 when out of memory. */
#ifndef MOED_API_H
#define MOED_API_H

#include <stdint.h>

#include "attn_decode.h"
#include "moed_cpu.h"

/* A bank of experts in one dtype, addressed by flat id (moed.kernels.native_cpu._Bank mirrors it). */
typedef struct {
    int32_t dtype;
    int32_t act_kind;            /* 0 silu(gate) * up; 1 gpt-oss clamped SwiGLU */
    float alpha, limit;
    int64_t D, I;                /* hidden, intermediate */
    int64_t num_slots;
    const void *gu_w, *gu_s, *gu_m;  /* whole-bank arrays of gate_up [S][D][2I] */
    const void *dn_w, *dn_s, *dn_m;  /* and of down [S][I][D] */
    int64_t gu_w_stride, gu_s_stride, dn_w_stride, dn_s_stride;  /* bytes per expert */
    const float *gu_bias;        /* [S][2I] or NULL */
    const float *dn_bias;        /* [S][D] or NULL */
} moed_bank;

int moed_cpu_isa(void);
int moed_cpu_detected_isa(void);  /* what the CPU supports; moed_cpu_isa() may be set lower */
/* 256 where 512-bit instructions run as two 256-bit halves (AMD Zen 4), else 512; MOED_VECTOR_BITS=256|512
 * overrides it. The GGUF block kernels at AVX-512 VNNI take their 256-bit forms where it is 256. */
int moed_cpu_vector_bits(void);
int moed_cpu_moe(void *h, const moed_bank *b, const float *x, int N, int A, const int32_t *flat_ids,
                 const float *weights, float *per_slot, float *y);
int moed_cpu_dense_bf16_many(void *h, int count, const uint16_t *const *W, const int64_t *N, int64_t K,
                             const float *x, int T, float *const *y);
int moed_cpu_rows_many(void *h, int dtype, int count, const moed_matrix *const *w, const float *x, int T,
                       float *const *y);
int moed_add_rms_norm(const float *x, const float *delta, const void *w, int w_bf16, int64_t rows, int64_t D,
                      float eps, float *x_out, float *h);
int moed_cpu_route(void *h, const float *x, int64_t N, int64_t D, const float *W, const float *bias, int64_t E,
                   int kind, int top_k, int renormalise, int64_t *ids, float *weights);
int moed_swiglu(const float *g, const float *u, int64_t n, float *h);
int moed_sigmoid_scale(const float *z, int64_t rows, int64_t D, float *y);
int moed_route_select(float *logits, int64_t N, int64_t E, int kind, int top_k, int renormalise, int64_t *ids,
                      float *weights);
int moed_cpu_attn_decode(void *h, const moed_attn_decode_args *a);
/* one read of `bytes` at buf on the pool (read_bw.c): the read bandwidth `moed bench kernels` compares with;
 * returns the sum (mod 2^64) of the little-endian 8-byte words of buf's whole words, plus its last bytes */
uint64_t moed_cpu_read_pass(void *h, const void *buf, int64_t bytes);

#endif
