/* The decode attention task, written once with GCC vector extensions of VW floats and included by
 * attn_decode.c under each ISA's target pragma (ATTN_TASK names the function, ATTN_HSUM sums the
 * lanes of a vector). One task = one row
 * b and one key/value head g: normalise and rotate k, store k and v in the cache, then for each of
 * the H/Hk query heads of g: normalise and rotate q, scores over the visible keys, softmax (with
 * the sink), the weighted sum of the values. Each key and value row is read once for all the
 * query heads of its group. */
typedef float ATTN_VEC __attribute__((vector_size(VW * 4)));
typedef int32_t ATTN_IVEC __attribute__((vector_size(VW * 4)));

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

/* lane-wise max, a broadcast, and exp (Cephes' expf: range reduction by ln 2, degree-6 polynomial; within
 * 2 ulp of expf over the softmax's range, inputs <= 0 here) */
static inline __attribute__((always_inline)) ATTN_VEC ATTN_VMAX(ATTN_VEC x, ATTN_VEC y) {
    const ATTN_IVEC gt = x > y;
    return (ATTN_VEC)((gt & (ATTN_IVEC)x) | (~gt & (ATTN_IVEC)y));
}
static inline __attribute__((always_inline)) ATTN_VEC ATTN_LOAD1(float v) {
    ATTN_VEC r;
    for (int u = 0; u < VW; u++) r[u] = v;
    return r;
}
static inline __attribute__((always_inline)) ATTN_VEC ATTN_EXPV(ATTN_VEC x) {
    x = ATTN_VMAX(x, ATTN_LOAD1(-87.33654f)); /* below: 0 (or the smallest normal), as expf underflows */
    ATTN_VEC fx = x * 1.44269504088896341f + 0.5f;
    ATTN_VEC tf = __builtin_convertvector(__builtin_convertvector(fx, ATTN_IVEC), ATTN_VEC); /* toward 0 */
    tf += __builtin_convertvector(tf > fx, ATTN_VEC); /* floor: -1 where truncation went up */
    x = x - tf * 0.693359375f - tf * -2.12194440e-4f;
    const ATTN_VEC z = x * x;
    ATTN_VEC y = ATTN_LOAD1(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    const ATTN_IVEC pow2n = (__builtin_convertvector(tf, ATTN_IVEC) + 127) << 23;
    return y * (ATTN_VEC)pow2n;
}

/* VW int8 values (a q8_0 pool's) widened to floats: the ISA's sign-extending load where attn_decode.c names
 * one (GCC turns the generic conversion into one insert per lane) */
typedef int8_t ATTN_QVEC __attribute__((vector_size(VW)));
static inline __attribute__((always_inline)) ATTN_VEC ATTN_LOADQ(const int8_t *p) {
#ifdef ATTN_LOADQ_ISA
    return (ATTN_VEC)ATTN_LOADQ_ISA(p);
#else
    ATTN_QVEC q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, ATTN_VEC);
#endif
}

/* ``dim`` values of a bf16 or q8_0 pool from element ``at`` as floats into ``dst`` (q8_0: scaled by the
 * float16 scale of each 32, at ``at / 32``); returns dst */
