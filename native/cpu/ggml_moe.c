/* The routed experts of one MoE layer whose bank keeps GGUF blocks as stored (the "ggml" bank):
 * one call for N tokens x A slots, as moe.c does for the other banks.
 *
 *   gather   each run expert's tokens; their int8 activations (moed_quantize_act_span: the span the
 *            gate and up rows need, ggml_rows.h) side by side
 *   phase 1  tasks (expert, gate or up, a stretch of rows): dot products -> g_e, u_e [T_e][I]; where the gate is
 *            the up matrix itself (Nemotron-H's non-gated relu^2 experts: one tensor under both names), the
 *            rows are read once and u_e is g_e
 *   phase 2  per expert: scales, biases, activation -> h_e [T_e][I], quantised to int8 (the down rows' span)
 *   phase 3  tasks (expert, a stretch of down rows) -> o_e [T_e][D] (x scale, + bias), scattered to the slots
 *   merge    y[t] = sum over a ascending of weight[t][a] * out[t][a] over the slots run
 * A task's rows are one contiguous stretch of memory (one stream for the prefetchers).
 *
 * The three phases are one job on the pool, not three: its tasks are every expert's phase-1 tasks, then every
 * expert's phase-3 tasks. The thread that finishes an expert's last phase-1 task runs its phase 2 and marks it
 * ready; a phase-3 task waits for its expert's mark (by then long set, but for the last experts or a single
 * one). Three jobs had each thread wait at two barriers for the other's last task (half a task, ~10 us at
 * decode, twice per layer) and woke the pool three times. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_rows.h"
#include "ggml_x8.h"
#include "moed_api.h"
#include "moed_cpu.h"
#include "moed_pool.h"


typedef struct {
    int64_t expert;
    int T;
    int64_t first;        /* first token row of this expert in the gathered arrays */
} run_expert;

typedef struct {
    const moed_ggml_layer *L;
    moed_ggml_dot_fn dg, du, dd;
    moed_ggml_fdot_fn fg, fu, fd;  /* the FP8 types' float-activation dots (xf, h), else NULL */
    moed_ggml_dot8_fn g8, u8, d8;  /* the x8 layouts' dots (ggml_x8.h: 8 rows a call), else NULL */
    const run_expert *ex;
    int nex;
    int64_t D, I, rows1, rows3;   /* rows per task in phases 1 and 3 */
    int64_t t1, t3;               /* tasks per expert in phases 1 (gate and up, or the one of them) and 3 */
    int gate_is_up;               /* the gate matrix is the up matrix: phase 1 reads it once, into g */
    const int8_t *xq; const float *xs, *xsum;   /* gathered [Tall][D] */
    const float *xf;              /* gathered float rows [Tall][D] (when gate or up is an FP8 type) */
    float *g, *u;                 /* [Tall][I] */
    float *h; int8_t *hq; float *hs, *hsum;     /* [Tall][I] */
    float *o;                     /* [Tall][D] */
    atomic_int *left1;            /* per expert: phase-1 tasks not yet finished */
    atomic_int *ready;            /* per expert: phase 2 done (h, hq, hs, hsum written) */
} job;

/* the GGUF type whose blocks a matrix holds (an x8 layout's, or its own) */
static int block_type(int type) {
    const int base = moed_ggml_x8_base(type);
    return base ? base : type;
}

static const uint8_t *expert_rows(const moed_ggml_matrix *m, int64_t e) { return m->w + e * m->rows * m->row_bytes; }

static void phase1(void *ctx, int64_t task, int thread) {
    (void)thread;
    const job *j = (const job *)ctx;
    const run_expert *e = &j->ex[task / j->t1];
    int64_t c = task % j->t1, per = j->gate_is_up ? j->t1 : j->t1 / 2;
    int up = c >= per;
    const moed_ggml_matrix *m = up ? &j->L->up : &j->L->gate;
    int64_t r0 = (c % per) * j->rows1, r1 = r0 + j->rows1 < j->I ? r0 + j->rows1 : j->I;
    const uint8_t *w = expert_rows(m, e->expert);
    float *out = (up ? j->u : j->g) + e->first * j->I;
    moed_ggml_dot_fn dot = up ? j->du : j->dg;
    moed_ggml_fdot_fn fdot = up ? j->fu : j->fg;
    moed_ggml_dot8_fn dot8 = up ? j->u8 : j->g8;
    const int64_t G = j->D / 32;
    if (dot8) {  /* r0 and r1 are multiples of 8 (rows_per_task) */
        for (int64_t r = r0; r < r1; r += 8)
            dot8(w + r * m->row_bytes, j->D, j->xq + e->first * j->D, j->xs + e->first * G, j->xsum + e->first * G,
                 e->T, out + r, j->I);
        return;
    }
    if (fdot) {
        for (int64_t r = r0; r < r1; r++) fdot(w + r * m->row_bytes, j->D, j->xf + e->first * j->D, e->T, out + r, j->I);
        return;
    }
    for (int64_t r = r0; r < r1; r++)
        dot(w + r * m->row_bytes, j->D, j->xq + e->first * j->D, j->xs + e->first * G, j->xsum + e->first * G, e->T,
            out + r, j->I);
}

