/* Row-major quantised matrices (dense projections and the lm_head of a quantised GGUF, the
 * PackedLinear weights of moed/layers/packed_linear.py), y[t][n] = sum_k x[t][k] w[n][k]:
 *   q8  : w int8 [N][K]          s fp16 bits [N][K/32]   w = qs * d
 *   int4: w uint8 [N][K/2]       s, m bf16 bits [N][K/32]  w = code * scale + min, where byte
 *         b of group g (16 bytes per 32 k) holds k = 32g + b (low nibble) and 32g + 16 + b (high)
 * with the int8 activations of moed_cpu.h (xq, xs, xsum per 32): per row, sum over groups g of
 *   q8  : d[n][g] * xs[g] * (sum_k xq[k] qs[n][k])
 *   int4: scale[n][g] * xs[g] * (sum_k xq[k] code[n][k]) + min[n][g] * xsum[g]
 * Rows are read front to back, one at a time (the bank's k-major layout reads 32 strided rows
 * per column block, which a lone GEMV cannot stream at full bandwidth). The tests check it against
 * the torch twin moed.kernels.native_cpu_reference.matrix_product on the k-major copy of the same
 * numbers (kernels/rows_format.py converts exactly). Block-scaled FP8 rows (rows_fp8.c) go through the same
 * two entry points. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <string.h>

#include "moed_cpu.h"
#include "moed_pool.h"

typedef void (*rows_fn)(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy);
void moed_rows_q8_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, int64_t);
void moed_rows_int4_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, int64_t);
/* rows_fp8.c: block-scaled FP8 rows, with the float activations */
void moed_rows_fp8_scalar(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, int64_t);
void moed_rows_fp8_avx2(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, int64_t);
void moed_rows_fp8_avx512(const moed_matrix *, const moed_act *, int64_t, int64_t, float *, int64_t);
float moed_fp8_e4m3_to_f32(uint8_t b);

static float bf16f(uint16_t b) { return moed_bf16_to_f32(b); }

void moed_rows_q8_scalar(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / MOED_GROUP;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *qs = (const int8_t *)w->w + r * K;
        const uint16_t *d = (const uint16_t *)w->s + r * G;
        for (int t = 0; t < a->T; t++) {
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G;
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t s = 0;
                for (int i = 0; i < MOED_GROUP; i++) s += (int32_t)qs[g * MOED_GROUP + i] * xq[g * MOED_GROUP + i];
                acc += moed_f16_to_f32(d[g]) * xs[g] * (float)s;
            }
            y[(int64_t)t * ldy + r] = acc;
        }
    }
}

void moed_rows_int4_scalar(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / MOED_GROUP;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = (const uint8_t *)w->w + r * (K / 2);
        const uint16_t *sc = (const uint16_t *)w->s + r * G, *mn = (const uint16_t *)w->m + r * G;
        for (int t = 0; t < a->T; t++) {
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G, *xsum = a->xsum + (int64_t)t * G;
            float acc = 0.0f, accm = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32_t s = 0;
                for (int i = 0; i < 16; i++) {
                    const uint8_t b = q[g * 16 + i];
                    s += (int32_t)(b & 15) * xq[g * MOED_GROUP + i] + (int32_t)(b >> 4) * xq[g * MOED_GROUP + 16 + i];
                }
                acc += bf16f(sc[g]) * xs[g] * (float)s;
                accm += bf16f(mn[g]) * xsum[g];
            }
            y[(int64_t)t * ldy + r] = acc + accm;
        }
    }
}

#if MOED_X86
#include "moed_simd.h"
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

/* the per-group factors d[g] * xs[g] (q8: fp16 d) or scale[g] * xs[g] (int4: bf16) of 8 groups */
static inline __attribute__((always_inline)) __m256 rows_f16x8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline __attribute__((always_inline)) __m256 rows_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#ifndef ROWS_R
/* rows at a time. One: a thread's rows follow each other in memory, so it reads one stream (4
 * rows were 4 streams, which the prefetchers serve worse: in-process A/B on Zen 5, 2 threads,
 * the 6-layer bench model's decode step 18.0 -> 16.6 ms at q8_0, 14.4 -> 13.0 ms at q4_1) */
