/* GGUF block rows x int8 activations (see ggml_rows.h): the scalar kernels of every type, the
 * dispatch table, and the entry point over the pool. The SIMD kernels are in ggml_rows_avx2.c. */
#include <string.h>

#include "ggml_rows.h"
#include "moed_api.h"
#include "moed_cpu.h"
#include "moed_pool.h"

static const int8_t iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t e2m1_doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline float f16(const uint8_t *p) { return moed_f16_to_f32(rd16(p)); }

/* ggml_e8m0_to_fp32_half: 2^(e - 128), exact (e = 0, 1 subnormal) */
static inline float e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return v.f;
}

/* Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 scale bytes */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

int moed_ggml_block_weights(int type) {
    switch (type) {
    case MOED_GGML_Q4_0: case MOED_GGML_Q4_1: case MOED_GGML_Q5_0: case MOED_GGML_Q5_1: case MOED_GGML_Q8_0:
    case MOED_GGML_IQ4_NL: case MOED_GGML_MXFP4:
        return 32;
    case MOED_GGML_Q2_K: case MOED_GGML_Q3_K: case MOED_GGML_Q4_K: case MOED_GGML_Q5_K: case MOED_GGML_Q6_K:
    case MOED_GGML_IQ4_XS:
        return 256;
    case MOED_GGML_NVFP4:
        return 64;
    case MOED_GGML_FP8_B128:
        return 128;
    case MOED_GGML_MXFP8:
        return 32;
    default:
        return 0;
    }
}

int moed_ggml_act_span(int type) {
    return type == MOED_GGML_Q2_K || type == MOED_GGML_Q3_K || type == MOED_GGML_Q4_K || type == MOED_GGML_Q5_K
        || type == MOED_GGML_Q6_K ? 256 : 32;
}

int moed_ggml_block_bytes(int type) {
    switch (type) {
    case MOED_GGML_Q4_0: return 18;
    case MOED_GGML_Q4_1: return 20;
    case MOED_GGML_Q5_0: return 22;
    case MOED_GGML_Q5_1: return 24;
    case MOED_GGML_Q8_0: return 34;
    case MOED_GGML_IQ4_NL: return 18;
    case MOED_GGML_MXFP4: return 17;
    case MOED_GGML_NVFP4: return 36;
    case MOED_GGML_Q2_K: return 84;
    case MOED_GGML_Q3_K: return 110;
    case MOED_GGML_Q4_K: return 144;
    case MOED_GGML_Q5_K: return 176;
    case MOED_GGML_Q6_K: return 210;
    case MOED_GGML_IQ4_XS: return 136;
    case MOED_GGML_FP8_B128: return 132;
    case MOED_GGML_MXFP8: return 33;
    default: return 0;
    }
}