static void phase2(void *ctx, int64_t task, int thread) {
    (void)thread;
    const job *j = (const job *)ctx;
    const run_expert *e = &j->ex[task];
    const moed_ggml_layer *L = j->L;
    const float *b = L->gate_up_bias ? L->gate_up_bias + e->expert * 2 * j->I : NULL;
    const float sg = L->gate_scale ? L->gate_scale[e->expert] : 1.0f, su = L->up_scale ? L->up_scale[e->expert] : 1.0f;
    const float *ur = j->gate_is_up ? j->g : j->u;
    for (int t = 0; t < e->T; t++) {
        const int64_t row = (e->first + t) * j->I;
        moed_activate_row(L->act_kind, j->g + row, ur + row, j->I, sg, su, b, b ? b + j->I : NULL, L->alpha, L->limit,
                          j->h + row);
    }
    const int64_t G = j->I / 32;
    moed_quantize_act_span(j->h + e->first * j->I, e->T, j->I, moed_ggml_act_span(block_type(L->down.type)),
                           j->hq + e->first * j->I, j->hs + e->first * G, j->hsum + e->first * G);
}

static void phase3(void *ctx, int64_t task, int thread) {
    (void)thread;
    const job *j = (const job *)ctx;
    const run_expert *e = &j->ex[task / j->t3];
    const moed_ggml_matrix *m = &j->L->down;
    int64_t r0 = (task % j->t3) * j->rows3, r1 = r0 + j->rows3 < j->D ? r0 + j->rows3 : j->D;
    const uint8_t *w = expert_rows(m, e->expert);
    const int64_t G = j->I / 32;
    if (j->d8) {
        for (int64_t r = r0; r < r1; r += 8)
            j->d8(w + r * m->row_bytes, j->I, j->hq + e->first * j->I, j->hs + e->first * G, j->hsum + e->first * G,
                  e->T, j->o + e->first * j->D + r, j->D);
        return;
    }
    if (j->fd) {
        for (int64_t r = r0; r < r1; r++)
            j->fd(w + r * m->row_bytes, j->I, j->h + e->first * j->I, e->T, j->o + e->first * j->D + r, j->D);
        return;
    }
    for (int64_t r = r0; r < r1; r++)
        j->dd(w + r * m->row_bytes, j->I, j->hq + e->first * j->I, j->hs + e->first * G, j->hsum + e->first * G, e->T,
              j->o + e->first * j->D + r, j->D);
}

/* phase-1 tasks [0, nex t1), then phase-3 tasks (see the top of the file) */
static void fused(void *ctx, int64_t task, int thread) {
    job *j = (job *)ctx;
    const int64_t n1 = (int64_t)j->nex * j->t1;
    if (task < n1) {
        phase1(ctx, task, thread);
        const int64_t e = task / j->t1;
        if (atomic_fetch_sub(&j->left1[e], 1) == 1) {  /* the expert's last: its gate and up are all written */
            phase2(ctx, e, thread);
            atomic_store_explicit(&j->ready[e], 1, memory_order_release);
        }
        return;
    }
    const int64_t t3 = task - n1, e = t3 / j->t3;
    for (int spins = 1; !atomic_load_explicit(&j->ready[e], memory_order_acquire); spins++) {
#if MOED_X86
        __builtin_ia32_pause();
#endif
        if (spins % 1024 == 0) sched_yield();  /* the thread finishing it may share this core with another program */
    }
    phase3(ctx, t3, thread);
}

/* the next 64-byte aligned piece of the scratch (the kernels' 512-bit activation loads stay within
 * one cache line) */
static void *take(char **p, size_t bytes) {
    char *at = (char *)(((uintptr_t)*p + 63) & ~(uintptr_t)63);
    *p = at + bytes;
    return at;
}

/* ~256 KB of weights per task, a multiple of 8 rows (an x8 group is never split; rows are multiples of 32) */
#ifndef GGML_MOE_TASK_BYTES
#define GGML_MOE_TASK_BYTES 262144
#endif
static int64_t rows_per_task(int64_t rows, int64_t row_bytes) {
    int64_t r = (GGML_MOE_TASK_BYTES + row_bytes - 1) / row_bytes;
    r = (r + 7) / 8 * 8;
    return r < rows ? r : rows;
}

static int valid(const moed_ggml_matrix *m, int64_t rows, int64_t K) {
    const int t = block_type(m->type), bw = moed_ggml_block_weights(t);
    return bw && m->w && m->rows == rows && m->K == K && K % bw == 0 &&
           m->row_bytes == K / bw * moed_ggml_block_bytes(t) && (t == m->type || rows % 8 == 0);
}

