/* The AVX-512 mxfp4 strip (one group of a column block: MXZ_GROUP; a strip: MXZ_STRIP), written
 * once and included by strip_mxfp4.c under two target pragmas: MXZ_VNNI 0 (AVX-512 BW: maddubs
 * into int16 pair sums, flushed to int32 by madd with ones every 4 quads) and MXZ_VNNI 1 (AVX-512
 * VNNI: vpdpbusd adds the 4 byte products (v2 + 12) * xq of a lane straight into int32). Both give
 * the same exact int32 group sums, so the same bits. */
/* one group x one 64-byte-column block x tb tokens (see i4z_group in strip_int4.c) */
static inline __attribute__((always_inline)) void MXZ_GROUP(const uint8_t *wp, int64_t N2, int full, __mmask64 bm,
                                                            const int8_t *xq, int64_t K, int tb, const float *xs,
                                                            int64_t G, const int32_t *corr, const float *sf,
                                                            float *facc, int64_t fst) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#if !MXZ_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m512i acc[2][8];
#if !MXZ_VNNI
    __m512i a32[2][8];
#endif
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
        for (int t = 0; t < tb; t++) X[t] = _mm512_set1_epi32(mx_load_i32(xq + (int64_t)t * K + 4 * q));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i wl = _mm512_shuffle_epi8(tab, _mm512_and_si512(Q[i], m4));
            const __m512i wh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(Q[i], 4), m4));
#pragma GCC unroll 2
            for (int t = 0; t < tb; t++) {
#if MXZ_VNNI
                acc[t][i] = _mm512_dpbusd_epi32(acc[t][i], wl, X[t]);
                acc[t][4 + i] = _mm512_dpbusd_epi32(acc[t][4 + i], wh, X[t]);
#else
                acc[t][i] = _mm512_add_epi16(acc[t][i], _mm512_maddubs_epi16(wl, X[t]));
                acc[t][4 + i] = _mm512_add_epi16(acc[t][4 + i], _mm512_maddubs_epi16(wh, X[t]));
#endif
            }
        }
#if !MXZ_VNNI
        if (q == 3) {
#pragma GCC unroll 2
            for (int t = 0; t < tb; t++)
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    a32[t][i] = _mm512_madd_epi16(acc[t][i], ones);
                    acc[t][i] = _mm512_setzero_si512();
                }
        }
#endif
    }
#pragma GCC unroll 2
    for (int t = 0; t < tb; t++) {
        const __m512 vs = _mm512_set1_ps(xs[(int64_t)t * G]);
        const __m512i vc = _mm512_set1_epi32(corr[t]);
        float *f = facc + (int64_t)t * fst;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
#if MXZ_VNNI
            const __m512i s32 = acc[t][i];
#else
            const __m512i s32 = _mm512_add_epi32(a32[t][i], _mm512_madd_epi16(acc[t][i], ones));
#endif
            const __m512 is = _mm512_cvtepi32_ps(_mm512_sub_epi32(s32, vc));
            __m512 F = _mm512_load_ps(f + 16 * i);
            F = _mm512_fmadd_ps(is, _mm512_mul_ps(_mm512_load_ps(sf + 16 * i), vs), F);
            _mm512_store_ps(f + 16 * i, F);
        }
    }
}

static void MXZ_STRIP(const moed_matrix *w, const moed_act *a, int64_t j0, int64_t j1, float *lo, float *hi,
                      int64_t ld) {
    const uint8_t *W = (const uint8_t *)w->w, *E = (const uint8_t *)w->s;
    const int64_t N = w->N, N2 = w->N / 2, K = a->K, G = a->K / MOED_GROUP;
    const int T = a->T;
    enum { VW = 64, BF = 2 * VW };
    _Alignas(64) float facc[MX_FACC];
    _Alignas(64) float sf[BF];
    int32_t corr[MX_TCHUNK];
    int64_t nbmax = MX_FACC / BF / T;
    if (nbmax < 1) nbmax = 1;
    for (int64_t sb = j0; sb < j1; sb += nbmax * VW) {
        int64_t nb = (j1 - sb + VW - 1) / VW;
        if (nb > nbmax) nb = nbmax;
        const int64_t fst = nb * BF;
        memset(facc, 0, sizeof(float) * (size_t)(fst * T));
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = W + g * MOED_GROUP * N2;
            mx_corr(a, g, corr);
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW, cw = (j1 - c0 < VW) ? j1 - c0 : VW;
                const int full = cw == VW;
                const __mmask64 bm = full ? ~(__mmask64)0 : (((__mmask64)1 << cw) - 1);
                mxz_scales(E + g * N + c0, N2, full, bm, sf);
                const uint8_t *wp = wg + c0;
                if (g + 1 < G) mx_prefetch_next(wp, N2);
                int t = 0;
                for (; t + 2 <= T; t += 2) {
                    const int8_t *xq = a->xq + (int64_t)t * K + g * MOED_GROUP;
                    const float *xs = a->xs + (int64_t)t * G + g;
                    float *f = facc + (int64_t)t * fst + b * BF;
                    if (full)
                        MXZ_GROUP(wp, N2, 1, bm, xq, K, 2, xs, G, corr + t, sf, f, fst);
                    else
                        MXZ_GROUP(wp, N2, 0, bm, xq, K, 2, xs, G, corr + t, sf, f, fst);
                }
                if (t < T) {
                    const int8_t *xq = a->xq + (int64_t)t * K + g * MOED_GROUP;
                    const float *xs = a->xs + (int64_t)t * G + g;
                    float *f = facc + (int64_t)t * fst + b * BF;
                    if (full)
                        MXZ_GROUP(wp, N2, 1, bm, xq, K, 1, xs, G, corr + t, sf, f, fst);
                    else
                        MXZ_GROUP(wp, N2, 0, bm, xq, K, 1, xs, G, corr + t, sf, f, fst);
                }
            }
        }
        for (int t = 0; t < T; t++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t c0 = sb + b * VW, cw = (j1 - c0 < VW) ? j1 - c0 : VW;
                mx_store_block(facc + (int64_t)t * fst + b * BF, VW, cw, lo + (int64_t)t * ld + (c0 - j0),
                               hi + (int64_t)t * ld + (c0 - j0));
            }
    }
}