/* 32 weights (group g of block b) as integer codes with a scale and a min per 16 (ggml_rows.h) */
static void decode_group(int type, const uint8_t *b, int g, int8_t c[32], float sc[2], float mn[2]) {
    mn[0] = mn[1] = 0.0f;
    switch (type) {
    case MOED_GGML_Q8_0:
        memcpy(c, b + 2, 32);
        sc[0] = sc[1] = f16(b);
        return;
    case MOED_GGML_Q4_0: case MOED_GGML_Q4_1: case MOED_GGML_IQ4_NL: {
        const uint8_t *qs = b + (type == MOED_GGML_Q4_1 ? 4 : 2);
        float d = f16(b);
        for (int i = 0; i < 16; i++) {
            int lo = qs[i] & 0xF, hi = qs[i] >> 4;
            c[i] = (int8_t)(type == MOED_GGML_IQ4_NL ? iq4_levels[lo] : lo);
            c[i + 16] = (int8_t)(type == MOED_GGML_IQ4_NL ? iq4_levels[hi] : hi);
        }
        sc[0] = sc[1] = d;
        if (type == MOED_GGML_Q4_0) mn[0] = mn[1] = -8.0f * d;
        if (type == MOED_GGML_Q4_1) mn[0] = mn[1] = f16(b + 2);
        return;
    }
    case MOED_GGML_Q5_0: case MOED_GGML_Q5_1: {
        int off = type == MOED_GGML_Q5_1 ? 2 : 0;
        uint32_t qh = rd32(b + 2 + off);
        const uint8_t *qs = b + 6 + off;
        float d = f16(b);
        for (int i = 0; i < 16; i++) {
            c[i] = (int8_t)((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
            c[i + 16] = (int8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
        sc[0] = sc[1] = d;
        mn[0] = mn[1] = type == MOED_GGML_Q5_0 ? -16.0f * d : f16(b + 2);
        return;
    }
    case MOED_GGML_MXFP4: {
        float d = e8m0_half(b[0]);
        for (int i = 0; i < 16; i++) {
            c[i] = e2m1_doubled[b[1 + i] & 0xF];
            c[i + 16] = e2m1_doubled[b[1 + i] >> 4];
        }
        sc[0] = sc[1] = d;
        return;
    }
    case MOED_GGML_NVFP4: {  /* scales d[4], then 8 bytes per 16 weights: low nibbles 0-7, high 8-15 */
        for (int h = 0; h < 2; h++) {
            const int sub = 2 * g + h;
            const uint8_t *qs = b + 4 + 8 * sub;
            for (int i = 0; i < 8; i++) {
                c[16 * h + i] = e2m1_doubled[qs[i] & 0xF];
                c[16 * h + 8 + i] = e2m1_doubled[qs[i] >> 4];
            }
            sc[h] = moed_ue4m3_half(b[sub]);
        }
        return;
    }
    case MOED_GGML_Q4_K: case MOED_GGML_Q5_K: {
        const int k5 = type == MOED_GGML_Q5_K;
        const uint8_t *qs = b + (k5 ? 48 : 16) + 32 * (g / 2), *qh = b + 16;
        int s, m;
        k_scale_min(b + 4, g, &s, &m);
        for (int l = 0; l < 32; l++) {
            int q = g & 1 ? qs[l] >> 4 : qs[l] & 0xF;
            if (k5) q |= ((qh[l] >> g) & 1) << 4;
            c[l] = (int8_t)q;
        }
        sc[0] = sc[1] = f16(b) * (float)s;
        mn[0] = mn[1] = -(f16(b + 2) * (float)m);
        return;
    }
    case MOED_GGML_Q6_K: {
        const int h = g / 4, j0 = (g % 4) * 32;  /* 128-weight half, first weight of the group in it */
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = f16(b + 208);
        for (int l = 0; l < 32; l++) {
            int j = j0 + l;
            int lo = j < 64 ? ql[j % 64] & 0xF : ql[j % 64] >> 4;
            int hi = (qh[j % 32] >> (2 * (j / 32))) & 3;
            c[l] = (int8_t)((lo | (hi << 4)) - 32);
        }
        sc[0] = d * (float)scales[2 * g];
        sc[1] = d * (float)scales[2 * g + 1];
        return;
    }
    case MOED_GGML_Q2_K: {
        const int n = g / 4, j = g % 4;  /* 128-weight half, 2-bit shift */
        const uint8_t *qs = b + 16 + 32 * n;
        float d = f16(b + 80), dmin = f16(b + 82);
        for (int l = 0; l < 32; l++) c[l] = (int8_t)((qs[l] >> (2 * j)) & 3);
        for (int h = 0; h < 2; h++) {
            uint8_t s = b[2 * g + h];
            sc[h] = d * (float)(s & 0xF);
            mn[h] = -(dmin * (float)(s >> 4));
        }
        return;
    }
    case MOED_GGML_Q3_K: {
        const int n = g / 4, j = g % 4;
        const uint8_t *hm = b, *qs = b + 32 + 32 * n, *p = b + 96;
        float d = f16(b + 108);
        for (int l = 0; l < 32; l++) {
            int q = (qs[l] >> (2 * j)) & 3;
            c[l] = (int8_t)(q - (((hm[l] >> (4 * n + j)) & 1) ? 0 : 4));
        }
        for (int h = 0; h < 2; h++) {
            int k = 2 * g + h;  /* 16-weight group 0..15 */
            int lo = (p[k % 8] >> (4 * (k / 8))) & 0xF, hi = (p[8 + k % 4] >> (2 * (k / 4))) & 3;
            sc[h] = d * (float)((lo | (hi << 4)) - 32);
        }
        return;
    }
    case MOED_GGML_IQ4_XS: {
        uint16_t sh = rd16(b + 2);
        int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4);
        const uint8_t *qs = b + 8 + 16 * g;
        for (int i = 0; i < 16; i++) {
            c[i] = iq4_levels[qs[i] & 0xF];
            c[i + 16] = iq4_levels[qs[i] >> 4];
        }
        sc[0] = sc[1] = f16(b) * (float)(ls - 32);
        return;
    }
    default:
        memset(c, 0, 32);
        sc[0] = sc[1] = 0.0f;
        return;
    }
}

/* one scalar dot function per type: the generic loop, the type a compile-time constant */
static inline void dot_generic(int type, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                               const float *xsum, int T, float *y, int64_t ldy) {
    (void)xsum;
    const int bw = moed_ggml_block_weights(type), bb = moed_ggml_block_bytes(type), gpb = bw / 32;
    const int64_t groups = K / 32;
    for (int t = 0; t < T; t++) {
        const int8_t *q = xq + (int64_t)t * K;
        const float *s = xs + (int64_t)t * groups;
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            int8_t c[32];
            float sc[2], mn[2];
            decode_group(type, row + (g / gpb) * bb, (int)(g % gpb), c, sc, mn);
            const int8_t *v = q + g * 32;
            int32_t d0 = 0, d1 = 0, s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) {
                d0 += (int32_t)c[l] * v[l];
                d1 += (int32_t)c[l + 16] * v[l + 16];
                s0 += v[l];
                s1 += v[l + 16];
            }
            acc += s[g] * (sc[0] * (float)d0 + sc[1] * (float)d1 + mn[0] * (float)s0 + mn[1] * (float)s1);
        }
        y[(int64_t)t * ldy] = acc;
    }
}

#define SCALAR_DOT(name, TYPE)                                                                        \
    static void name(const uint8_t *row, int64_t K, const int8_t *xq, const float *xs, const float *xsum, \
                     int T, float *y, int64_t ldy) {                                                  \
        dot_generic(TYPE, row, K, xq, xs, xsum, T, y, ldy);                                           \
    }
SCALAR_DOT(dot_q4_0, MOED_GGML_Q4_0)
SCALAR_DOT(dot_q4_1, MOED_GGML_Q4_1)
SCALAR_DOT(dot_q5_0, MOED_GGML_Q5_0)
SCALAR_DOT(dot_q5_1, MOED_GGML_Q5_1)
SCALAR_DOT(dot_q8_0, MOED_GGML_Q8_0)
SCALAR_DOT(dot_q2_k, MOED_GGML_Q2_K)
SCALAR_DOT(dot_q3_k, MOED_GGML_Q3_K)
SCALAR_DOT(dot_q4_k, MOED_GGML_Q4_K)
SCALAR_DOT(dot_q5_k, MOED_GGML_Q5_K)
SCALAR_DOT(dot_q6_k, MOED_GGML_Q6_K)
SCALAR_DOT(dot_iq4_nl, MOED_GGML_IQ4_NL)
SCALAR_DOT(dot_iq4_xs, MOED_GGML_IQ4_XS)
SCALAR_DOT(dot_mxfp4, MOED_GGML_MXFP4)
SCALAR_DOT(dot_nvfp4, MOED_GGML_NVFP4)

moed_ggml_dot_fn moed_ggml_dot_avx2(int type);  /* ggml_rows_avx2.c: NULL where it has none */

moed_ggml_dot_fn moed_ggml_dot_avx512vnni(int type);  /* ggml_rows_avx512.c: NULL where it has none */

moed_ggml_dot_fn moed_ggml_dot_avx2vnni(int type);  /* ggml_rows_avx2vnni.c: the AVX2 kernels with 256-bit VNNI */

/* the types whose 512-bit kernel stays ahead where 512-bit instructions are split in two (Zen 4, one thread,
 * rows in L2: Q6_K 25.3 vs 22.1 GB/s, NVFP4 14.0 vs 11.3; every other type 1.0-1.4x faster in 256 bits) */
static int wide_anyway(int type) { return type == MOED_GGML_Q6_K || type == MOED_GGML_NVFP4; }

moed_ggml_dot_fn moed_ggml_dot(int type, int isa) {
    if (isa == MOED_GGML_ISA_VNNI256
        || (isa == MOED_ISA_AVX512VNNI && moed_cpu_vector_bits() == 256 && !wide_anyway(type))) {
        moed_ggml_dot_fn fast = moed_ggml_dot_avx2vnni(type);
        if (fast) return fast;
    }
    if (isa == MOED_ISA_AVX512VNNI || isa == MOED_GGML_ISA_VNNI512) {
        moed_ggml_dot_fn fast = moed_ggml_dot_avx512vnni(type);
        if (fast) return fast;
    }
    if (isa >= MOED_ISA_AVX2) {
        moed_ggml_dot_fn fast = moed_ggml_dot_avx2(type);
        if (fast) return fast;
    }
    switch (type) {
    case MOED_GGML_Q4_0: return dot_q4_0;
    case MOED_GGML_Q4_1: return dot_q4_1;
    case MOED_GGML_Q5_0: return dot_q5_0;
    case MOED_GGML_Q5_1: return dot_q5_1;
    case MOED_GGML_Q8_0: return dot_q8_0;
    case MOED_GGML_Q2_K: return dot_q2_k;
    case MOED_GGML_Q3_K: return dot_q3_k;
    case MOED_GGML_Q4_K: return dot_q4_k;
    case MOED_GGML_Q5_K: return dot_q5_k;
    case MOED_GGML_Q6_K: return dot_q6_k;
    case MOED_GGML_IQ4_NL: return dot_iq4_nl;
    case MOED_GGML_IQ4_XS: return dot_iq4_xs;
    case MOED_GGML_MXFP4: return dot_mxfp4;
    case MOED_GGML_NVFP4: return dot_nvfp4;
    default: return NULL;
    }
}

/* ------------------------------------------------------------------------------ entry points */

static int check_matrix(const moed_ggml_matrix *m, int64_t K) {
    int bw = moed_ggml_block_weights(m->type);
    if (!bw || !m->w || m->rows < 1 || m->K != K || K % bw) return 0;
    return m->row_bytes == K / bw * moed_ggml_block_bytes(m->type);
}

typedef struct {
    const moed_ggml_matrix *const *m;
    moed_ggml_dot_fn const *dot;
    moed_ggml_fdot_fn const *fdot;  /* the FP8 types' (float activations x), else NULL */
    const float *x;
    int count;
    int64_t chunk;          /* rows per task */
    const int64_t *first;   /* first task of each matrix (count + 1 entries) */
    const int8_t *xq;
    const float *xs, *xsum;
    int T;
    float *const *y;        /* [T][rows] per matrix */
} rows_job;

static void rows_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const rows_job *j = (const rows_job *)ctx;
    int i = 0;
    while (task >= j->first[i + 1]) i++;
    const moed_ggml_matrix *m = j->m[i];
    int64_t r0 = (task - j->first[i]) * j->chunk, r1 = r0 + j->chunk < m->rows ? r0 + j->chunk : m->rows;
    if (j->fdot[i])
        for (int64_t r = r0; r < r1; r++) j->fdot[i](m->w + r * m->row_bytes, m->K, j->x, j->T, j->y[i] + r, m->rows);
    else
        for (int64_t r = r0; r < r1; r++)
            j->dot[i](m->w + r * m->row_bytes, m->K, j->xq, j->xs, j->xsum, j->T, j->y[i] + r, m->rows);
}

