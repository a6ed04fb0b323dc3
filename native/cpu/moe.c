/* The entry points Python calls (ctypes, moed/kernels/native_cpu.py): ISA dispatch, one strip for
 * the tests, the dense bf16 GEMV and the whole routed-expert part of one MoE layer, each spread
 * over the persistent pool.
 *
 * One MoE call, for N tokens x A slots whose experts are in the bank:
 *   phase 1  tasks (expert e, columns [j0, j1) of I): gate and up of e's tokens for those columns
 *            (one strip: byte/column j holds the gate at j and the up at I + j), bias, activation
 *            -> h_e [T_e][I]
 *   between  the caller quantises every h_e to int8 (quantised banks)
 *   phase 2  tasks (expert e, columns [j0, j1) of D/2): h_e @ down_e -> out_e [T_e][D] (+ bias),
 *            scattered to the slots of e
 *   merge    y[t] = sum over a ascending of weight[t][a] * out[t][a] (the executor contract)
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "moed_api.h"
#include "moed_cpu.h"
#include "moed_pool.h"

/* ------------------------------------------------------------------------------ ISA dispatch */
static int detected_isa = -1;
static int chosen_isa = -1;

static int detect_isa(void) {
#if MOED_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return __builtin_cpu_supports("avx512vnni") ? MOED_ISA_AVX512VNNI : MOED_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return MOED_ISA_AVX2;
#endif
    return MOED_ISA_SCALAR;
}

int moed_cpu_detected_isa(void) {
    if (detected_isa < 0) detected_isa = detect_isa();
    return detected_isa;
}

static int vector_bits = 0;

/* AMD's family 0x19 (Zen 3, Zen 4) executes a 512-bit instruction as two 256-bit halves: the same work in
 * 256-bit instructions runs as fast with fewer cross-lane steps (measured on Zen 4: the GGUF kernels'
 * 256-bit VNNI forms 1.05-1.35x the 512-bit ones per thread). Intel's AVX-512 cores and Zen 5 have full-width units. */
