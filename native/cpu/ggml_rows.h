/* Rows of GGUF blocks, multiplied as stored (the "ggml" expert bank and its kernels, ggml_rows.c).
 *
 * A matrix is `rows` rows of K weights, each row the GGUF tensor's blocks for that row, exactly as
 * the file has them (row-major; llama.cpp's block structs, ggml-common.h). The activations are
 * moed's int8 form (moed_cpu.h: per 32 values xs = max|x| / 127, xq = round(x / xs), xsum = xs *
 * sum(xq)), and every type is read as, per 16 weights h, w = scale_h * code + min_h with integer
 * codes, so that
 *
 *     dot(row, x) = sum over halves h of  scale_h * xs * (sum code * xq)  +  min_h * xs * (sum xq)
 *
 * with exact integer inner sums. Per type (code; scale; min), d/dmin/m the block's fp16 fields:
 *   Q8_0   qs (int8); d; 0                      Q4_0  q 0..15; d; -8 d
 *   Q4_1   q 0..15; d; m                        Q5_0  q 0..31; d; -16 d
 *   Q5_1   q 0..31; d; m                        Q2_K  q 0..3; d * sc; -dmin * m (4-bit sc, m per 16)
 *   Q3_K   q - 4 (hmask bit clear) in -4..3; d * (sc - 32) (6-bit sc per 16); 0
 *   Q4_K   q 0..15; d * sc; -dmin * m (6-bit sc, m per 32)   Q5_K  q 0..31; same
 *   Q6_K   q - 32 in -32..31; d * sc (int8 sc per 16); 0
 *   IQ4_NL level[q] (int8); d; 0                IQ4_XS level[q]; d * (ls - 32) (6-bit ls per 32); 0
 *   MXFP4  2 * e2m1(q) (int8); 2^(e - 128); 0
 *   NVFP4  2 * e2m1(q) (int8); ue4m3(d_h) / 2 (an unsigned E4M3 scale per 16, 4 per 64-weight block); 0
 * The torch twin (moed.kernels.ggml_rows_format.rows_product_reference) multiplies the gguf-decoded
 * rows with the same int8 activations, so the two agree to float rounding.
 *
 * Activation span: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K rows are multiplied with activations that share one scale per
 * 256 values (llama.cpp's Q8_K; moed_quantize_act_span with span 256, each 32-group's xs the same):
 * their AVX-512 VNNI kernels then sum a super-block's integer products times its integer scales
 * (vpdpwssd) and multiply by one float per super-block. The other kernels read per-group scales and
 * take either form. A caller quantises each input once with the largest span of the matrices that
 * read it (moed_ggml_act_span). */
#ifndef MOED_GGML_ROWS_H
#define MOED_GGML_ROWS_H

#include <stdint.h>

/* GGML type ids (ggml.h) of the types these kernels read */
enum {
    MOED_GGML_Q4_0 = 2, MOED_GGML_Q4_1 = 3, MOED_GGML_Q5_0 = 6, MOED_GGML_Q5_1 = 7, MOED_GGML_Q8_0 = 8,
    MOED_GGML_Q2_K = 10, MOED_GGML_Q3_K = 11, MOED_GGML_Q4_K = 12, MOED_GGML_Q5_K = 13, MOED_GGML_Q6_K = 14,
    MOED_GGML_IQ4_NL = 20, MOED_GGML_IQ4_XS = 23, MOED_GGML_MXFP4 = 39, MOED_GGML_NVFP4 = 40,
    MOED_GGML_NUM_TYPES = 41
};
/* moed's own block types for FP8 checkpoints' experts (ggml_rows_fp8.c; ids no GGUF file uses) */
enum { MOED_GGML_FP8_B128 = 1001, MOED_GGML_MXFP8 = 1002 };

typedef struct {
    const uint8_t *w;     /* row 0's first block */
    int32_t type;         /* a MOED_GGML_* id */
    int64_t rows, K;      /* K a multiple of the type's block size */
    int64_t row_bytes;    /* bytes of one row (K / block weights * block bytes) */
} moed_ggml_matrix;