/* y[i][t][r] = row r of matrix i . x[t], for `count` matrices of the same K (gate and up of one
 * expert, say), all on the pool; x is quantised to int8 once. 0, -1 bad arguments, -2 no memory. */
int moed_cpu_ggml_rows(void *h, int count, const moed_ggml_matrix *const *m, const float *x, int T, int64_t K,
                       float *const *y) {
    if (!h || count < 1 || count > 64 || T < 1 || K < 32 || K % 32 || !x) return -1;
    moed_ggml_dot_fn dot[64];
    moed_ggml_fdot_fn fdot[64];
    int64_t first[65];
    /* one contiguous stretch of rows per thread and matrix: the hardware prefetcher streams it (tasks
     * of a few rows each measured ~2.5x slower from memory: every stretch restarts the stream) */
    moed_pool *pool = (moed_pool *)h;
    int64_t most = 0;
    for (int i = 0; i < count; i++) most = m[i] && m[i]->rows > most ? m[i]->rows : most;
    int64_t chunk = (most + moed_pool_threads(pool) - 1) / moed_pool_threads(pool);
    chunk = chunk < 4 ? 4 : chunk;
    first[0] = 0;
    for (int i = 0; i < count; i++) {
        if (!check_matrix(m[i], K) || !y[i]) return -1;
        dot[i] = moed_ggml_dot(m[i]->type, moed_cpu_isa());
        fdot[i] = moed_ggml_fdot(m[i]->type, moed_cpu_isa());
        if (!dot[i] && !fdot[i]) return -1;
        first[i + 1] = first[i] + (m[i]->rows + chunk - 1) / chunk;
    }
    int span = 32;
    for (int i = 0; i < count; i++) span = moed_ggml_act_span(m[i]->type) > span ? moed_ggml_act_span(m[i]->type) : span;
    size_t groups = (size_t)T * (size_t)(K / 32);
    char *scratch = (char *)moed_pool_scratch(pool, (size_t)T * (size_t)K + 2 * groups * sizeof(float) + 128);
    if (!scratch) return -2;
    /* xq first and 64-byte aligned: the 512-bit activation loads stay within one cache line */
    int8_t *xq = (int8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xs = (float *)(xq + (size_t)T * (size_t)K), *xsum = xs + groups;
    moed_quantize_act_span(x, T, K, span, xq, xs, xsum);
    rows_job j = {m, dot, fdot, x, count, chunk, first, xq, xs, xsum, T, y};
    moed_pool_run(pool, rows_task, &j, first[count]);
    return 0;
}

/* one row, one ISA, for the tests: y[t] = row . x[t] with x already int8 (xq [T][K], xs, xsum [T][K/32]) */
int moed_ggml_dot_one(int type, int isa, const uint8_t *row, int64_t K, const int8_t *xq, const float *xs,
                      const float *xsum, int T, float *y) {
    int bw = moed_ggml_block_weights(type);
    const int vnni = moed_cpu_detected_isa() >= MOED_ISA_AVX512VNNI;
    if (!bw || K % bw || T < 1 || isa < 0 || (isa > moed_cpu_detected_isa() && !(vnni && isa <= MOED_GGML_ISA_VNNI512)))
        return -1;
    moed_ggml_dot_fn f = moed_ggml_dot(type, isa);
    if (!f) return -1;
    f(row, K, xq, xs, xsum, T, y, 1);
    return 0;
}

/* ------------------------------------------------------------------------------ rows -> bf16 */

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((v.u >> 16) | ((v.u & 0xFFFF) ? 0x40 : 0));
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* ggml_rows_avx2.c: one row of some types decoded, as bf16 (f32 = 0) or float32 (f32 = 1); 0 where it has no decoder */
int moed_ggml_row_decode_avx2(int type, const uint8_t *row, int64_t K, void *o, int f32);

typedef struct {
    const moed_ggml_matrix *m;
    void *out;
    int f32;  /* 1: float32 out, 0: bf16 */
    int64_t chunk;
} decode_job;

static void decode_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const decode_job *j = (const decode_job *)ctx;
    const moed_ggml_matrix *m = j->m;
    const int bw = moed_ggml_block_weights(m->type), bb = moed_ggml_block_bytes(m->type), gpb = bw / 32;
    int64_t r0 = task * j->chunk, r1 = r0 + j->chunk < m->rows ? r0 + j->chunk : m->rows;
    const int simd = moed_cpu_isa() >= MOED_ISA_AVX2;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = m->w + r * m->row_bytes;
        uint16_t *o = j->f32 ? NULL : (uint16_t *)j->out + r * m->K;
        float *of = j->f32 ? (float *)j->out + r * m->K : NULL;
        if (simd && moed_ggml_row_decode_avx2(m->type, row, m->K, j->f32 ? (void *)of : (void *)o, j->f32)) continue;
        if (m->type == MOED_GGML_FP8_B128 || m->type == MOED_GGML_MXFP8) {  /* float values, not integer codes */
            float f[256];
            for (int64_t k0 = 0; k0 < m->K; k0 += 256) {
                const int64_t n = m->K - k0 < 256 ? m->K - k0 : 256;
                moed_ggml_fp8_row_to_f32(m->type, row + k0 / bw * bb, n, j->f32 ? of + k0 : f);
                if (!j->f32)
                    for (int64_t l = 0; l < n; l++) o[k0 + l] = to_bf16(f[l]);
            }
            continue;
        }
        for (int64_t g = 0; g < m->K / 32; g++) {
            int8_t c[32];
            float sc[2], mn[2];
            decode_group(m->type, row + (g / gpb) * bb, (int)(g % gpb), c, sc, mn);
            for (int l = 0; l < 32; l++) {
                /* the torch decoders' order: scale x code (exact for every type but a rounding in Q6_K / IQ4_XS / Q3_K),
                 * then + min where the type has one (one rounding); a zero min is not added (-0.0 stays) */
                const float v = mn[l >> 4] != 0.0f ? sc[l >> 4] * (float)c[l] + mn[l >> 4] : sc[l >> 4] * (float)c[l];
                if (j->f32)
                    of[g * 32 + l] = v;
                else
                    o[g * 32 + l] = to_bf16(v);
            }
        }
    }
}

