/* The MoE router at decode, in one call: logits = x @ W^T (float32 weights [E][D], float32
 * accumulation, rows shared out over the pool; a bf16 router's logits come from the dense bf16
 * GEMV and go to moed_route_select alone), then per token the softmax / top-k of
 * moed.layers.moe.route (its torch code is the reference, tests/kernels/test_router.py):
 *   kind 0 "softmax":      p = softmax(logits); the top_k largest p, optionally renormalised
 *   kind 1 "topk_softmax": the top_k largest logits, softmax over those (gpt-oss)
 * ids come out in descending order of score, ties to the lower expert id. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <string.h>

#include "moed_cpu.h"
#include "moed_pool.h"

int moed_cpu_isa(void);

typedef float (*router_dot_fn)(const float *a, const float *b, int64_t n);

/* one dot product per ISA from the same source: VW floats per vector (GCC vector extensions) */
#define ROUTER_DOT(NAME, VW)                                                                       \
    static float NAME(const float *a, const float *b, int64_t n) {                                 \
        typedef float vec __attribute__((vector_size(VW * 4)));                                    \
        vec s0 = {0}, s1 = {0};                                                                    \
        int64_t i = 0;                                                                             \
        for (; i + 2 * VW <= n; i += 2 * VW) {                                                     \
            vec a0, b0, a1, b1;                                                                    \
            memcpy(&a0, a + i, sizeof a0); memcpy(&b0, b + i, sizeof b0);                          \
            memcpy(&a1, a + i + VW, sizeof a1); memcpy(&b1, b + i + VW, sizeof b1);                \
            s0 += a0 * b0;                                                                         \
            s1 += a1 * b1;                                                                         \
        }                                                                                          \
        s0 += s1;                                                                                  \
        float t = 0.0f;                                                                            \
        for (int l = 0; l < VW; l++) t += s0[l];                                                   \
        for (; i < n; i++) t += a[i] * b[i];                                                       \
        return t;                                                                                  \
    }

ROUTER_DOT(router_dot_scalar, 4)
#if MOED_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
ROUTER_DOT(router_dot_avx2, 8)
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
ROUTER_DOT(router_dot_avx512, 16)
#pragma GCC pop_options
#else
#define router_dot_avx2 router_dot_scalar
#define router_dot_avx512 router_dot_scalar
#endif

typedef struct {
    const float *x, *W, *bias; int64_t N, E, D, rows_per_task; float *logits; router_dot_fn dot;
} router_job;

static void router_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const router_job *j = (const router_job *)ctx;
    const int64_t e0 = task * j->rows_per_task, e1 = e0 + j->rows_per_task < j->E ? e0 + j->rows_per_task : j->E;
    for (int64_t e = e0; e < e1; e++)
        for (int64_t t = 0; t < j->N; t++)
            j->logits[t * j->E + e] = j->dot(j->W + e * j->D, j->x + t * j->D, j->D) + (j->bias ? j->bias[e] : 0.0f);
}

/* per token: the softmax / top-k of the logits [N][E] (overwritten) into ids / weights [N][top_k] */
int moed_route_select(float *logits, int64_t N, int64_t E, int kind, int top_k, int renormalise, int64_t *ids,
                      float *weights) {
    if (!logits || !ids || !weights || N < 1 || E < 1 || top_k < 1 || top_k > E || top_k > 64 || (kind != 0 && kind != 1))
        return -1;
    for (int64_t t = 0; t < N; t++) {
        float *l = logits + t * E;
        float m = -INFINITY;
        for (int64_t e = 0; e < E; e++) m = l[e] > m ? l[e] : m;
        if (kind == 0) { /* probabilities over all experts (the order of the top-k is the same) */
            float z = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                l[e] = expf(l[e] - m);
                z += l[e];
            }
            for (int64_t e = 0; e < E; e++) l[e] /= z;
        }
        int64_t *it = ids + t * top_k;
        float *wt = weights + t * top_k;
        for (int a = 0; a < top_k; a++) { /* selection: top_k is small */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int b = 0; b < a; b++) taken |= it[b] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            it[a] = best;
            wt[a] = l[best];
        }
        if (kind == 1) { /* softmax over the chosen logits (wt[0] is their max) */
            const float top = wt[0];
            float z = 0.0f;
            for (int a = 0; a < top_k; a++) {
                wt[a] = expf(wt[a] - top);
                z += wt[a];
            }
            for (int a = 0; a < top_k; a++) wt[a] /= z;
        } else if (renormalise) {
            float z = 0.0f;
            for (int a = 0; a < top_k; a++) z += wt[a];
            for (int a = 0; a < top_k; a++) wt[a] /= z;
        }
    }
    return 0;
}

int moed_cpu_route(void *h, const float *x, int64_t N, int64_t D, const float *W, const float *bias, int64_t E,
                   int kind, int top_k, int renormalise, int64_t *ids, float *weights) {
    if (!h || !x || !W || !ids || !weights || N < 1 || D < 1 || E < 1 || top_k < 1 || top_k > E || top_k > 64 ||
        (kind != 0 && kind != 1))
        return -1;
    moed_pool *p = (moed_pool *)h;
    float *logits = (float *)moed_pool_scratch(p, sizeof(float) * (size_t)(N * E));
    if (!logits) return -2;
    static const router_dot_fn dots[MOED_NUM_ISAS] = {router_dot_scalar, router_dot_avx2, router_dot_avx512, router_dot_avx512};
    router_job j = {x, W, bias, N, E, D, 0, logits, dots[moed_cpu_isa()]};
    const int64_t tasks = 4 * (int64_t)moed_pool_threads(p);
    j.rows_per_task = (E + tasks - 1) / tasks;
    moed_pool_run(p, router_task, &j, (E + j.rows_per_task - 1) / j.rows_per_task);
    return moed_route_select(logits, N, E, kind, top_k, renormalise, ids, weights);
}