static int detect_vector_bits(void) {
    const char *env = getenv("MOED_VECTOR_BITS");
    if (env && (!strcmp(env, "256") || !strcmp(env, "512"))) return atoi(env);
#if MOED_X86
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u /* AuthenticAMD */
        && __get_cpuid(1, &a, &b, &c, &d)) {
        const unsigned family = ((a >> 8) & 0xF) + ((a >> 8 & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
        if (family == 0x19) return 256;
    }
#endif
    return 512;
}

int moed_cpu_vector_bits(void) {
    if (!vector_bits) vector_bits = detect_vector_bits();
    return vector_bits;
}

/* the ISA in use: at most what the CPU has (tests force the lower ones); returns the one in effect */
int moed_cpu_set_isa(int isa) {
    int best = moed_cpu_detected_isa();
    chosen_isa = isa < 0 || isa > best ? best : isa;
    return chosen_isa;
}

int moed_cpu_isa(void) { return chosen_isa < 0 ? moed_cpu_set_isa(-1) : chosen_isa; }

/* [dtype][isa]: VNNI only changes the int8 strips (fp32 and bf16 use the AVX-512 ones) */
static const moed_strip_fn strip_table[MOED_NUM_DTYPES][MOED_NUM_ISAS] = {
    {moed_strip_fp32_scalar, moed_strip_fp32_avx2, moed_strip_fp32_avx512, moed_strip_fp32_avx512},
    {moed_strip_bf16_scalar, moed_strip_bf16_avx2, moed_strip_bf16_avx512, moed_strip_bf16_avx512},
    {moed_strip_int4_scalar, moed_strip_int4_avx2, moed_strip_int4_avx512, moed_strip_int4_avx512vnni},
    {moed_strip_q8_scalar, moed_strip_q8_avx2, moed_strip_q8_avx512, moed_strip_q8_avx512vnni},
    {moed_strip_mxfp4_scalar, moed_strip_mxfp4_avx2, moed_strip_mxfp4_avx512, moed_strip_mxfp4_avx512vnni},
};
static const moed_dense_fn dense_table[MOED_NUM_ISAS] = {moed_dense_bf16_scalar, moed_dense_bf16_avx2,
                                                         moed_dense_bf16_avx512, moed_dense_bf16_avx512};

/* the strip moed_cpu_moe runs for (dtype, isa): where 512-bit instructions are split in two (moed_cpu_vector_bits
 * 256: Zen 4) the AVX2 strips of q8 and mxfp4, 1.2-1.4x the AVX-512 VNNI ones there (through the pool, three
 * alternating rounds: q8 218-243 vs 273-339 us per expert, mxfp4 151-172 vs 184-221); int4's are even. Every
 * variant gives the same bits. */
static moed_strip_fn strip_for(int dtype, int isa) {
    if (isa >= MOED_ISA_AVX512 && moed_cpu_vector_bits() == 256 && (dtype == MOED_Q8 || dtype == MOED_MXFP4))
        isa = MOED_ISA_AVX2;
    return strip_table[dtype][isa];
}

static int quantised(int dtype) { return dtype == MOED_INT4 || dtype == MOED_Q8 || dtype == MOED_MXFP4; }

/* ------------------------------------------------------------------------------ handles */
void *moed_cpu_create(int nthreads, int64_t spin_ns) { return moed_pool_create(nthreads, spin_ns); }
void moed_cpu_destroy(void *h) { moed_pool_destroy((moed_pool *)h); }
int moed_cpu_threads(void *h) { return moed_pool_threads((moed_pool *)h); }
int moed_cpu_abi_version(void) { return 8; }

/* ------------------------------------------------------------------------------ one strip */
/* for the tests: one strip of one matrix, with a chosen ISA; returns 0, or -1 on bad arguments */
int moed_cpu_strip(int dtype, int isa, const moed_matrix *w, const float *x, int T, int64_t j0, int64_t j1,
                   float *lo, float *hi, int64_t ld) {
    if (dtype < 0 || dtype >= MOED_NUM_DTYPES || isa < 0 || isa > moed_cpu_detected_isa()) return -1;
    if (T < 1 || j0 < 0 || j1 <= j0 || j1 > w->N / 2 || ld < j1 - j0) return -1;
    if (quantised(dtype) && w->K % MOED_GROUP) return -1;
    moed_act a = {T, w->K, x, NULL, NULL, NULL};
    int8_t *xq = NULL;
    float *xs = NULL, *xsum = NULL;
    if (w->K % MOED_GROUP == 0) {
        int64_t groups = w->K / MOED_GROUP;
        xq = malloc((size_t)(T * w->K));
        xs = malloc(sizeof(float) * (size_t)(T * groups));
        xsum = malloc(sizeof(float) * (size_t)(T * groups));
        if (!xq || !xs || !xsum) { free(xq); free(xs); free(xsum); return -2; }
        moed_quantize_act(x, T, w->K, xq, xs, xsum);
        a.xq = xq; a.xs = xs; a.xsum = xsum;
    }
    strip_table[dtype][isa](w, &a, j0, j1, lo, hi, ld);
    free(xq); free(xs); free(xsum);
    return 0;
}

/* ------------------------------------------------------------------------------ dense bf16 */
/* Several matrices that share their input (an attention layer's q, k and v) in one call: the
 * rows of all of them are cut into tasks of about the same size, x is prepared once. Each output
 * is one task's dot product, so the result does not depend on how the rows were cut. */
#define MOED_DENSE_MAX 8
typedef struct {
    int count;
    const uint16_t *W[MOED_DENSE_MAX]; int64_t N[MOED_DENSE_MAX]; float *y[MOED_DENSE_MAX];
    int64_t first_task[MOED_DENSE_MAX + 1];  /* tasks of matrix m: [first_task[m], first_task[m+1]) */
    const float *xs; int64_t Kp; int T; int64_t K, rows_per_task; moed_dense_fn fn;
} dense_job;

static void dense_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    dense_job *j = (dense_job *)ctx;
    int m = 0;
    while (task >= j->first_task[m + 1]) m++;
    int64_t r0 = (task - j->first_task[m]) * j->rows_per_task, r1 = r0 + j->rows_per_task;
    if (r1 > j->N[m]) r1 = j->N[m];
    j->fn(j->W[m], j->xs, j->Kp, j->T, j->K, r0, r1, j->y[m], j->N[m]);
}