#define ROWS_R 1
#endif
#ifndef ROWS_PF
#define ROWS_PF 4096 /* software prefetch distance along a thread's stream of rows, bytes (0: none) */
#endif

#ifndef ROWS_PF2
/* AVX2: software prefetch distance along a thread's row stream, bytes (0: none). Zen 3, one
 * thread, a 49152 x 2048 int4 GEMV out of cache: 4.1 GB/s without it and one accumulator, 6.0
 * with two accumulators, 8.8-9.9 with both (prefetch 4096-8192) */
#define ROWS_PF2 4096
#endif

/* the exact int32 group sums of 32 int8 weights times the int8 activations, as 8 floats */
static inline __attribute__((always_inline)) __m256 rows_q8_group(const int8_t *qp, const int8_t *xp, __m256i ones) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)qp), x = _mm256_loadu_si256((const __m256i *)xp);
    /* |q| as unsigned (-128 -> 128) times x with q's sign: exact in int16 pairs */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), ones));
}
/* the same for 32 int4 codes (16 bytes: k = b low nibble, 16 + b high nibble) */
static inline __attribute__((always_inline)) __m256 rows_int4_group(const uint8_t *bp, const int8_t *xp, __m256i ones,
                                                                    __m256i low) {
    const __m128i b = _mm_loadu_si128((const __m128i *)bp);
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)xp)), ones));
}
static inline __attribute__((always_inline)) void rows_prefetch(const void *p, int lines) {
    if (ROWS_PF2)
        for (int l = 0; l < lines; l++) _mm_prefetch((const char *)p + ROWS_PF2 + 64 * l, _MM_HINT_T0);
}

/* One row at a time (a thread's rows follow each other in memory: one stream); groups go to two
 * float accumulators in turn (even groups, odd groups: two FMA chains), summed at the end. */
void moed_rows_q8_avx2(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / MOED_GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *qs = (const int8_t *)w->w + r * K;
        const uint16_t *d = (const uint16_t *)w->s + r * G;
        for (int t = 0; t < a->T; t++) {
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float f[8];
            for (int64_t g0 = 0; g0 < G; g0 += 8) {
                const int ng = G - g0 < 8 ? (int)(G - g0) : 8;
                if (ng == 8) {
                    _mm256_storeu_ps(f, _mm256_mul_ps(rows_f16x8(d + g0), _mm256_loadu_ps(xs + g0)));
                } else {
                    for (int i = 0; i < ng; i++) f[i] = moed_f16_to_f32(d[g0 + i]) * xs[g0 + i];
                }
                if (t == 0) rows_prefetch(qs + g0 * MOED_GROUP, 4);
                int i = 0;
                for (; i + 1 < ng; i += 2) {
                    const int64_t k = (g0 + i) * MOED_GROUP;
                    acc0 = _mm256_fmadd_ps(rows_q8_group(qs + k, xq + k, ones), _mm256_broadcast_ss(&f[i]), acc0);
                    acc1 = _mm256_fmadd_ps(rows_q8_group(qs + k + MOED_GROUP, xq + k + MOED_GROUP, ones),
                                           _mm256_broadcast_ss(&f[i + 1]), acc1);
                }
                if (i < ng) {
                    const int64_t k = (g0 + i) * MOED_GROUP;
                    acc0 = _mm256_fmadd_ps(rows_q8_group(qs + k, xq + k, ones), _mm256_broadcast_ss(&f[i]), acc0);
                }
            }
            y[(int64_t)t * ldy + r] = moed_hsum_avx2(_mm256_add_ps(acc0, acc1));
        }
    }
}