/* one MoE layer of a ggml bank (ggml_moe.c) */
typedef struct {
    moed_ggml_matrix gate, up, down;  /* expert 0's matrices; expert e is at + e * rows * row_bytes */
    int64_t E;                        /* experts of the layer */
    int32_t act_kind;                 /* 0 silu(gate) * up; 1 gpt-oss clamped SwiGLU */
    float alpha, limit;
    const float *gate_up_bias;        /* [E][2I] (gate, then up) or NULL */
    const float *down_bias;           /* [E][D] or NULL */
    /* [E] or NULL (1): a factor per expert on each matrix's outputs, before the biases (an NVFP4
     * checkpoint's per-tensor global scale: its blocks stay as stored, the factor multiplies after) */
    const float *gate_scale, *up_scale, *down_scale;
} moed_ggml_layer;

/* ids [N][A]: the layer's expert of each slot (-1: not run here); per_slot [N][A][D] and y [N][D]
 * (weighted sum over the run slots, ascending) optional. 0, -1 bad arguments, -2 no memory. */
int moed_cpu_ggml_moe(void *h, const moed_ggml_layer *L, const float *x, int N, int A, const int32_t *ids,
                      const float *weights, float *per_slot, float *y);

/* y[i][t][r] = row r of matrix i . x[t] for `count` (<= 64) matrices of the same K (types may differ), on
 * the pool; x is quantised to int8 once. 0, -1 bad arguments, -2 no memory (ggml_rows.c). */
int moed_cpu_ggml_rows(void *h, int count, const moed_ggml_matrix *const *m, const float *x, int T, int64_t K,
                       float *const *y);

/* one row dotted with T tokens' int8 activations: y[t * ldy] for t < T */
typedef void (*moed_ggml_dot_fn)(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                                 const float *xsum, int T, float *y, int64_t ldy);

/* one row dotted with T tokens' float activations x [T][K]: y[t * ldy] (moed's FP8 types, whose codes are not
 * integers: they read the float activations, not the int8 ones) */
typedef void (*moed_ggml_fdot_fn)(const uint8_t *row, int64_t K, const float *x, int T, float *y, int64_t ldy);

/* ggml_rows_fp8.c: the FP8 types' (weights, bytes, header bytes) per block (1, or 0 for another type),
 * their float-activation dot (NULL for every other type: those have a moed_ggml_dot), and one row decoded to
 * float32 (1, or 0 for another type) */
int moed_ggml_fp8_block(int type, int *weights, int *bytes, int *head);
moed_ggml_fdot_fn moed_ggml_fdot(int type, int isa);
int moed_ggml_fp8_row_to_f32(int type, const uint8_t *row, int64_t K, float *out);

/* the int8-activation dot of (type, isa), or NULL for a type these kernels do not read (and for the FP8 types,
 * which have a moed_ggml_fdot instead). At MOED_ISA_AVX512VNNI the kernels are the 512-bit ones
 * (ggml_rows_avx512.c) or, where moed_cpu_vector_bits() is 256, the AVX2 ones built with VNNI's 256-bit forms
 * (ggml_rows_avx2vnni.c); the two isa values below name one set whatever the CPU prefers (tests, benchmarks). */
enum { MOED_GGML_ISA_VNNI256 = 4, MOED_GGML_ISA_VNNI512 = 5 };
moed_ggml_dot_fn moed_ggml_dot(int type, int isa);
/* the values per activation scale a type's kernels need (32 or 256; see above) */
int moed_ggml_act_span(int type);
/* weights and bytes per block of a type these kernels read, 0 otherwise */
int moed_ggml_block_weights(int type);
int moed_ggml_block_bytes(int type);

/* NVFP4's scale byte as gguf.quants' NVFP4.ue4m3_to_fp32 reads it: unsigned E4M3 (bit 7 ignored, bias 7,
 * subnormal for exponent 0) times 1/2 (the codes are doubled E2M1 values); the byte 0x7F (NaN) reads as 0,
 * 0xFF as 240 (gguf's test is on the whole byte) */
static inline float moed_ue4m3_half(uint8_t x) {
    const uint32_t v = x & 0x7Fu;
    if (x == 0x7F) return 0.0f;
    if (v < 8) return (float)v * 0.0009765625f;  /* m * 2^-10 */
    union { uint32_t u; float f; } r;
    r.u = (v + (119u << 3)) << 20;  /* (1 + m / 8) * 2^(e - 8) */
    return r.f;
}

#endif