static int64_t tasks_for(moed_pool *p) { return 12 * (int64_t)moed_pool_threads(p); }

/* y_m[T][N_m] = x[T][K] @ W_m[N_m][K]^T for m < count, W_m bf16 bits row-major (torch's Linear weight) */
int moed_cpu_dense_bf16_many(void *h, int count, const uint16_t *const *W, const int64_t *N, int64_t K,
                             const float *x, int T, float *const *y) {
    if (!h || count < 1 || count > MOED_DENSE_MAX || K < 1 || T < 1) return -1;
    moed_pool *p = (moed_pool *)h;
    dense_job j;
    j.count = count;
    int64_t rows = 0;
    for (int m = 0; m < count; m++) {
        if (!W[m] || !y[m] || N[m] < 1) return -1;
        j.W[m] = W[m]; j.N[m] = N[m]; j.y[m] = y[m];
        rows += N[m];
    }
    int64_t per = (rows + tasks_for(p) - 1) / tasks_for(p);
    if (per < 16) per = 16;
    j.first_task[0] = 0;
    for (int m = 0; m < count; m++) j.first_task[m + 1] = j.first_task[m] + (N[m] + per - 1) / per;
    const int isa = moed_cpu_isa();
    j.Kp = moed_dense_row_length(isa, K);
    float *xs = (float *)moed_pool_scratch(p, sizeof(float) * (size_t)(T * j.Kp) + 64);
    if (!xs) return -2;
    moed_dense_prepare(isa, x, T, K, xs);
    j.xs = xs; j.T = T; j.K = K; j.rows_per_task = per; j.fn = dense_table[isa];
    moed_pool_run(p, dense_task, &j, j.first_task[count]);
    return 0;
}

int moed_cpu_dense_bf16(void *h, const uint16_t *W, int64_t N, int64_t K, const float *x, int T, float *y) {
    return moed_cpu_dense_bf16_many(h, 1, &W, &N, K, x, T, &y);
}

/* ------------------------------------------------------------------------------ MoE layer */

/* How one matrix [K][N] is cut along K into blocks of whole rows: each task streams one block, a
 * contiguous stretch of memory (columns strips of a k-major matrix would be read as short strided
 * pieces, which DRAM and the prefetchers serve at a fraction of the bandwidth). Blocks of ~1 MiB
 * measured 5-10% faster than ~256 KiB ones for the quantised banks (fewer stream starts), and
 * still give several tasks per thread with 8 experts. The cut depends
 * only on the matrix's shape and dtype, never on the other experts of the call, so an expert gives
 * the same bits alone or among others; the blocks' partial sums are added in block order. */
typedef struct { int64_t rows, count; } chunking;

static int64_t weight_row_bytes(int dtype, int64_t N) {
    switch (dtype) {
    case MOED_FP32: return 4 * N;
    case MOED_BF16: return 2 * N;
    case MOED_Q8: return N + 2 * N / MOED_GROUP;
    case MOED_INT4: return N / 2 + 4 * N / MOED_GROUP;
    default: return N / 2 + N / MOED_GROUP;  /* mxfp4 */
    }
}

static chunking chunks_of(int dtype, int64_t K, int64_t N) {
    const int64_t target = 1024 * 1024, max_chunks = 8;
    int64_t rows = target / weight_row_bytes(dtype, N);
    int64_t min_rows = (K + max_chunks - 1) / max_chunks;
    if (rows < min_rows) rows = min_rows;
    rows = (rows + MOED_GROUP - 1) / MOED_GROUP * MOED_GROUP;
    if (rows >= K) rows = K;
    chunking c = {rows, (K + rows - 1) / rows};
    return c;
}