void moed_rows_int4_avx2(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / MOED_GROUP;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = (const uint8_t *)w->w + r * (K / 2);
        const uint16_t *sc = (const uint16_t *)w->s + r * G, *mn = (const uint16_t *)w->m + r * G;
        for (int t = 0; t < a->T; t++) {
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G, *xsum = a->xsum + (int64_t)t * G;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
            float f[8], tail = 0.0f;
            for (int64_t g0 = 0; g0 < G; g0 += 8) {
                const int ng = G - g0 < 8 ? (int)(G - g0) : 8;
                if (ng == 8) {
                    _mm256_storeu_ps(f, _mm256_mul_ps(rows_bf16x8(sc + g0), _mm256_loadu_ps(xs + g0)));
                    accm = _mm256_fmadd_ps(rows_bf16x8(mn + g0), _mm256_loadu_ps(xsum + g0), accm);
                } else {
                    for (int i = 0; i < ng; i++) {
                        f[i] = bf16f(sc[g0 + i]) * xs[g0 + i];
                        tail += bf16f(mn[g0 + i]) * xsum[g0 + i];
                    }
                }
                if (t == 0) rows_prefetch(q + g0 * 16, 2);
                int i = 0;
                for (; i + 1 < ng; i += 2) {
                    const int64_t g = g0 + i;
                    acc0 = _mm256_fmadd_ps(rows_int4_group(q + g * 16, xq + g * MOED_GROUP, ones, low),
                                           _mm256_broadcast_ss(&f[i]), acc0);
                    acc1 = _mm256_fmadd_ps(rows_int4_group(q + g * 16 + 16, xq + g * MOED_GROUP + MOED_GROUP, ones, low),
                                           _mm256_broadcast_ss(&f[i + 1]), acc1);
                }
                if (i < ng) {
                    const int64_t g = g0 + i;
                    acc0 = _mm256_fmadd_ps(rows_int4_group(q + g * 16, xq + g * MOED_GROUP, ones, low),
                                           _mm256_broadcast_ss(&f[i]), acc0);
                }
            }
            y[(int64_t)t * ldy + r] = moed_hsum_avx2(_mm256_add_ps(acc0, acc1)) + (moed_hsum_avx2(accm) + tail);
        }
    }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
/* two groups per 512-bit vector; the per-group factors f[g] reach the lanes of their group through
 * one permute (q8: lanes 0-7 the first group, 8-15 the second) */
void moed_rows_q8_avx512(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / MOED_GROUP;
    if (G % 8) {
        moed_rows_q8_avx2(w, a, r0, r1, y, ldy);
        return;
    }
    const __m512i ones = _mm512_set1_epi16(1);
    for (int64_t rb = r0; rb < r1; rb += ROWS_R) {
        const int R = r1 - rb < ROWS_R ? (int)(r1 - rb) : ROWS_R;
        for (int t = 0; t < a->T; t++) {
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G;
            __m512 acc[ROWS_R];
            for (int r = 0; r < ROWS_R; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t g0 = 0; g0 < G; g0 += 8) {
                __m256 f[ROWS_R];
                for (int r = 0; r < R; r++)
                    f[r] = _mm256_mul_ps(rows_f16x8((const uint16_t *)w->s + (rb + r) * G + g0), _mm256_loadu_ps(xs + g0));
                for (int i = 0; i < 8; i += 2) {
                    const int64_t k = (g0 + i) * MOED_GROUP;
                    const __m512i x = _mm512_loadu_si512((const void *)(xq + k));
                    const __m512i idx = _mm512_set_epi32(i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1,
                                                         i, i, i, i, i, i, i, i);
                    for (int r = 0; r < R; r++) {
                        const int8_t *qp = (const int8_t *)w->w + (rb + r) * K + k;
                        if (ROWS_PF) _mm_prefetch((const char *)qp + ROWS_PF, _MM_HINT_T0);
                        const __m512i q = _mm512_loadu_si512((const void *)qp);
                        const __mmask64 neg = _mm512_movepi8_mask(q);
                        const __m512i aq = _mm512_abs_epi8(q);  /* -128 -> 0x80, read as unsigned 128 */
                        const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                        const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(aq, sx), ones);
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                                 _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(f[r])), acc[r]);
                    }
                }
            }
            for (int r = 0; r < R; r++) y[(int64_t)t * ldy + rb + r] = _mm512_reduce_add_ps(acc[r]);
        }
    }
}

