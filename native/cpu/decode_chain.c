/* A whole CPU decode step's layers in one call: for every layer, the input RMSNorm, the q/k/v
 * projections (+ bias), decode attention, o_proj (+ bias), the residual add and post-attention
 * RMSNorm, the router and every routed expert, and the second residual add.
 *
 * It runs the same entry points, in the same order, on the same buffers as the Python decode
 * path of moed.models.moe_transformer (which is its reference: tests/models/test_decode_chain.py
 * checks the logits bit for bit), so the only thing it removes is the Python and torch glue
 * between them: about 0.25-0.4 ms per layer on a 2-core machine, and the pool's threads stay
 * awake (spinning) from one phase to the next instead of sleeping between Python calls.
 * moed.models.decode_chain builds the layer descriptions once per model and decides when it
 * applies (the CPU executor, a family whose layers are all attention + routed MoE). */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml_rows.h"
#include "moed_api.h"

typedef struct {
    int32_t dtype;       /* MOED_BF16: m.w is bf16 [N][K] (torch's Linear weight); MOED_Q8 / MOED_INT4 /
                          * MOED_ROWS_FP8: the rows layouts of rows_quant.c / rows_fp8.c (m.w, m.s, m.m);
                          * MOED_ROWS_GGML: m.w the GGUF block rows [N][row bytes] of ggml_type, m.s a
                          * float32 factor every output takes (or NULL) */
    int32_t ggml_type;   /* MOED_ROWS_GGML: a MOED_GGML_* id */
    moed_matrix m;       /* K in, N out */
    const float *bias;   /* [N] or NULL */
} moed_linear;

typedef struct {
    const void *in_norm, *post_norm;     /* [D] float32, or bf16 bits when *_bf16 */
    int32_t in_norm_bf16, post_norm_bf16;
    moed_linear q, k, v, o;
    moed_attn_decode_args attn;          /* the layer's own fields (heads, norms, rotary, caches, window,
                                          * scale, sinks); the step's fields are filled here */
    const void *router_w;                /* [E][D] float32, or bf16 bits when router_bf16 */
    const float *router_b;               /* [E] or NULL */
    int64_t E;
    int32_t router_bf16;
    int32_t router_kind, top_k, renormalise;  /* as moed_cpu_route */
    int32_t flat_base;                   /* flat id of this layer's expert 0 in the bank */
    const moed_bank *bank;               /* NULL: a dense layer (mlp below, no router) */
    /* the dense MLP of a dense layer, or the shared expert of an MoE layer (mlp_down.m.w NULL: none):
     * down(silu(gate(h)) * up(h)), scaled by sigmoid(mlp_scale(h)) when mlp_scale.m.w is set */
    moed_linear mlp_gate, mlp_up, mlp_down, mlp_scale;
    const moed_ggml_layer *ggml;         /* instead of bank: the layer's experts as GGUF block rows (flat_base 0) */
} moed_chain_layer;

/* the step's tokens: one new token per row */
typedef struct {
    int32_t B;
    int64_t D;
    float eps;
    const float *cos, *sin;              /* [B][rot_dim/2] */
    const int32_t *block_table;          /* [B][max_blocks] (attn_decode.h) */
    int32_t max_blocks;
    const int64_t *start, *pos;          /* [B] */
    const int32_t *length;               /* [B] (1 per row) */
    int64_t num_keys;
} moed_chain_step;

/* the final norm and the lm_head, run after the layers when the caller gives them */
typedef struct {
    const void *norm;                    /* [D] float32, or bf16 bits when norm_bf16 */
    int32_t norm_bf16;
    moed_linear lm_head;                 /* [V][D] */
    float *logits;                       /* [B][V] */
} moed_chain_head;