/* the rows [k0, k0 + rows) of a matrix: a matrix of its own (pointers advanced, K shortened) */
static moed_matrix sub_matrix(int dtype, moed_matrix m, int64_t k0, int64_t rows) {
    int64_t N = m.N, wrow, srow;
    switch (dtype) {
    case MOED_FP32: wrow = 4 * N; srow = 0; break;
    case MOED_BF16: wrow = 2 * N; srow = 0; break;
    case MOED_Q8: wrow = N; srow = 2 * N; break;
    case MOED_INT4: wrow = N / 2; srow = 2 * N; break;
    default: wrow = N / 2; srow = N; break;
    }
    m.w = (const char *)m.w + wrow * k0;
    if (m.s) m.s = (const char *)m.s + srow * (k0 / MOED_GROUP);
    if (m.m) m.m = (const char *)m.m + srow * (k0 / MOED_GROUP);
    m.K = rows;
    return m;
}

/* [T][K] row-major -> block-major: block c (rows [c*r, c*r + len) of K) as its own [T][len] */
static void to_blocks(const void *src, void *dst, size_t elem, int T, int64_t K, int64_t r) {
    const char *s = (const char *)src;
    char *d = (char *)dst;
    for (int64_t k0 = 0; k0 < K; k0 += r) {
        int64_t len = K - k0 < r ? K - k0 : r;
        for (int t = 0; t < T; t++) {
            memcpy(d, s + ((int64_t)t * K + k0) * (int64_t)elem, (size_t)len * elem);
            d += len * (int64_t)elem;
        }
    }
}

typedef struct {
    float *x; int8_t *xq; float *xs, *xsum;  /* activations of one matrix, block-major */
} act_blocks;

static moed_act act_of(const act_blocks *b, int T, int64_t K, int64_t k0, int64_t len) {
    moed_act a;
    a.T = T;
    a.K = len;
    a.x = b->x + k0 * T;
    a.xq = b->xq ? b->xq + k0 * T : NULL;
    a.xs = b->xs ? b->xs + (k0 / MOED_GROUP) * T : NULL;
    a.xsum = b->xsum ? b->xsum + (k0 / MOED_GROUP) * T : NULL;
    (void)K;
    return a;
}

typedef struct {
    int32_t flat_id;
    int T;                 /* tokens routed to it */
    int first;             /* index of its first entry in the sorted slot list */
    float *x;              /* gathered activations [T][D] */
    act_blocks in, mid;    /* gate_up's and down's activations, block-major */
    float *gu_part;        /* [chunks1][T][2I]: lo half gate, hi half up */
    float *dn_part;        /* [chunks2][T][D] */
    float *h;              /* [T][I] */
    int8_t *hq; float *hs, *hsum;  /* [T][I], [T][I/32] */
    float *out;            /* [T][D] */
} expert_work;

typedef struct {
    const moed_bank *b;
    expert_work *ex;
    int nexp, quant;
    chunking c1, c2;
    moed_strip_fn strip;
} moe_job;

static moed_matrix matrix_of(const moed_bank *b, int down, int32_t fid) {
    moed_matrix m;
    const char *w = (const char *)(down ? b->dn_w : b->gu_w);
    const char *s = (const char *)(down ? b->dn_s : b->gu_s);
    const char *mn = (const char *)(down ? b->dn_m : b->gu_m);
    int64_t ws = down ? b->dn_w_stride : b->gu_w_stride, ss = down ? b->dn_s_stride : b->gu_s_stride;
    m.w = w + ws * fid;
    m.s = s ? s + ss * fid : NULL;
    m.m = mn ? mn + ss * fid : NULL;
    m.K = down ? b->I : b->D;
    m.N = down ? b->D : 2 * b->I;
    return m;
}

/* phase 1a: one block of gate_up rows of one expert -> its partial [T][2I] */
static void gate_up_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    moe_job *j = (moe_job *)ctx;
    const moed_bank *b = j->b;
    expert_work *e = &j->ex[task / j->c1.count];
    int64_t c = task % j->c1.count, k0 = c * j->c1.rows;
    int64_t len = b->D - k0 < j->c1.rows ? b->D - k0 : j->c1.rows;
    moed_matrix m = sub_matrix(b->dtype, matrix_of(b, 0, e->flat_id), k0, len);
    moed_act a = act_of(&e->in, e->T, b->D, k0, len);
    float *part = e->gu_part + c * (int64_t)e->T * 2 * b->I;
    j->strip(&m, &a, 0, b->I, part, part + b->I, 2 * b->I);
}