void moed_rows_int4_avx512(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    const int64_t K = w->K, G = K / MOED_GROUP;
    if (G % 8) {
        moed_rows_int4_avx2(w, a, r0, r1, y, ldy);
        return;
    }
    const __m512i ones = _mm512_set1_epi16(1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* x of groups (g, g+1) reordered to (g k0-15, g+1 k0-15, g k16-31, g+1 k16-31): the order the
     * nibbles of the two groups come out in (low nibbles of both, then high nibbles of both) */
    const __m512i xperm = _mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0);
    for (int64_t rb = r0; rb < r1; rb += ROWS_R) {
        const int R = r1 - rb < ROWS_R ? (int)(r1 - rb) : ROWS_R;
        for (int t = 0; t < a->T; t++) {
            const int8_t *xq = a->xq + (int64_t)t * K;
            const float *xs = a->xs + (int64_t)t * G, *xsum = a->xsum + (int64_t)t * G;
            __m512 acc[ROWS_R];
            __m256 accm[ROWS_R];
            for (int r = 0; r < ROWS_R; r++) {
                acc[r] = _mm512_setzero_ps();
                accm[r] = _mm256_setzero_ps();
            }
            for (int64_t g0 = 0; g0 < G; g0 += 8) {
                __m256 f[ROWS_R];
                for (int r = 0; r < R; r++) {
                    const uint16_t *sc = (const uint16_t *)w->s + (rb + r) * G + g0;
                    f[r] = _mm256_mul_ps(rows_bf16x8(sc), _mm256_loadu_ps(xs + g0));
                    accm[r] = _mm256_fmadd_ps(rows_bf16x8((const uint16_t *)w->m + (rb + r) * G + g0),
                                              _mm256_loadu_ps(xsum + g0), accm[r]);
                }
                for (int i = 0; i < 8; i += 2) {
                    const int64_t g = g0 + i;
                    const __m512i x = _mm512_permutexvar_epi64(xperm, _mm512_loadu_si512((const void *)(xq + g * MOED_GROUP)));
                    const __m512i idx = _mm512_set_epi32(i + 1, i + 1, i + 1, i + 1, i, i, i, i,
                                                         i + 1, i + 1, i + 1, i + 1, i, i, i, i);
                    for (int r = 0; r < R; r++) {
                        const uint8_t *bp = (const uint8_t *)w->w + (rb + r) * (K / 2) + g * 16;
                        if (ROWS_PF) _mm_prefetch((const char *)bp + ROWS_PF, _MM_HINT_T0);
                        const __m256i b = _mm256_loadu_si256((const __m256i *)bp);
                        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, low)),
                                                             _mm256_and_si256(_mm256_srli_epi16(b, 4), low), 1);
                        const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), ones);
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                                 _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(f[r])), acc[r]);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                y[(int64_t)t * ldy + rb + r] = _mm512_reduce_add_ps(acc[r]) + moed_hsum_avx2(accm[r]);
        }
    }
}
#pragma GCC pop_options
#else
void moed_rows_q8_avx2(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    moed_rows_q8_scalar(w, a, r0, r1, y, ldy);
}
void moed_rows_int4_avx2(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    moed_rows_int4_scalar(w, a, r0, r1, y, ldy);
}
void moed_rows_q8_avx512(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    moed_rows_q8_scalar(w, a, r0, r1, y, ldy);
}
void moed_rows_int4_avx512(const moed_matrix *w, const moed_act *a, int64_t r0, int64_t r1, float *y, int64_t ldy) {
    moed_rows_int4_scalar(w, a, r0, r1, y, ldy);
}
#endif

int moed_cpu_isa(void);

/* ----------------------------------------------------------------------------- the pool job */
#define ROWS_MAX 8
typedef struct {
    const moed_matrix *w[ROWS_MAX];
    float *y[ROWS_MAX];
    int64_t first_task[ROWS_MAX + 1];
    moed_act act;
    int64_t rows_per_task;
    rows_fn fn;
} rows_job;

static void rows_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    rows_job *j = (rows_job *)ctx;
    int m = 0;
    while (task >= j->first_task[m + 1]) m++;
    const int64_t r0 = (task - j->first_task[m]) * j->rows_per_task;
    const int64_t r1 = r0 + j->rows_per_task < j->w[m]->N ? r0 + j->rows_per_task : j->w[m]->N;
    j->fn(j->w[m], &j->act, r0, r1, j->y[m], j->w[m]->N);
}