static int decode_matrix(void *h, const moed_ggml_matrix *m, void *out, int f32) {
    if (!h || !m || !out || !check_matrix(m, m->K) || m->K % 32) return -1;
    moed_pool *pool = (moed_pool *)h;
    int64_t chunk = (m->rows + 4 * moed_pool_threads(pool) - 1) / (4 * moed_pool_threads(pool));
    decode_job j = {m, out, f32, chunk < 1 ? 1 : chunk};
    moed_pool_run(pool, decode_task, &j, (m->rows + j.chunk - 1) / j.chunk);
    return 0;
}

/* one matrix of GGUF block rows decoded to bf16 [rows][K] (the weights as gguf.quants decodes them,
 * each rounded to bf16 once), on the pool: the prefill GEMMs multiply these where the CPU has bf16 GEMMs */
int moed_cpu_ggml_to_bf16(void *h, const moed_ggml_matrix *m, uint16_t *out) { return decode_matrix(h, m, out, 0); }

/* the same values as float32 [rows][K], bit for bit the torch decoders' (kernels/gguf_quants.py): the prefill
 * GEMMs of CPUs without bf16 GEMMs (AVX2-only) multiply these */
int moed_cpu_ggml_to_f32(void *h, const moed_ggml_matrix *m, float *out) { return decode_matrix(h, m, out, 1); }