/* phase 1b: one expert's blocks added in order, bias, activation, int8 activations for down */
static void activation_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    moe_job *j = (moe_job *)ctx;
    const moed_bank *b = j->b;
    expert_work *e = &j->ex[task];
    const int64_t I = b->I, stride = (int64_t)e->T * 2 * I;
    const float *bias = b->gu_bias ? b->gu_bias + (int64_t)e->flat_id * 2 * I : NULL;
    for (int t = 0; t < e->T; t++) {
        float *h = e->h + (int64_t)t * I;
        float *p = e->gu_part + (int64_t)t * 2 * I;  /* block 0's gate and up, the other blocks added in */
        for (int64_t c = 1; c < j->c1.count; c++)
            for (int64_t col = 0; col < 2 * I; col++) p[col] += p[c * stride + col];
        moed_activate_row(b->act_kind, p, p + I, I, 1.0f, 1.0f, bias, bias ? bias + I : NULL, b->alpha, b->limit, h);
    }
    to_blocks(e->h, e->mid.x, sizeof(float), e->T, I, j->c2.rows);
    if (j->quant) {
        moed_quantize_act(e->h, e->T, I, e->hq, e->hs, e->hsum);
        to_blocks(e->hq, e->mid.xq, 1, e->T, I, j->c2.rows);
        to_blocks(e->hs, e->mid.xs, sizeof(float), e->T, I / MOED_GROUP, j->c2.rows / MOED_GROUP);
        to_blocks(e->hsum, e->mid.xsum, sizeof(float), e->T, I / MOED_GROUP, j->c2.rows / MOED_GROUP);
    }
}

/* phase 2a: one block of down rows of one expert -> its partial [T][D] */
static void down_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    moe_job *j = (moe_job *)ctx;
    const moed_bank *b = j->b;
    expert_work *e = &j->ex[task / j->c2.count];
    int64_t c = task % j->c2.count, k0 = c * j->c2.rows;
    int64_t len = b->I - k0 < j->c2.rows ? b->I - k0 : j->c2.rows;
    moed_matrix m = sub_matrix(b->dtype, matrix_of(b, 1, e->flat_id), k0, len);
    moed_act a = act_of(&e->mid, e->T, b->I, k0, len);
    float *part = e->dn_part + c * (int64_t)e->T * b->D;
    j->strip(&m, &a, 0, b->D / 2, part, part + b->D / 2, b->D);
}

/* phase 2b: one expert's down blocks added in order, plus the bias */
static void output_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    moe_job *j = (moe_job *)ctx;
    const moed_bank *b = j->b;
    expert_work *e = &j->ex[task];
    const int64_t D = b->D, stride = (int64_t)e->T * D;
    const float *bias = b->dn_bias ? b->dn_bias + (int64_t)e->flat_id * D : NULL;
    for (int64_t i = 0; i < stride; i++) {
        float v = e->dn_part[i];
        for (int64_t c = 1; c < j->c2.count; c++) v += e->dn_part[c * stride + i];
        if (bias) v += bias[i % D];
        e->out[i] = v;
    }
}

static int cmp_slot(const void *pa, const void *pb) {
    const int32_t *a = (const int32_t *)pa, *b = (const int32_t *)pb;  /* (flat_id, slot index) */
    if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
    return a[1] < b[1] ? -1 : (a[1] > b[1]);
}

/* Routed experts of N tokens: flat_ids [N][A] (-1: the slot is not run here), weights [N][A].
 * Writes per_slot [N][A][D] for the slots run (if not NULL) and y [N][D] = the weighted sum over the
 * slots run, ascending a (if not NULL). Returns 0; -1 bad arguments; -2 out of memory. */