enum { T_PROJ = 0, T_ATTN = 1, T_ROUTER = 2, T_EXPERTS = 3, T_NORMS = 4, T_HEAD = 5, T_PARTS = 6 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* floats of work memory run_layers needs for B rows (aligned pieces) */
int64_t moed_chain_work_floats(const moed_chain_layer *layers, int n, int B, int64_t D) {
    int64_t q = 0, k = 0, v = 0, ao = 0, a = 0, e = 0, m = 0;
    for (int l = 0; l < n; l++) {
        q = max64(q, layers[l].q.m.N);
        k = max64(k, layers[l].k.m.N);
        v = max64(v, layers[l].v.m.N);
        ao = max64(ao, (int64_t)layers[l].attn.H * layers[l].attn.Dv);
        a = max64(a, layers[l].top_k);
        e = max64(e, layers[l].E);
        if (layers[l].mlp_down.m.w) m = max64(m, layers[l].mlp_gate.m.N);
    }
    /* q, k, v, attention out, o, h, experts out, router logits, MLP gate / up / h, MLP out, its gate;
     * ids (int64), weights (float), flat ids (int32); each of the 16 pieces starts on 64 bytes */
    return (int64_t)B * (q + k + v + ao + 4 * D + e + 3 * m + 1 + 4 * a) + 16 * 16;
}

static int same_input(const moed_linear *a, const moed_linear *b) { return a->dtype == b->dtype && a->m.K == b->m.K; }

/* y_i = x @ w_i^T (+ bias) for the n linears sharing x: one call when they share a dtype (q, k, v) */
static int linears(void *h, const moed_linear *const *w, int n, const float *x, int B, float *const *y) {
    int together = 1;
    for (int i = 1; i < n; i++) together &= same_input(w[0], w[i]);
    for (int i0 = 0; i0 < n; i0 += together ? n : 1) {
        const int count = together ? n : 1;
        int rc;
        if (w[i0]->dtype == MOED_BF16) {
            const uint16_t *W[3];
            int64_t N[3];
            for (int i = 0; i < count; i++) { W[i] = (const uint16_t *)w[i0 + i]->m.w; N[i] = w[i0 + i]->m.N; }
            rc = moed_cpu_dense_bf16_many(h, count, W, N, w[i0]->m.K, x, B, y + i0);
        } else if (w[i0]->dtype == MOED_ROWS_GGML) {  /* types may differ: x is quantised once for all */
            moed_ggml_matrix G[3];
            const moed_ggml_matrix *GP[3];
            for (int i = 0; i < count; i++) {
                const moed_linear *l = w[i0 + i];
                const int64_t blocks = l->m.K / moed_ggml_block_weights(l->ggml_type);
                G[i] = (moed_ggml_matrix){(const uint8_t *)l->m.w, l->ggml_type, l->m.N, l->m.K,
                                          blocks * moed_ggml_block_bytes(l->ggml_type)};
                GP[i] = &G[i];
            }
            rc = moed_cpu_ggml_rows(h, count, GP, x, B, w[i0]->m.K, y + i0);
            for (int i = 0; !rc && i < count; i++) {
                const float *f = (const float *)w[i0 + i]->m.s;
                if (f && *f != 1.0f)
                    for (int64_t c = 0; c < (int64_t)B * w[i0 + i]->m.N; c++) y[i0 + i][c] *= *f;
            }
        } else {
            const moed_matrix *M[3];
            for (int i = 0; i < count; i++) M[i] = &w[i0 + i]->m;
            rc = moed_cpu_rows_many(h, w[i0]->dtype, count, M, x, B, y + i0);
        }
        if (rc) return rc;
    }
    for (int i = 0; i < n; i++)
        if (w[i]->bias)
            for (int b = 0; b < B; b++)
                for (int64_t c = 0; c < w[i]->m.N; c++) y[i][(int64_t)b * w[i]->m.N + c] += w[i]->bias[c];
    return 0;
}

/* out = down(silu(gate(x)) * up(x)) (* sigmoid(scale(x)) per row), as moed.layers.dense_mlp and
 * moed.layers.moe compute a dense MLP and a gated shared expert at decode */
static int dense_mlp(void *h, const moed_chain_layer *L, const float *x, int B, float *g, float *u, float *hm,
                     float *out, float *z) {
    const moed_linear *gu[2] = {&L->mlp_gate, &L->mlp_up};
    float *gu_out[2] = {g, u};
    int rc = linears(h, gu, 2, x, B, gu_out);
    if (rc) return rc;
    if ((rc = moed_swiglu(g, u, (int64_t)B * L->mlp_gate.m.N, hm))) return rc;
    const moed_linear *dw[1] = {&L->mlp_down};
    float *d_out[1] = {out};
    if ((rc = linears(h, dw, 1, hm, B, d_out))) return rc;
    if (L->mlp_scale.m.w) {
        const moed_linear *sw[1] = {&L->mlp_scale};
        float *s_out[1] = {z};
        if ((rc = linears(h, sw, 1, x, B, s_out))) return rc;
        rc = moed_sigmoid_scale(z, B, L->mlp_down.m.N, out);
    }
    return rc;
}

static int check_linear(const moed_linear *w, int64_t K) {
    if (!w->m.w || w->m.K != K || w->m.N < 1) return -1;
    if (w->dtype == MOED_ROWS_GGML) {
        const int bw = moed_ggml_block_weights(w->ggml_type);
        return bw && K % bw == 0 ? 0 : -1;
    }
    if (w->dtype == MOED_ROWS_FP8) return K % MOED_FP8_BLOCK == 0 && w->m.s ? 0 : -1;
    if (w->dtype != MOED_BF16 && w->dtype != MOED_Q8 && w->dtype != MOED_INT4) return -1;
    return 0;
}

static int check_layer(const moed_chain_layer *L, int64_t D) {
    const moed_attn_decode_args *a = &L->attn;
    if (!L->in_norm || !L->post_norm) return -1;
    const int moe = L->bank || L->ggml;
    if (L->bank && L->ggml) return -1;
    if (moe && (!L->router_w || L->E < 1 || L->top_k < 1 || L->top_k > L->E)) return -1;
    if (!moe && !L->mlp_down.m.w) return -1;  /* a layer needs experts or a dense MLP */
    if (L->ggml && (L->ggml->E != L->E || L->ggml->gate.K != D || L->flat_base != 0)) return -1;
    if (L->mlp_down.m.w) {
        const int64_t I = L->mlp_gate.m.N;
        if (check_linear(&L->mlp_gate, D) || check_linear(&L->mlp_up, D) || L->mlp_up.m.N != I ||
            check_linear(&L->mlp_down, I) || L->mlp_down.m.N != D)
            return -1;
        if (L->mlp_scale.m.w && (check_linear(&L->mlp_scale, D) || L->mlp_scale.m.N != 1)) return -1;
    }
    if (check_linear(&L->q, D) || check_linear(&L->k, D) || check_linear(&L->v, D) ||
        check_linear(&L->o, (int64_t)a->H * a->Dv) || L->o.m.N != D)
        return -1;
    if (L->q.m.N != (int64_t)a->H * a->Dh || L->k.m.N != (int64_t)a->Hk * a->Dh || L->v.m.N != (int64_t)a->Hk * a->Dv)
        return -1;
    if (L->bank && (L->bank->D != D || L->flat_base < 0 || L->flat_base + L->E > L->bank->num_slots)) return -1;
    return 0;
}

/* Runs every layer on x [B][D] in place (the hidden state after the embedding in, the input of the
 * final norm out), then, when head is not NULL, the final norm and the lm_head into head->logits
 * (x stays the un-normed hidden state). ids_out [n][B][top_k] gets each layer's routed expert ids (within the layer),
 * experts_out [n] how many distinct experts each layer ran (a dense layer: ids -1, 0 experts); timings, when not NULL, accumulates
 * seconds per part (projections, attention, router, experts, norms and adds, final norm + lm_head). work: floats of
 * moed_chain_work_floats. Returns 0, -1 bad arguments, -2 out of memory, or -3 - l when layer l's
 * description is inconsistent. */
int moed_cpu_decode_layers(void *h, const moed_chain_layer *layers, int n, const moed_chain_step *s, float *x,
                           const moed_chain_head *head, float *work, int64_t work_floats, int32_t *ids_out,
                           int32_t *experts_out, double *timings) {
    if (!h || !layers || n < 1 || !s || !x || !work || !ids_out || !experts_out || s->B < 1 || s->D < 1) return -1;
    if (head && (!head->norm || !head->logits || check_linear(&head->lm_head, s->D))) return -1;
    for (int l = 0; l < n; l++)
        if (check_layer(&layers[l], s->D)) return -3 - l;
    if (work_floats < moed_chain_work_floats(layers, n, s->B, s->D)) return -1;
    const int B = s->B;
    const int64_t D = s->D;
    int64_t qn = 0, kn = 0, vn = 0, aon = 0, an = 0, en = 0, mn = 0;
    for (int l = 0; l < n; l++) {
        qn = max64(qn, layers[l].q.m.N); kn = max64(kn, layers[l].k.m.N); vn = max64(vn, layers[l].v.m.N);
        aon = max64(aon, (int64_t)layers[l].attn.H * layers[l].attn.Dv); an = max64(an, layers[l].top_k);
        en = max64(en, layers[l].E);
        if (layers[l].mlp_down.m.w) mn = max64(mn, layers[l].mlp_gate.m.N);
    }
    float *cur = work;
#define TAKE(ptr, type, count) do { cur = (float *)(((uintptr_t)cur + 63) & ~(uintptr_t)63); \
    (ptr) = (type *)cur; cur += (count); } while (0)
    float *q, *k, *v, *ao, *o, *hb, *y, *logits, *wts, *mg, *mu, *mh, *mo, *mz;
    int64_t *ids;
    int32_t *flat;
    TAKE(q, float, B * qn); TAKE(k, float, B * kn); TAKE(v, float, B * vn); TAKE(ao, float, B * aon);
    TAKE(o, float, B * D); TAKE(hb, float, B * D); TAKE(y, float, B * D); TAKE(logits, float, B * en);
    TAKE(mg, float, B * mn); TAKE(mu, float, B * mn); TAKE(mh, float, B * mn); TAKE(mo, float, B * D);
    TAKE(mz, float, B);
    TAKE(ids, int64_t, 2 * B * an); TAKE(wts, float, B * an); TAKE(flat, int32_t, B * an);
#undef TAKE
    double t0 = timings ? now_s() : 0.0, t1;
#define LAP(part) do { if (timings) { t1 = now_s(); timings[part] += t1 - t0; t0 = t1; } } while (0)
    int rc;
    for (int l = 0; l < n; l++) {
        const moed_chain_layer *L = &layers[l];
        const int A = L->top_k;
        if ((rc = moed_add_rms_norm(x, NULL, L->in_norm, L->in_norm_bf16, B, D, s->eps, NULL, hb))) return rc;
        LAP(T_NORMS);
        const moed_linear *qkv[3] = {&L->q, &L->k, &L->v};
        float *qkv_out[3] = {q, k, v};
        if ((rc = linears(h, qkv, 3, hb, B, qkv_out))) return rc;
        LAP(T_PROJ);
        moed_attn_decode_args a = L->attn;
        a.B = B; a.q = q; a.k = k; a.v = v; a.cos = s->cos; a.sin = s->sin;
        a.block_table = s->block_table; a.max_blocks = s->max_blocks; a.start = s->start; a.pos = s->pos; a.length = s->length; a.num_keys = s->num_keys;
        a.out = ao;
        if ((rc = moed_cpu_attn_decode(h, &a))) return rc;
        LAP(T_ATTN);
        const moed_linear *ow[1] = {&L->o};
        float *o_out[1] = {o};
        if ((rc = linears(h, ow, 1, ao, B, o_out))) return rc;
        LAP(T_PROJ);
        if ((rc = moed_add_rms_norm(x, o, L->post_norm, L->post_norm_bf16, B, D, s->eps, x, hb))) return rc;
        LAP(T_NORMS);
        if (!L->bank && !L->ggml) { /* a dense layer: x += down(silu(gate(h)) * up(h)); no experts */
            for (int i = 0; i < B * A; i++) ids_out[(int64_t)l * B * A + i] = -1;
            experts_out[l] = 0;
            if ((rc = dense_mlp(h, L, hb, B, mg, mu, mh, mo, mz))) return rc;
            LAP(T_EXPERTS);
            for (int64_t i = 0; i < (int64_t)B * D; i++) x[i] = x[i] + mo[i];
            LAP(T_NORMS);
            continue;
        }
        if (L->router_bf16) { /* as moed.layers.moe.route: the dense bf16 GEMV's logits (+ bias), then the choice */
            const uint16_t *W = (const uint16_t *)L->router_w;
            if ((rc = moed_cpu_dense_bf16_many(h, 1, &W, &L->E, D, hb, B, &logits))) return rc;
            if (L->router_b)
                for (int b = 0; b < B; b++)
                    for (int64_t e = 0; e < L->E; e++) logits[b * L->E + e] += L->router_b[e];
            rc = moed_route_select(logits, B, L->E, L->router_kind, A, L->renormalise, ids, wts);
        } else {
            rc = moed_cpu_route(h, hb, B, D, (const float *)L->router_w, L->router_b, L->E, L->router_kind, A,
                                L->renormalise, ids, wts);
        }
        if (rc) return rc;
        int32_t distinct = 0;
        for (int i = 0; i < B * A; i++) {
            flat[i] = (int32_t)ids[i] + L->flat_base;
            ids_out[(int64_t)l * B * A + i] = (int32_t)ids[i];
            int seen = 0;
            for (int j = 0; j < i; j++) seen |= flat[j] == flat[i];
            distinct += !seen;
        }
        experts_out[l] = distinct;
        LAP(T_ROUTER);
        rc = L->ggml ? moed_cpu_ggml_moe(h, L->ggml, hb, B, A, flat, wts, NULL, y)
                     : moed_cpu_moe(h, L->bank, hb, B, A, flat, wts, NULL, y);
        if (rc) return rc;
        if (L->mlp_down.m.w) { /* the shared expert, added to the routed ones' sum */
            if ((rc = dense_mlp(h, L, hb, B, mg, mu, mh, mo, mz))) return rc;
            for (int64_t i = 0; i < (int64_t)B * D; i++) y[i] = y[i] + mo[i];
        }
        LAP(T_EXPERTS);
        for (int64_t i = 0; i < (int64_t)B * D; i++) x[i] = x[i] + y[i];
        LAP(T_NORMS);
    }
    if (head) {
        if ((rc = moed_add_rms_norm(x, NULL, head->norm, head->norm_bf16, B, D, s->eps, NULL, hb))) return rc;
        const moed_linear *lw[1] = {&head->lm_head};
        float *l_out[1] = {head->logits};
        if ((rc = linears(h, lw, 1, hb, B, l_out))) return rc;
        LAP(T_HEAD);
    }
#undef LAP
    return 0;
}
