/* The decode attention task, written once with GCC vector extensions of VW floats and included by
 * attn_decode.c under each ISA's target pragma (ATTN_TASK names the function, ATTN_HSUM sums the
 * lanes of a vector). One task = one row
 * b and one key/value head g: normalise and rotate k, store k and v in the cache, then for each of
 * the H/Hk query heads of g: normalise and rotate q, scores over the visible keys, softmax (with
 * the sink), the weighted sum of the values. Each key and value row is read once for all the
 * query heads of its group. */
typedef float ATTN_VEC __attribute__((vector_size(VW * 4)));

static inline __attribute__((always_inline)) ATTN_VEC ATTN_LOAD(const float *p) {
    ATTN_VEC v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* VW bf16 values (the high halves of float32s) widened to floats */
typedef uint16_t ATTN_HVEC __attribute__((vector_size(VW * 2)));
typedef uint32_t ATTN_UVEC __attribute__((vector_size(VW * 4)));
static inline __attribute__((always_inline)) ATTN_VEC ATTN_LOADH(const uint16_t *p) {
    ATTN_HVEC h;
    memcpy(&h, p, sizeof h);
    const ATTN_UVEC u = __builtin_convertvector(h, ATTN_UVEC) << 16;
    ATTN_VEC v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* VW int8 values (a q8_0 pool's) widened to floats */
typedef int8_t ATTN_QVEC __attribute__((vector_size(VW)));
static inline __attribute__((always_inline)) ATTN_VEC ATTN_LOADQ(const int8_t *p) {
    ATTN_QVEC q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, ATTN_VEC);
}

/* x[0..n) *= rsqrt(mean(x^2) + eps) * w, then rotate the first R dims (cos/sin of R/2) */
static inline __attribute__((always_inline)) void ATTN_PREP(float *x, const float *src, int n, const float *w,
                                                            float eps, int R, int inter, const float *cs,
                                                            const float *sn, float *tmp) {
    memcpy(x, src, sizeof(float) * (size_t)n);
    if (w) {
        float ss = 0.0f;
        for (int d = 0; d < n; d++) ss += x[d] * x[d];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int d = 0; d < n; d++) x[d] = w[d] * (x[d] * r);
    }
    if (R > 0) {
        const int h = R / 2;
        for (int i = 0; i < h; i++) {
            const float x1 = inter ? x[2 * i] : x[i], x2 = inter ? x[2 * i + 1] : x[h + i];
            tmp[i] = x1 * cs[i] - x2 * sn[i];
            tmp[h + i] = x2 * cs[i] + x1 * sn[i];
        }
        memcpy(x, tmp, sizeof(float) * (size_t)R);
    }
}

void ATTN_TASK(const moed_attn_decode_args *a, int64_t b, int64_t g, float *work) {
    const int G = a->H / a->Hk, Dh = a->Dh, Dv = a->Dv, R = a->rot_dim;
    float *out = a->out + b * (int64_t)a->H * Dv + g * (int64_t)G * Dv;
    if (!a->length[b]) {
        memset(out, 0, sizeof(float) * (size_t)G * (size_t)Dv);
        return;
    }
    const int64_t L = a->num_keys;
    float *qs = work, *kx = qs + (int64_t)G * Dh, *tmp = kx + Dh, *acc = tmp + Dh, *sc = acc + (int64_t)G * Dv;
    const float *cs = a->cos + b * (int64_t)(R / 2), *sn = a->sin + b * (int64_t)(R / 2);
    const int64_t kstride = (int64_t)a->Hk * Dh, vstride = (int64_t)a->Hk * Dv;
    const int32_t *tab = a->block_table + b * (int64_t)a->max_blocks;
    const int sh = __builtin_ctzll((unsigned long long)a->block_size);
    const int64_t lo = a->block_size - 1;
#define ATTN_TOKEN(j) (((int64_t)tab[(j) >> sh] << sh) | ((j) & lo)) /* pool row of the row's token j */
    /* the new key and value into the cache */
    ATTN_PREP(kx, a->k + b * kstride + g * (int64_t)Dh, Dh, a->k_norm, a->eps, R, a->interleaved, cs, sn, tmp);
    const int64_t at = ATTN_TOKEN(a->start[b]);
    if (a->kv_type == MOED_KV_Q8_0) {
        attn_store_q8((int8_t *)a->k_cache, a->k_scale, at * kstride + g * (int64_t)Dh, kx, Dh);
        attn_store_q8((int8_t *)a->v_cache, a->v_scale, at * vstride + g * (int64_t)Dv,
                      a->v + b * vstride + g * (int64_t)Dv, Dv);
    } else {
        const int bf16 = a->kv_type == MOED_KV_BF16;
        attn_store_row(a->k_cache, bf16, at * kstride + g * (int64_t)Dh, kx, Dh);
        attn_store_row(a->v_cache, bf16, at * vstride + g * (int64_t)Dv, a->v + b * vstride + g * (int64_t)Dv, Dv);
    }
    for (int i = 0; i < G; i++)
        ATTN_PREP(qs + (int64_t)i * Dh, a->q + b * (int64_t)a->H * Dh + (g * (int64_t)G + i) * Dh, Dh, a->q_norm,
                  a->eps, R, a->interleaved, cs, sn, tmp);
    /* visible keys [j0, j1) */
    const int64_t p = a->pos[b];
    int64_t j0 = 0, j1 = p + 1 < L ? p + 1 : L;
    if (a->window > 0 && p - a->window + 1 > 0) j0 = p - a->window + 1;
    const int64_t n = j1 > j0 ? j1 - j0 : 0;
    /* scores [G][n]: four query heads at a time share each load of k_j (four independent sums); a bf16
     * pool's rows are widened as they are loaded (T: the pool's element, LD: VW of them as floats, SC: one;
     * a q8_0 pool's row is widened once per key into kw, scaled, and read from there by every head) */
    float kw[32 * ATTN_MAX_Q8_BLOCKS];
#define ATTN_SCORES(T, LD, SC)                                                                           \
    for (int64_t j = 0; j < n; j++) {                                                                  \
        const int64_t kat = ATTN_TOKEN(j0 + j) * kstride + g * (int64_t)Dh;                             \
        const T *kj = (const T *)a->k_cache + kat;                                                      \
        (void)kj; /* q8_0 reads kw */                                                                    \
        if (a->kv_type == MOED_KV_Q8_0)                                                                  \
            ATTN_WIDEN_Q8((const int8_t *)a->k_cache + kat, a->k_scale + kat / 32, Dh);                  \
        int i = 0;                                                                                       \
        for (; i + 4 <= G; i += 4) {                                                                     \
            const float *q0 = qs + (int64_t)i * Dh;                                                      \
            ATTN_VEC s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                             \
            int d = 0;                                                                                   \
            for (; d + VW <= Dh; d += VW) {                                                              \
                const ATTN_VEC kv = LD(kj + d);                                                          \
                s0 += ATTN_LOAD(q0 + d) * kv;                                                            \
                s1 += ATTN_LOAD(q0 + Dh + d) * kv;                                                       \
                s2 += ATTN_LOAD(q0 + 2 * Dh + d) * kv;                                                   \
                s3 += ATTN_LOAD(q0 + 3 * Dh + d) * kv;                                                   \
            }                                                                                            \
            float t[4] = {ATTN_HSUM(s0), ATTN_HSUM(s1), ATTN_HSUM(s2), ATTN_HSUM(s3)};                   \
            for (; d < Dh; d++)                                                                          \
                for (int u = 0; u < 4; u++) t[u] += q0[u * Dh + d] * SC(kj[d]);                          \
            for (int u = 0; u < 4; u++) sc[(int64_t)(i + u) * n + j] = t[u] * a->scale;                  \
        }                                                                                                \
        for (; i < G; i++) {                                                                             \
            const float *qi = qs + (int64_t)i * Dh;                                                      \
            ATTN_VEC s0 = {0};                                                                           \
            int d = 0;                                                                                   \
            for (; d + VW <= Dh; d += VW) s0 += ATTN_LOAD(qi + d) * LD(kj + d);                          \
            float t = ATTN_HSUM(s0);                                                                     \
            for (; d < Dh; d++) t += qi[d] * SC(kj[d]);                                                  \
            sc[(int64_t)i * n + j] = t * a->scale;                                                       \
        }                                                                                                \
    }
#define ATTN_WIDEN_Q8(src, sc, dim)                                                                      \
    for (int u = 0; u < (dim) / 32; u++) {                                                               \
        const float s = moed_f16_to_f32((sc)[u]);                                                        \
        for (int e = 0; e < 32; e += VW) {                                                               \
            const ATTN_VEC w = ATTN_LOADQ((src) + 32 * u + e) * s;                                       \
            memcpy(kw + 32 * u + e, &w, sizeof w);                                                       \
        }                                                                                                \
    }
#define ATTN_LOADQK(p) ATTN_LOAD(kw + d)
#define ATTN_Q8K(x) (kw[d])
    if (a->kv_type == MOED_KV_Q8_0) {
        ATTN_SCORES(int8_t, ATTN_LOADQK, ATTN_Q8K)
    } else if (a->kv_type == MOED_KV_BF16) {
        ATTN_SCORES(uint16_t, ATTN_LOADH, attn_h2f)
    } else {
        ATTN_SCORES(float, ATTN_LOAD, ATTN_SAME)
    }
#undef ATTN_SCORES
#undef ATTN_LOADQK
#undef ATTN_Q8K
    /* softmax per query head (the sink joins the normaliser only) */
    for (int i = 0; i < G; i++) {
        float *si = sc + (int64_t)i * n;
        const float sink = a->sinks ? a->sinks[g * G + i] : -INFINITY;
        float m = sink;
        for (int64_t j = 0; j < n; j++) m = si[j] > m ? si[j] : m;
        float z = a->sinks ? expf(sink - m) : 0.0f;
        for (int64_t j = 0; j < n; j++) {
            si[j] = expf(si[j] - m);
            z += si[j];
        }
        const float inv = z > 0.0f ? 1.0f / z : 0.0f;
        for (int64_t j = 0; j < n; j++) si[j] *= inv;
    }
    /* out[i] = sum_j p[i][j] v[j] */
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)Dv);
#define ATTN_VALUES(T, LD, SC)                                                                           \
    for (int64_t j = 0; j < n; j++) {                                                                  \
        const int64_t vat = ATTN_TOKEN(j0 + j) * vstride + g * (int64_t)Dv;                             \
        const T *vj = (const T *)a->v_cache + vat;                                                      \
        (void)vj;                                                                                        \
        if (a->kv_type == MOED_KV_Q8_0)                                                                  \
            ATTN_WIDEN_Q8((const int8_t *)a->v_cache + vat, a->v_scale + vat / 32, Dv);                  \
        for (int i = 0; i < G; i++) {                                                                    \
            float *oi = acc + (int64_t)i * Dv;                                                           \
            const float w = sc[(int64_t)i * n + j];                                                      \
            int d = 0;                                                                                   \
            for (; d + VW <= Dv; d += VW) {                                                              \
                ATTN_VEC o = ATTN_LOAD(oi + d) + w * LD(vj + d);                                         \
                memcpy(oi + d, &o, sizeof o);                                                            \
            }                                                                                            \
            for (; d < Dv; d++) oi[d] += w * SC(vj[d]);                                                  \
        }                                                                                                \
    }
#define ATTN_LOADQV(p) ATTN_LOAD(kw + d)
#define ATTN_Q8V(x) (kw[d])
    if (a->kv_type == MOED_KV_Q8_0) {
        ATTN_VALUES(int8_t, ATTN_LOADQV, ATTN_Q8V)
    } else if (a->kv_type == MOED_KV_BF16) {
        ATTN_VALUES(uint16_t, ATTN_LOADH, attn_h2f)
    } else {
        ATTN_VALUES(float, ATTN_LOAD, ATTN_SAME)
    }
#undef ATTN_VALUES
#undef ATTN_LOADQV
#undef ATTN_Q8V
#undef ATTN_WIDEN_Q8
    memcpy(out, acc, sizeof(float) * (size_t)G * (size_t)Dv);
}

#undef ATTN_TOKEN
#undef VW
#undef ATTN_HSUM
#undef ATTN_VEC
#undef ATTN_LOAD
#undef ATTN_LOADH
#undef ATTN_HVEC
#undef ATTN_UVEC
#undef ATTN_QVEC
#undef ATTN_LOADQ
#undef ATTN_PREP
#undef ATTN_TASK