static moed_ggml_dot_fn rows_dot(int type, int isa) { return moed_ggml_x8_base(type) ? NULL : moed_ggml_dot(type, isa); }

static moed_ggml_dot8_fn x8_dot(int type, int isa) { return moed_ggml_x8_base(type) ? moed_ggml_dot8(type, isa) : NULL; }

/* ids [N][A]: the layer's expert of each slot, -1 for a slot not run here. per_slot [N][A][D]
 * (optional) gets each run slot's output; y [N][D] (optional) the weighted sum over the run slots. */
int moed_cpu_ggml_moe(void *h, const moed_ggml_layer *L, const float *x, int N, int A, const int32_t *ids,
                      const float *weights, float *per_slot, float *y) {
    if (!h || !L || !x || N < 1 || A < 1 || !ids || (y && !weights)) return -1;
    const int64_t D = L->gate.K, I = L->gate.rows;
    if (D % 32 || I % 32 || !valid(&L->gate, I, D) || !valid(&L->up, I, D) || !valid(&L->down, D, I)) return -1;
    const int isa = moed_cpu_isa();
    job j = {L, rows_dot(L->gate.type, isa), rows_dot(L->up.type, isa), rows_dot(L->down.type, isa),
             moed_ggml_fdot(L->gate.type, isa), moed_ggml_fdot(L->up.type, isa), moed_ggml_fdot(L->down.type, isa),
             x8_dot(L->gate.type, isa), x8_dot(L->up.type, isa), x8_dot(L->down.type, isa)};
    if ((!j.dg && !j.fg && !j.g8) || (!j.du && !j.fu && !j.u8) || (!j.dd && !j.fd && !j.d8)) return -1;
    const int float_x = j.fg || j.fu;
    for (int64_t s = 0; s < (int64_t)N * A; s++)
        if (ids[s] < -1 || ids[s] >= L->E) return -1;
    /* the run experts in ascending id, each with its tokens */
    int64_t *count = (int64_t *)calloc((size_t)L->E, sizeof(int64_t));
    if (!count) return -2;
    int64_t total = 0;
    for (int64_t s = 0; s < (int64_t)N * A; s++)
        if (ids[s] >= 0) { count[ids[s]]++; total++; }
    int nex = 0;
    for (int64_t e = 0; e < L->E; e++) nex += count[e] > 0;
    if (total == 0) {
        free(count);
        if (y) memset(y, 0, sizeof(float) * (size_t)N * (size_t)D);
        return 0;
    }
    const int64_t GD = D / 32, GI = I / 32;
    size_t bytes = sizeof(run_expert) * (size_t)nex + sizeof(int64_t) * (size_t)total      /* experts, slot of each row */
                   + (size_t)total * (size_t)D + 2 * sizeof(float) * (size_t)total * (size_t)GD  /* xq, xs, xsum */
                   + 3 * sizeof(float) * (size_t)total * (size_t)I                          /* g, u, h */
                   + (size_t)total * (size_t)I + 2 * sizeof(float) * (size_t)total * (size_t)GI  /* hq, hs, hsum */
                   + sizeof(float) * (size_t)total * (size_t)D * (size_t)(1 + float_x)      /* o, xf */
                   + 2 * sizeof(atomic_int) * (size_t)nex                                   /* left1, ready */
                   + 18 * 64;                                                               /* alignment */
    char *p = (char *)moed_pool_scratch((moed_pool *)h, bytes);
    if (!p) { free(count); return -2; }
    run_expert *ex = (run_expert *)take(&p, sizeof(run_expert) * (size_t)nex);
    int64_t *slot_of = (int64_t *)take(&p, sizeof(int64_t) * (size_t)total);
    float *xs = (float *)take(&p, sizeof(float) * (size_t)(total * GD));
    float *xsum = (float *)take(&p, sizeof(float) * (size_t)(total * GD));
    float *g = (float *)take(&p, sizeof(float) * (size_t)(total * I));
    float *u = (float *)take(&p, sizeof(float) * (size_t)(total * I));
    float *hh = (float *)take(&p, sizeof(float) * (size_t)(total * I));
    float *hs = (float *)take(&p, sizeof(float) * (size_t)(total * GI));
    float *hsum = (float *)take(&p, sizeof(float) * (size_t)(total * GI));
    float *o = (float *)take(&p, sizeof(float) * (size_t)(total * D));
    int8_t *xq = (int8_t *)take(&p, (size_t)(total * D));
    int8_t *hq = (int8_t *)take(&p, (size_t)(total * I));
    float *xf = float_x ? (float *)take(&p, sizeof(float) * (size_t)(total * D)) : NULL;
    atomic_int *left1 = (atomic_int *)take(&p, sizeof(atomic_int) * (size_t)nex);
    atomic_int *ready = (atomic_int *)take(&p, sizeof(atomic_int) * (size_t)nex);
    /* gather: rows in expert order, tokens ascending within an expert */
    int64_t *next = count;  /* reused: the next row of each expert */
    int64_t first = 0;
    int k = 0;
    for (int64_t e = 0; e < L->E; e++) {
        if (!count[e]) continue;
        ex[k].expert = e;
        ex[k].T = (int)count[e];
        ex[k].first = first;
        next[e] = first;
        first += ex[k].T;
        k++;
    }
    const int gspan = moed_ggml_act_span(block_type(L->gate.type)), uspan = moed_ggml_act_span(block_type(L->up.type));
    const int x_span = gspan > uspan ? gspan : uspan;
    /* a token is quantised once, for its first run slot; its other slots copy that row */
    int64_t done_row = -1, done_token = -1;
    for (int64_t s = 0; s < (int64_t)N * A; s++) {
        if (ids[s] < 0) continue;
        int64_t row = next[ids[s]]++;
        slot_of[row] = s;
        if (s / A == done_token) {
            memcpy(xq + row * D, xq + done_row * D, (size_t)D);
            memcpy(xs + row * GD, xs + done_row * GD, sizeof(float) * (size_t)GD);
            memcpy(xsum + row * GD, xsum + done_row * GD, sizeof(float) * (size_t)GD);
        } else {
            moed_quantize_act_span(x + (s / A) * D, 1, D, x_span, xq + row * D, xs + row * GD, xsum + row * GD);
            done_row = row;
            done_token = s / A;
        }
        if (xf) memcpy(xf + row * D, x + (s / A) * D, sizeof(float) * (size_t)D);
    }
    free(count);
    j.ex = ex;
    j.nex = nex;
    j.D = D;
    j.I = I;
    j.rows1 = rows_per_task(I, L->gate.row_bytes > L->up.row_bytes ? L->gate.row_bytes : L->up.row_bytes);
    j.rows3 = rows_per_task(D, L->down.row_bytes);
    j.gate_is_up = L->gate.w == L->up.w && L->gate.type == L->up.type && L->gate.row_bytes == L->up.row_bytes
                   && L->gate_scale == L->up_scale;
    j.t1 = (j.gate_is_up ? 1 : 2) * ((I + j.rows1 - 1) / j.rows1);
    j.t3 = (D + j.rows3 - 1) / j.rows3;
    j.xq = xq; j.xs = xs; j.xsum = xsum; j.xf = xf;
    j.g = g; j.u = u; j.h = hh; j.hq = hq; j.hs = hs; j.hsum = hsum; j.o = o;
    for (int i = 0; i < nex; i++) {
        atomic_init(&left1[i], (int)j.t1);
        atomic_init(&ready[i], 0);
    }
    j.left1 = left1;
    j.ready = ready;
    moed_pool_run((moed_pool *)h, fused, &j, (int64_t)nex * (j.t1 + j.t3));
    /* down scale and bias, scatter to the slots */
    for (int i = 0; i < nex; i++) {
        const float *b = L->down_bias ? L->down_bias + ex[i].expert * D : NULL;
        const float sd = L->down_scale ? L->down_scale[ex[i].expert] : 1.0f;
        for (int t = 0; t < ex[i].T; t++) {
            int64_t row = ex[i].first + t;
            float *out = o + row * D;
            if (L->down_scale)
                for (int64_t c = 0; c < D; c++) out[c] *= sd;
            if (b)
                for (int64_t c = 0; c < D; c++) out[c] += b[c];
            if (per_slot) memcpy(per_slot + slot_of[row] * D, out, sizeof(float) * (size_t)D);
        }
    }
    if (y) {
        /* slot order: row of each slot (rows are in expert order, slots are visited ascending) */
        memset(y, 0, sizeof(float) * (size_t)N * (size_t)D);
        int64_t *row_of = slot_of;  /* invert in place: slot -> row, -1 when not run */
        int64_t *inv = (int64_t *)calloc((size_t)N * (size_t)A, sizeof(int64_t));
        if (!inv) return -2;
        for (int64_t s = 0; s < (int64_t)N * A; s++) inv[s] = -1;
        for (int64_t r = 0; r < total; r++) inv[row_of[r]] = r;
        for (int n = 0; n < N; n++)
            for (int a = 0; a < A; a++) {
                int64_t r = inv[(int64_t)n * A + a];
                if (r < 0) continue;
                const float wgt = weights[(int64_t)n * A + a], *out = o + r * D;
                float *dst = y + (int64_t)n * D;
                for (int64_t c = 0; c < D; c++) dst[c] += wgt * out[c];
            }
        free(inv);
    }
    return 0;
}