static inline __attribute__((always_inline)) const float *ATTN_WIDEN(int kind, const void *pool,
                                                                    const uint16_t *scales, int64_t at, int dim,
                                                                    float *dst) {
    int d = 0;
    if (kind == MOED_KV_Q8_0) {
        const int8_t *src = (const int8_t *)pool + at;
        for (int u = 0; u < dim / 32; u++) {
            const float s = attn_f16(scales[at / 32 + u]);
            for (int e = 0; e < 32; e += VW) {
                const ATTN_VEC w = ATTN_LOADQ(src + 32 * u + e) * s;
                memcpy(dst + 32 * u + e, &w, sizeof w);
            }
        }
        return dst;
    }
    const uint16_t *src = (const uint16_t *)pool + at;
    for (; d + VW <= dim; d += VW) {
        const ATTN_VEC w = ATTN_LOADH(src + d);
        memcpy(dst + d, &w, sizeof w);
    }
    for (; d < dim; d++) dst[d] = attn_h2f(src[d]);
    return dst;
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
    float *qs = work, *kx = qs + (int64_t)G * Dh, *tmp = kx + Dh, *acc = tmp + Dh, *vt = acc + (int64_t)G * Dv;
    float *sc = vt + (int64_t)ATTN_KEY_TILE * Dv;
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
    if (a->chunk > 0 && p - p % a->chunk > j0) j0 = p - p % a->chunk;
    const int64_t n = j1 > j0 ? j1 - j0 : 0;
    /* scores [G][n]: each key row is widened once into kw (bf16; q8_0 with its scales; float32 rows are read
     * where they are), then four query heads at a time take their dot products with it */
    float kw[ATTN_MAX_ROW];
    for (int64_t j = 0; j < n; j++) {
        const int64_t kat = ATTN_TOKEN(j0 + j) * kstride + g * (int64_t)Dh;
        const float *kr = a->kv_type == MOED_KV_F32 ? (const float *)a->k_cache + kat
                                                     : ATTN_WIDEN(a->kv_type, a->k_cache, a->k_scale, kat, Dh, kw);
        int i = 0;
        for (; i + 4 <= G; i += 4) {
            const float *q0 = qs + (int64_t)i * Dh;
            ATTN_VEC s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            int d = 0;
            for (; d + VW <= Dh; d += VW) {
                const ATTN_VEC kv = ATTN_LOAD(kr + d);
                s0 += ATTN_LOAD(q0 + d) * kv;
                s1 += ATTN_LOAD(q0 + Dh + d) * kv;
                s2 += ATTN_LOAD(q0 + 2 * Dh + d) * kv;
                s3 += ATTN_LOAD(q0 + 3 * Dh + d) * kv;
            }
            float t[4] = {ATTN_HSUM(s0), ATTN_HSUM(s1), ATTN_HSUM(s2), ATTN_HSUM(s3)};
            for (; d < Dh; d++)
                for (int u = 0; u < 4; u++) t[u] += q0[u * Dh + d] * kr[d];
            for (int u = 0; u < 4; u++) sc[(int64_t)(i + u) * n + j] = t[u] * a->scale;
        }
        for (; i < G; i++) {
            const float *qi = qs + (int64_t)i * Dh;
            ATTN_VEC s0 = {0};
            int d = 0;
            for (; d + VW <= Dh; d += VW) s0 += ATTN_LOAD(qi + d) * ATTN_LOAD(kr + d);
            float t = ATTN_HSUM(s0);
            for (; d < Dh; d++) t += qi[d] * kr[d];
            sc[(int64_t)i * n + j] = t * a->scale;
        }
    }
    /* softmax per query head (the sink joins the normaliser only), VW scores at a time */
    for (int i = 0; i < G; i++) {
        float *si = sc + (int64_t)i * n;
        const float sink = a->sinks ? a->sinks[g * G + i] : -INFINITY;
        float m = sink;
        int64_t j = 0;
        if (n >= VW) {
            ATTN_VEC mv = ATTN_LOAD(si);
            for (j = VW; j + VW <= n; j += VW) mv = ATTN_VMAX(mv, ATTN_LOAD(si + j));
            float lanes[VW];
            memcpy(lanes, &mv, sizeof mv);
            for (int u = 0; u < VW; u++) m = lanes[u] > m ? lanes[u] : m;
        }
        for (; j < n; j++) m = si[j] > m ? si[j] : m;
        float z = a->sinks ? expf(sink - m) : 0.0f;
        ATTN_VEC zv = {0};
        const ATTN_VEC mb = ATTN_LOAD1(m);
        for (j = 0; j + VW <= n; j += VW) {
            const ATTN_VEC e = ATTN_EXPV(ATTN_LOAD(si + j) - mb);
            memcpy(si + j, &e, sizeof e);
            zv += e;
        }
        z += ATTN_HSUM(zv);
        for (; j < n; j++) {
            si[j] = expf(si[j] - m);
            z += si[j];
        }
        const float inv = z > 0.0f ? 1.0f / z : 0.0f;
        const ATTN_VEC iv = ATTN_LOAD1(inv);
        for (j = 0; j + VW <= n; j += VW) {
            const ATTN_VEC p = ATTN_LOAD(si + j) * iv;
            memcpy(si + j, &p, sizeof p);
        }
        for (; j < n; j++) si[j] *= inv;
    }
    /* out[i] = sum_j p[i][j] v[j]: the value rows of ATTN_KEY_TILE keys are widened into vt once, then every
     * head of the group sums them with its weights, its output vector kept in registers over the tile */
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)Dv);
    for (int64_t t0 = 0; t0 < n; t0 += ATTN_KEY_TILE) {
        const int kt = n - t0 < ATTN_KEY_TILE ? (int)(n - t0) : ATTN_KEY_TILE;
        for (int t = 0; t < kt; t++) {
            const int64_t vat = ATTN_TOKEN(j0 + t0 + t) * vstride + g * (int64_t)Dv;
            float *row = vt + (int64_t)t * Dv;
            if (a->kv_type == MOED_KV_F32) memcpy(row, (const float *)a->v_cache + vat, sizeof(float) * (size_t)Dv);
            else ATTN_WIDEN(a->kv_type, a->v_cache, a->v_scale, vat, Dv, row);
        }
        for (int i = 0; i < G; i++) {
            float *oi = acc + (int64_t)i * Dv;
            const float *wi = sc + (int64_t)i * n + t0;
            int d = 0;
            for (; d + VW <= Dv; d += VW) {
                ATTN_VEC o = ATTN_LOAD(oi + d);
                for (int t = 0; t < kt; t++) o += wi[t] * ATTN_LOAD(vt + (int64_t)t * Dv + d);
                memcpy(oi + d, &o, sizeof o);
            }
            for (; d < Dv; d++)
                for (int t = 0; t < kt; t++) oi[d] += wi[t] * vt[(int64_t)t * Dv + d];
        }
    }
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
#undef ATTN_LOADQ_ISA
#undef ATTN_IVEC
#undef ATTN_VMAX
#undef ATTN_LOAD1
#undef ATTN_EXPV
#undef ATTN_WIDEN
#undef ATTN_PREP
#undef ATTN_TASK