/* y_m[T][N_m] = x[T][K] @ w_m^T for m < count (matrices of one dtype sharing x: q, k and v);
 * dtype MOED_Q8 or MOED_INT4 in the row-major layouts above. x is quantised once. */
int moed_cpu_rows_many(void *h, int dtype, int count, const moed_matrix *const *w, const float *x, int T,
                       float *const *y) {
    if (!h || count < 1 || count > ROWS_MAX || T < 1 || (dtype != MOED_Q8 && dtype != MOED_INT4 && dtype != MOED_ROWS_FP8))
        return -1;
    const int64_t K = w[0]->K;
    if (K < MOED_GROUP || K % (dtype == MOED_ROWS_FP8 ? MOED_FP8_BLOCK : MOED_GROUP)) return -1;
    moed_pool *p = (moed_pool *)h;
    rows_job j;
    int64_t rows = 0;
    for (int m = 0; m < count; m++) {
        if (!w[m] || !w[m]->w || !w[m]->s || (dtype == MOED_INT4 && !w[m]->m) || w[m]->K != K || w[m]->N < 1 || !y[m])
            return -1;
        j.w[m] = w[m];
        j.y[m] = y[m];
        rows += w[m]->N;
    }
    const int64_t tasks = 12 * (int64_t)moed_pool_threads(p);
    int64_t per = (rows + tasks - 1) / tasks;
    per = per < 16 ? 16 : (per + 3) / 4 * 4;
    j.rows_per_task = per;
    j.first_task[0] = 0;
    for (int m = 0; m < count; m++) j.first_task[m + 1] = j.first_task[m] + (w[m]->N + per - 1) / per;
    const int isa = moed_cpu_isa();
    static const rows_fn table[3][MOED_NUM_ISAS] = {
        {moed_rows_q8_scalar, moed_rows_q8_avx2, moed_rows_q8_avx512, moed_rows_q8_avx512},
        {moed_rows_int4_scalar, moed_rows_int4_avx2, moed_rows_int4_avx512, moed_rows_int4_avx512},
        {moed_rows_fp8_scalar, moed_rows_fp8_avx2, moed_rows_fp8_avx512, moed_rows_fp8_avx512}};
    j.act.T = T; j.act.K = K; j.act.x = x; j.act.xq = NULL; j.act.xs = NULL; j.act.xsum = NULL;
    if (dtype != MOED_ROWS_FP8) {  /* the int8 activations (FP8 rows take the float ones) */
        const int64_t G = K / MOED_GROUP;
        char *mem = (char *)moed_pool_scratch(p, (size_t)T * (size_t)K + sizeof(float) * (size_t)(2 * T * G) + 128);
        if (!mem) return -2;
        int8_t *xq = (int8_t *)mem;
        float *xs = (float *)(mem + (((size_t)T * (size_t)K + 63) & ~(size_t)63));
        moed_quantize_act(x, T, K, xq, xs, xs + T * G);
        j.act.xq = xq; j.act.xs = xs; j.act.xsum = xs + T * G;
    }
    j.fn = table[dtype == MOED_ROWS_FP8 ? 2 : dtype == MOED_INT4][isa];
    moed_pool_run(p, rows_task, &j, j.first_task[count]);
    return 0;
}

/* ----------------------------------------------------------------------------- to bf16 (prefill) */
/* out[n][k] = the weight (float32, or rounded to bf16, nearest even), computed in float32 exactly as the torch
 * reference does (q8: qs * d, one product; int4: code * scale, then + min: two roundings). */
static inline uint16_t rows_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);  /* branch-free: the loops vectorise */
}

typedef struct { int dtype; const moed_matrix *w; void *out; int64_t rows_per_task; } dequant_job;

/* the value v of weight k of the row at o: float32 (F32) or bf16 */
#define DQ_PUT(o, k, v) do { if (F32) ((float *)(o))[k] = (v); else ((uint16_t *)(o))[k] = rows_to_bf16(v); } while (0)