int moed_cpu_moe(void *h, const moed_bank *b, const float *x, int N, int A, const int32_t *flat_ids,
                 const float *weights, float *per_slot, float *y) {
    if (!h || !b || N < 1 || A < 1 || b->dtype < 0 || b->dtype >= MOED_NUM_DTYPES) return -1;
    if (b->D % 2 || b->D < 2 || b->I < 1 || (quantised(b->dtype) && (b->D % MOED_GROUP || b->I % MOED_GROUP)))
        return -1;
    if (y && !weights) return -1;
    moed_pool *p = (moed_pool *)h;
    const int64_t D = b->D, I = b->I, nsl = (int64_t)N * A;
    int32_t *order = malloc(sizeof(int32_t) * 2 * (size_t)nsl);
    if (!order) return -2;
    int64_t used = 0;
    for (int64_t s = 0; s < nsl; s++) {
        int32_t fid = flat_ids[s];
        if (fid < -1 || fid >= b->num_slots) { free(order); return -1; }
        if (fid < 0) continue;
        order[2 * used] = fid;
        order[2 * used + 1] = (int32_t)s;
        used++;
    }
    qsort(order, (size_t)used, 2 * sizeof(int32_t), cmp_slot);
    int nexp = 0;
    for (int64_t i = 0; i < used; i++)
        if (i == 0 || order[2 * i] != order[2 * i - 2]) nexp++;
    if (nexp == 0) {
        free(order);
        if (y) memset(y, 0, sizeof(float) * (size_t)(N * D));
        return 0;
    }
    moe_job j;
    j.b = b;
    j.nexp = nexp;
    j.quant = quantised(b->dtype);
    j.c1 = chunks_of(b->dtype, D, 2 * I);
    j.c2 = chunks_of(b->dtype, I, D);
    j.strip = strip_for(b->dtype, moed_cpu_isa());
    const int quant = j.quant;
    const int64_t gD = D / MOED_GROUP, gI = I / MOED_GROUP;
    /* floats per routed token: x, in.x, gu parts, h, mid.x, dn parts, out, + the int8 side */
    size_t per_token = sizeof(float) * (size_t)(D + D + j.c1.count * 2 * I + I + I + j.c2.count * D + D);
    if (quant)
        per_token += (size_t)(D + I + I) + sizeof(float) * (size_t)(2 * gD + 4 * gI);
    const size_t arrays_per_expert = 16;
    size_t bytes = sizeof(expert_work) * (size_t)nexp + per_token * (size_t)used + 64 * (arrays_per_expert * (size_t)nexp + 1);
    /* the int8 activations of every token, quantised once (all its experts see the same row) and
     * gathered per expert: [N][D] int8 + [N][gD] scales and sums, plus one expert's gathered copy */
    if (quant)
        bytes += (size_t)(N * D) + sizeof(float) * (size_t)(2 * N * gD) + (size_t)(used * D) +
                 sizeof(float) * (size_t)(2 * used * gD) + 5 * 64;
    char *mem = moed_pool_scratch(p, bytes);
    if (!mem) { free(order); return -2; }
    expert_work *ex = (expert_work *)mem;
    char *cur = mem + sizeof(expert_work) * (size_t)nexp;
#define TAKE(ptr, type, count) do { cur = (char *)(((uintptr_t)cur + 63) & ~(uintptr_t)63); \
    (ptr) = (type *)cur; cur += sizeof(type) * (size_t)(count); } while (0)
    int k = -1;
    for (int64_t i = 0; i < used; i++) {
        if (i == 0 || order[2 * i] != order[2 * i - 2]) {
            k++;
            ex[k].flat_id = order[2 * i];
            ex[k].T = 0;
            ex[k].first = (int)i;
        }
        ex[k].T++;
    }
    int8_t *all_q = NULL, *tq = NULL;
    float *all_s = NULL, *ts = NULL;
    if (quant) {
        TAKE(all_q, int8_t, N * D); TAKE(all_s, float, 2 * N * gD);
        TAKE(tq, int8_t, used * D); TAKE(ts, float, 2 * used * gD);
        moed_quantize_act(x, N, D, all_q, all_s, all_s + (int64_t)N * gD);
    }
    for (int e = 0; e < nexp; e++) {
        expert_work *w = &ex[e];
        const int T = w->T;
        memset(&w->in, 0, sizeof w->in);
        memset(&w->mid, 0, sizeof w->mid);
        w->hq = NULL; w->hs = w->hsum = NULL;
        TAKE(w->x, float, T * D); TAKE(w->in.x, float, T * D);
        TAKE(w->gu_part, float, j.c1.count * T * 2 * I); TAKE(w->h, float, T * I); TAKE(w->mid.x, float, T * I);
        TAKE(w->dn_part, float, j.c2.count * T * D); TAKE(w->out, float, T * D);
        if (quant) {
            TAKE(w->in.xq, int8_t, T * D); TAKE(w->in.xs, float, T * gD); TAKE(w->in.xsum, float, T * gD);
            TAKE(w->hq, int8_t, T * I); TAKE(w->hs, float, T * gI); TAKE(w->hsum, float, T * gI);
            TAKE(w->mid.xq, int8_t, T * I); TAKE(w->mid.xs, float, T * gI); TAKE(w->mid.xsum, float, T * gI);
        }
        for (int t = 0; t < T; t++) {
            int32_t slot = order[2 * (w->first + t) + 1];
            memcpy(w->x + (int64_t)t * D, x + (int64_t)(slot / A) * D, sizeof(float) * (size_t)D);
        }
        to_blocks(w->x, w->in.x, sizeof(float), T, D, j.c1.rows);
        if (quant) {
            /* the token rows' int8 activations gathered, then cut into blocks like x */
            for (int t = 0; t < T; t++) {
                const int64_t n = order[2 * (w->first + t) + 1] / A;
                memcpy(tq + (int64_t)t * D, all_q + n * D, (size_t)D);
                memcpy(ts + (int64_t)t * gD, all_s + n * gD, sizeof(float) * (size_t)gD);
                memcpy(ts + (int64_t)(T + t) * gD, all_s + (int64_t)(N + n) * gD, sizeof(float) * (size_t)gD);
            }
            to_blocks(tq, w->in.xq, 1, T, D, j.c1.rows);
            to_blocks(ts, w->in.xs, sizeof(float), T, gD, j.c1.rows / MOED_GROUP);
            to_blocks(ts + T * gD, w->in.xsum, sizeof(float), T, gD, j.c1.rows / MOED_GROUP);
        }
    }
