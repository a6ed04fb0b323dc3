/* Decode attention over the persistent pool: tasks (row, key/value head), one per ISA variant of
 * the same source (attn_decode_body.h with 4, 8 or 16 floats per vector). The contract is
 * moed.layers.attention's torch path for one new token per row (tests/kernels/test_attn_decode.py
 * compares them): per-head RMSNorm of q and k, rotary on the first R dims, the new k (rotated)
 * and v stored at the row's cache index, softmax(scale q.k) over keys j < num_keys with j <= pos
 * (and j > pos - window), an optional sink logit per head, the weighted sum of the values. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <string.h>

#include "attn_decode.h"
#include "moed_cpu.h"
#include "moed_pool.h"

#define ATTN_KEY_TILE 16 /* value rows widened together, then summed for every head of the group */

int64_t moed_attn_work_floats(const moed_attn_decode_args *a) {
    const int64_t G = a->H / a->Hk;
    return G * a->Dh + 2 * (int64_t)a->Dh + G * a->Dv + ATTN_KEY_TILE * (int64_t)a->Dv +
           G * (a->num_keys > 0 ? a->num_keys : 1) + 16;
}

/* one bf16 value as a float (bf16 is float32's high half) */
static inline __attribute__((always_inline)) float attn_h2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* one float16 as a float: normal numbers inline, the rest (zero, subnormal, inf, NaN) through the exact one */
static inline __attribute__((always_inline)) float attn_f16(uint16_t h) {
    const uint32_t e = h & 0x7c00u;
    if (e == 0 || e == 0x7c00u) return moed_f16_to_f32(h);
    const uint32_t u = ((uint32_t)(h & 0x8000u) << 16) | (((uint32_t)(h & 0x7fffu) << 13) + 0x38000000u);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#define ATTN_MAX_ROW 4096 /* head dims up to this (a key row is widened into a buffer of this many floats) */

/* float32 -> float16 bits, round to nearest even, subnormals and overflow as IEEE (torch's .half()) */
static uint16_t attn_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: infinity */
    if (ax < 0x38800000u) { /* below 2^-14: a float16 subnormal (or zero), in units of 2^-24 */
        float a;
        memcpy(&a, &ax, sizeof a);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f)); /* 2^24; ties to even */
    }
    const uint32_t mant = ax + 0xfffu + ((ax >> 13) & 1u); /* round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | ((mant - 0x38000000u) >> 13));
}

/* Store n (a multiple of 32) float32 values as q8_0 at element `at` (scales at `at / 32`): llama.cpp's
 * quantize_row_q8_0_ref, as cache/q8_0.py. */
static inline __attribute__((always_inline)) void attn_store_q8(int8_t *pool, uint16_t *scales, int64_t at,
                                                                const float *x, int n) {
    for (int b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) pool[at + 32 * b + i] = (int8_t)roundf(xb[i] * id);
        scales[at / 32 + b] = attn_f2h(d);
    }
}

