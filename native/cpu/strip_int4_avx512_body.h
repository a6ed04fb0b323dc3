/* The AVX-512 int4 strip (one group of a column block: I4Z_GROUP; a strip: I4Z_STRIP), written
 * once and included by strip_int4.c under two target pragmas: I4Z_VNNI 0 (AVX-512 BW: maddubs
 * into int16 pair sums, madd with ones into int32) and I4Z_VNNI 1 (AVX-512 VNNI: vpdpbusd adds the
 * 4 byte products of a lane straight into int32; the whole bytes (lo + 16 * hi) and the high
 * nibbles kept in place (16 * hi) are summed, so one AND per vector instead of a shift and two
 * ANDs; lo = whole - 16 * hi and hi = (16 * hi) >> 4 are exact). Both give the same int32 group
 * sums, so the same bits. */
/* one group x one 64-byte-column block x tb tokens. wp: row g*32, column c0; xq: token t0 at the
 * group's first k; xs/xsum: token t0, group g (stride G); facc: token t0's 128 floats of this
 * block (stride fst); sf/mf: the block's permuted scales / mins. */
static inline __attribute__((always_inline)) void I4Z_GROUP(const uint8_t *wp, int64_t N2, int full, __mmask64 bm,
                                                            const int8_t *xq, int64_t K, int tb, const float *xs,
                                                            const float *xsum, int64_t G, const float *sf,
                                                            const float *mf, float *facc, int64_t fst) {
#if I4Z_VNNI
    const __m512i m4h = _mm512_set1_epi8((char)0xF0);
#else
    const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
#endif
    __m512i acc[2][8];
#pragma GCC unroll 2
    for (int t = 0; t < tb; t++)
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[t][i] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int q = 0; q < 8; q++) {
        const uint8_t *r = wp + (int64_t)(4 * q) * N2;
        __m512i Q[4];
        moed_quad_bytes512(r, N2, full, bm, Q);
        __m512i X[2];
#pragma GCC unroll 2
        for (int t = 0; t < tb; t++) X[t] = _mm512_set1_epi32(i4_load_i32(xq + (int64_t)t * K + 4 * q));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
#if I4Z_VNNI
            /* acc[i]: whole bytes (lo + 16 hi), acc[4 + i]: 16 * hi; the lo sum is their difference */
            const __m512i wh = _mm512_and_si512(Q[i], m4h);
#pragma GCC unroll 2
            for (int t = 0; t < tb; t++) {
                acc[t][i] = _mm512_dpbusd_epi32(acc[t][i], Q[i], X[t]);
                acc[t][4 + i] = _mm512_dpbusd_epi32(acc[t][4 + i], wh, X[t]);
            }
#else
            const __m512i wl = _mm512_and_si512(Q[i], m4);
            const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(Q[i], 4), m4);
#pragma GCC unroll 2
            for (int t = 0; t < tb; t++) {
                acc[t][i] = _mm512_add_epi16(acc[t][i], _mm512_maddubs_epi16(wl, X[t]));
                acc[t][4 + i] = _mm512_add_epi16(acc[t][4 + i], _mm512_maddubs_epi16(wh, X[t]));
            }
#endif
        }
    }
#pragma GCC unroll 2
    for (int t = 0; t < tb; t++) {
        const __m512 vs = _mm512_set1_ps(xs[(int64_t)t * G]), vm = _mm512_set1_ps(xsum[(int64_t)t * G]);
        float *f = facc + (int64_t)t * fst;
#if I4Z_VNNI
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            acc[t][i] = _mm512_sub_epi32(acc[t][i], acc[t][4 + i]);
            acc[t][4 + i] = _mm512_srai_epi32(acc[t][4 + i], 4);
        }
#endif
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
#if I4Z_VNNI
            const __m512 is = _mm512_cvtepi32_ps(acc[t][i]);
#else
            const __m512 is = _mm512_cvtepi32_ps(_mm512_madd_epi16(acc[t][i], ones));
#endif
            __m512 F = _mm512_load_ps(f + 16 * i);
            F = _mm512_fmadd_ps(is, _mm512_mul_ps(_mm512_load_ps(sf + 16 * i), vs), F);
            F = _mm512_fmadd_ps(_mm512_load_ps(mf + 16 * i), vm, F);
            _mm512_store_ps(f + 16 * i, F);
        }
    }
}

static void I4Z_STRIP(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                      int64_t ld) {
    const uint8_t *W = (const uint8_t *)w->w;
    const uint16_t *S = (const uint16_t *)w->s, *M = (const uint16_t *)w->m;
    const int64_t N = w->N, N2 = w->N / 2, K = a->K, G = a->K / MOED_GROUP;
    const int T = a->T;
    enum { VW = 64, BF = 2 * VW };
    _Alignas(64) float facc[I4_FACC];
    _Alignas(64) float sfm[2 * BF];
    int64_t nbmax = I4_FACC / BF / T;
    if (nbmax < 1) nbmax = 1;
    for (int64_t sb = j0; sb < j1; sb += nbmax * VW) {
        int64_t nb = (j1 - sb + VW - 1) / VW;
        if (nb > nbmax) nb = nbmax;
        const int64_t fst = nb * BF;
        memset(facc, 0, sizeof(float) * (size_t)(fst * T));
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = W + g * MOED_GROUP * N2;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW, cw = (j1 - c0 < VW) ? j1 - c0 : VW;
                const int full = cw == VW;
                const __mmask64 bm = full ? ~(__mmask64)0 : (((__mmask64)1 << cw) - 1);
                const __mmask32 m0 = (__mmask32)bm, m1 = (__mmask32)(bm >> 32);
                i4z_scales(S + g * N + c0, N2, m0, m1, sfm);
                i4z_scales(M + g * N + c0, N2, m0, m1, sfm + BF);
                const uint8_t *wp = wg + c0;
                if (g + 1 < G) i4_prefetch_next(wp, N2);
                int t = 0;
                for (; t + 2 <= T; t += 2) {
                    const int8_t *xq = a->xq + (int64_t)t * K + g * MOED_GROUP;
                    const float *xs = a->xs + (int64_t)t * G + g, *xm = a->xsum + (int64_t)t * G + g;
                    float *f = facc + (int64_t)t * fst + b * BF;
                    if (full)
                        I4Z_GROUP(wp, N2, 1, bm, xq, K, 2, xs, xm, G, sfm, sfm + BF, f, fst);
                    else
                        I4Z_GROUP(wp, N2, 0, bm, xq, K, 2, xs, xm, G, sfm, sfm + BF, f, fst);
                }
                if (t < T) {
                    const int8_t *xq = a->xq + (int64_t)t * K + g * MOED_GROUP;
                    const float *xs = a->xs + (int64_t)t * G + g, *xm = a->xsum + (int64_t)t * G + g;
                    float *f = facc + (int64_t)t * fst + b * BF;
                    if (full)
                        I4Z_GROUP(wp, N2, 1, bm, xq, K, 1, xs, xm, G, sfm, sfm + BF, f, fst);
                    else
                        I4Z_GROUP(wp, N2, 0, bm, xq, K, 1, xs, xm, G, sfm, sfm + BF, f, fst);
                }
            }
        }
        for (int t = 0; t < T; t++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW, cw = (j1 - c0 < VW) ? j1 - c0 : VW;
                i4_store_block(facc + (int64_t)t * fst + b * BF, VW, cw, lo + (int64_t)t * ld + (c0 - j0),
                               hi + (int64_t)t * ld + (c0 - j0));
            }
    }
}