#undef TAKE
    j.ex = ex;
    moed_pool_run(p, gate_up_task, &j, j.c1.count * nexp);
    moed_pool_run(p, activation_task, &j, nexp);
    moed_pool_run(p, down_task, &j, j.c2.count * nexp);
    moed_pool_run(p, output_task, &j, nexp);
    /* scatter to the slots, then the weighted sum in ascending slot order */
    if (per_slot)
        for (int e = 0; e < nexp; e++)
            for (int t = 0; t < ex[e].T; t++) {
                int32_t slot = order[2 * (ex[e].first + t) + 1];
                memcpy(per_slot + (int64_t)slot * D, ex[e].out + (int64_t)t * D, sizeof(float) * (size_t)D);
            }
    if (y) {
        const float **src = malloc(sizeof(float *) * (size_t)nsl);
        if (!src) { free(order); return -2; }
        for (int64_t s = 0; s < nsl; s++) src[s] = NULL;
        for (int e = 0; e < nexp; e++)
            for (int t = 0; t < ex[e].T; t++) src[order[2 * (ex[e].first + t) + 1]] = ex[e].out + (int64_t)t * D;
        for (int n = 0; n < N; n++) {
            float *yn = y + (int64_t)n * D;
            int started = 0;
            for (int a = 0; a < A; a++) {
                const float *o = src[(int64_t)n * A + a];
                if (!o) continue;
                float wgt = weights[(int64_t)n * A + a];
                if (!started) {
                    for (int64_t c = 0; c < D; c++) yn[c] = o[c] * wgt;
                    started = 1;
                } else {
                    for (int64_t c = 0; c < D; c++) yn[c] = yn[c] + o[c] * wgt;
                }
            }
            if (!started) memset(yn, 0, sizeof(float) * (size_t)D);
        }
        free(src);
    }
    free(order);
    return 0;
}