static inline __attribute__((always_inline)) void dequant_rows(const dequant_job *j, int64_t r0, int64_t r1, const int F32) {
    const int64_t K = j->w->K, G = K / MOED_GROUP;
    for (int64_t r = r0; r < r1; r++) {
        void *o = F32 ? (void *)((float *)j->out + r * K) : (void *)((uint16_t *)j->out + r * K);
        if (j->dtype == MOED_ROWS_FP8) {  /* the float32 product code * scale: the torch twin's */
            const uint8_t *q = (const uint8_t *)j->w->w + r * K;
            const float *s = (const float *)j->w->s + r * (K / MOED_FP8_BLOCK);
            for (int64_t k = 0; k < K; k++) DQ_PUT(o, k, moed_fp8_e4m3_to_f32(q[k]) * s[k / MOED_FP8_BLOCK]);
        } else if (j->dtype == MOED_Q8) {
            const int8_t *qs = (const int8_t *)j->w->w + r * K;
            const uint16_t *d = (const uint16_t *)j->w->s + r * G;
            for (int64_t g = 0; g < G; g++) {
                const float s = moed_f16_to_f32(d[g]);
                for (int i = 0; i < MOED_GROUP; i++) DQ_PUT(o, g * MOED_GROUP + i, (float)qs[g * MOED_GROUP + i] * s);
            }
        } else {
            const uint8_t *q = (const uint8_t *)j->w->w + r * (K / 2);
            const uint16_t *sc = (const uint16_t *)j->w->s + r * G, *mn = (const uint16_t *)j->w->m + r * G;
            for (int64_t g = 0; g < G; g++) {
                const float s = bf16f(sc[g]), m = bf16f(mn[g]);
                for (int i = 0; i < 16; i++) {
                    const uint8_t b = q[g * 16 + i];
                    float lo = (float)(b & 15) * s, hi = (float)(b >> 4) * s;
                    DQ_PUT(o, g * MOED_GROUP + i, lo + m);
                    DQ_PUT(o, g * MOED_GROUP + 16 + i, hi + m);
                }
            }
        }
    }
}

static void dequant_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const dequant_job *j = (const dequant_job *)ctx;
    const int64_t r0 = task * j->rows_per_task, r1 = r0 + j->rows_per_task < j->w->N ? r0 + j->rows_per_task : j->w->N;
    dequant_rows(j, r0, r1, 0);
}

static void dequant_task_f32(void *ctx, int64_t task, int thread) {
    (void)thread;
    const dequant_job *j = (const dequant_job *)ctx;
    const int64_t r0 = task * j->rows_per_task, r1 = r0 + j->rows_per_task < j->w->N ? r0 + j->rows_per_task : j->w->N;
    dequant_rows(j, r0, r1, 1);
}

static int dequant_matrix(void *h, int dtype, const moed_matrix *w, void *out, int f32) {
    if (!h || !w || !out || (dtype != MOED_Q8 && dtype != MOED_INT4 && dtype != MOED_ROWS_FP8) || w->K < MOED_GROUP ||
        w->K % (dtype == MOED_ROWS_FP8 ? MOED_FP8_BLOCK : MOED_GROUP) ||
        w->N < 1 || !w->w || !w->s || (dtype == MOED_INT4 && !w->m))
        return -1;
    moed_pool *p = (moed_pool *)h;
    dequant_job j = {dtype, w, out, 0};
    const int64_t tasks = 8 * (int64_t)moed_pool_threads(p);
    j.rows_per_task = (w->N + tasks - 1) / tasks;
    moed_pool_run(p, f32 ? dequant_task_f32 : dequant_task, &j, (w->N + j.rows_per_task - 1) / j.rows_per_task);
    return 0;
}

int moed_cpu_rows_to_bf16(void *h, int dtype, const moed_matrix *w, uint16_t *out) {
    return dequant_matrix(h, dtype, w, out, 0);
}

/* the same weights as float32 (the torch twin's values bit for bit): the prefill GEMMs of CPUs without bf16 GEMMs */
int moed_cpu_rows_to_f32(void *h, int dtype, const moed_matrix *w, float *out) {
    return dequant_matrix(h, dtype, w, out, 1);
}