/* Store n float32 values at element `at` of a pool (bf16: round to nearest even, as torch converts). */
static inline __attribute__((always_inline)) void attn_store_row(void *pool, int bf16, int64_t at, const float *x,
                                                                 int n) {
    if (!bf16) {
        memcpy((float *)pool + at, x, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)pool + at;
    for (int d = 0; d < n; d++) {
        uint32_t u;
        memcpy(&u, &x[d], sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u) dst[d] = (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
        else dst[d] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

#define VW 4
#define ATTN_HSUM(s) (((s)[0] + (s)[2]) + ((s)[1] + (s)[3]))
#define ATTN_VEC attn_vec_scalar
#define ATTN_LOAD attn_load_scalar
#define ATTN_LOADH attn_loadh_scalar
#define ATTN_HVEC attn_hvec_scalar
#define ATTN_UVEC attn_uvec_scalar
#define ATTN_QVEC attn_qvec_scalar
#define ATTN_LOADQ attn_loadq_scalar
#define ATTN_IVEC attn_ivec_scalar
#define ATTN_VMAX attn_vmax_scalar
#define ATTN_LOAD1 attn_load1_scalar
#define ATTN_EXPV attn_expv_scalar
#define ATTN_WIDEN attn_widen_scalar
#define ATTN_PREP attn_prep_scalar
#define ATTN_TASK moed_attn_task_scalar
#include "attn_decode_body.h"

#if MOED_X86
#include "moed_simd.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define VW 8
#define ATTN_HSUM(s) moed_hsum_avx2((__m256)(s))
#define ATTN_VEC attn_vec_avx2
#define ATTN_LOAD attn_load_avx2
#define ATTN_LOADH attn_loadh_avx2
#define ATTN_HVEC attn_hvec_avx2
#define ATTN_UVEC attn_uvec_avx2
#define ATTN_QVEC attn_qvec_avx2
#define ATTN_LOADQ attn_loadq_avx2
#define ATTN_IVEC attn_ivec_avx2
#define ATTN_VMAX attn_vmax_avx2
#define ATTN_LOAD1 attn_load1_avx2
#define ATTN_EXPV attn_expv_avx2
#define ATTN_WIDEN attn_widen_avx2
#define ATTN_LOADQ_ISA(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define ATTN_PREP attn_prep_avx2
#define ATTN_TASK moed_attn_task_avx2
#include "attn_decode_body.h"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
#define VW 16
#define ATTN_HSUM(s) _mm512_reduce_add_ps((__m512)(s))
#define ATTN_VEC attn_vec_avx512
#define ATTN_LOAD attn_load_avx512
#define ATTN_LOADH attn_loadh_avx512
#define ATTN_HVEC attn_hvec_avx512
#define ATTN_UVEC attn_uvec_avx512
#define ATTN_QVEC attn_qvec_avx512
#define ATTN_LOADQ attn_loadq_avx512
#define ATTN_IVEC attn_ivec_avx512
#define ATTN_VMAX attn_vmax_avx512
#define ATTN_LOAD1 attn_load1_avx512
#define ATTN_EXPV attn_expv_avx512
#define ATTN_WIDEN attn_widen_avx512
#define ATTN_LOADQ_ISA(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define ATTN_PREP attn_prep_avx512
#define ATTN_TASK moed_attn_task_avx512
#include "attn_decode_body.h"
#pragma GCC pop_options
#else
void moed_attn_task_avx2(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work) {
    moed_attn_task_scalar(a, b, g, work);
}
void moed_attn_task_avx512(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work) {
    moed_attn_task_scalar(a, b, g, work);
}
#endif

int moed_cpu_isa(void);
static const moed_attn_task_fn attn_table[MOED_NUM_ISAS] = {moed_attn_task_scalar, moed_attn_task_avx2,
                                                             moed_attn_task_avx512, moed_attn_task_avx512};

typedef struct {
    const moed_attn_decode_args *a;
    moed_attn_task_fn fn;
    float *work;
    int64_t per_thread;
} attn_job;

static void attn_task(void *ctx, int64_t task, int thread) {
    attn_job *j = (attn_job *)ctx;
    j->fn(j->a, task / j->a->Hk, task % j->a->Hk, j->work + (int64_t)thread * j->per_thread);
}

int moed_cpu_attn_decode(void *h, const moed_attn_decode_args *a) {
    if (!h || !a || a->B < 1 || a->H < 1 || a->Hk < 1 || a->H % a->Hk || a->Dh < 1 || a->Dv < 1 ||
        a->rot_dim < 0 || a->rot_dim > a->Dh || a->rot_dim % 2 || a->block_size < 1 ||
        (a->block_size & (a->block_size - 1)) || a->num_blocks < 1 || a->max_blocks < 1 || a->num_keys < 0 ||
        a->num_keys > (int64_t)a->max_blocks * a->block_size || !a->q || !a->k || !a->v || !a->k_cache ||
        !a->v_cache || !a->out || !a->block_table || !a->start || !a->pos || !a->length ||
        (a->rot_dim && (!a->cos || !a->sin)) || a->kv_type < MOED_KV_F32 || a->kv_type > MOED_KV_Q8_0 ||
        a->Dh > ATTN_MAX_ROW || a->Dv > ATTN_MAX_ROW ||
        (a->kv_type == MOED_KV_Q8_0 && (!a->k_scale || !a->v_scale || a->Dh % 32 || a->Dv % 32)))
        return -1;
    for (int b = 0; b < a->B; b++) {
        if (!a->length[b]) continue;
        const int64_t st = a->start[b], p = a->pos[b];
        if (st < 0 || st >= (int64_t)a->max_blocks * a->block_size) return -1;
        /* every block the row writes or reads must be a block of the pool */
        const int64_t last_read = p < a->num_keys ? p : a->num_keys - 1;
        const int64_t last = st > last_read ? st : last_read;
        for (int64_t i = 0; i <= last / a->block_size; i++) {
            const int32_t blk = a->block_table[b * (int64_t)a->max_blocks + i];
            if (blk < 0 || blk >= a->num_blocks) return -1;
        }
    }
    moed_pool *p = (moed_pool *)h;
    attn_job j;
    j.a = a;
    j.fn = attn_table[moed_cpu_isa()];
    j.per_thread = (moed_attn_work_floats(a) + 15) / 16 * 16;
    j.work = (float *)moed_pool_scratch(p, sizeof(float) * (size_t)(j.per_thread * moed_pool_threads(p)));
    if (!j.work) return -2;
    moed_pool_run(p, attn_task, &j, (int64_t)a->B * a->Hk);
    return 0;
}
