/* Decode attention (attn_decode.c): one new token per row, everything after the q/k/v projections
 * up to the input of o_proj, in one call, over a paged KV pool (cache/kv_cache.py). */
#ifndef MOED_ATTN_DECODE_H
#define MOED_ATTN_DECODE_H

#include <stdint.h>

typedef struct {
    int32_t B, H, Hk, Dh, Dv;      /* rows, query heads, key/value heads (H % Hk == 0), head dims */
    const float *q;                /* [B][H*Dh]  the new token's projections (bias added) */
    const float *k;                /* [B][Hk*Dh] */
    const float *v;                /* [B][Hk*Dv] */
    const float *q_norm, *k_norm;  /* [Dh] per-head RMSNorm weights (Qwen3), or NULL for none */
    float eps;
    int32_t rot_dim;               /* R: the first R dims of each q/k head are rotated (even, <= Dh) */
    int32_t interleaved;           /* 0: pairs (i, R/2 + i); 1: pairs (2i, 2i + 1) */
    const float *cos, *sin;        /* [B][R/2] (the rotary attention factor already applied) */
    void *k_cache, *v_cache;       /* paged pools [num_blocks][block_size][Hk][Dh] / [..][Dv]: float32,
                                    * bfloat16 bits (written round-to-nearest-even) or int8 (q8_0), by kv_type */
    int64_t block_size;            /* tokens per block, a power of two */
    int64_t num_blocks;            /* blocks in each pool */
    int32_t kv_type;               /* MOED_KV_F32, MOED_KV_BF16 or MOED_KV_Q8_0 */
    int32_t max_blocks;            /* entries per row of block_table */
    const int32_t *block_table;    /* [B][max_blocks]: the pool block of tokens [i*bs, (i+1)*bs) of row b */
    const int64_t *start;          /* [B] token index the new token is written at */
    const int64_t *pos;            /* [B] its position: keys j <= pos are visible */
    const int32_t *length;         /* [B] 1, or 0 for a padding row (nothing written, output 0) */
    int64_t num_keys;              /* keys j < num_keys are read (the batch's longest sequence) */
    int64_t window;                /* > 0: only keys j > pos - window are visible */
    float scale;                   /* on the scores */
    const float *sinks;            /* [H] gpt-oss: a per-head logit in the softmax, or NULL */
    float *out;                    /* [B][H*Dv] */
    uint16_t *k_scale, *v_scale;   /* q8_0: fp16 bits [num_blocks][block_size][Hk][Dh/32] / [..][Dv/32], the
                                    * d of each 32 values (value = int8 * d, llama.cpp's Q8_0); else NULL */
    int64_t chunk;                 /* > 0: chunked local attention (Llama-4): only keys j >= pos - pos % chunk */
} moed_attn_decode_args;

enum { MOED_KV_F32 = 0, MOED_KV_BF16 = 1, MOED_KV_Q8_0 = 2 };

/* per ISA (attn_decode_body.h): rows b, key/value head g, with `work` of moed_attn_work_floats */
typedef void (*moed_attn_task_fn)(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work);
void moed_attn_task_scalar(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work);
void moed_attn_task_avx2(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work);
void moed_attn_task_avx512(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work);
int64_t moed_attn_work_floats(const moed_attn_decode_args *a);

#endif
