/* One weight of a row of GGML blocks, for every type the ggml bank keeps as stored.
 *
 * The reference is moed/kernels/gguf_quants.py (bit for bit gguf.quants) and, for moed's own FP8 rows,
 * moed/kernels/fp8_block_format.py: each function below does the same float32 operations in the same
 * order, so the values are the same bits (tests/devices/test_ggml_decode.py builds this header with gcc
 * and compares every weight of random rows of every type). The same text is compiled by NVRTC into
 * native/ggml_rows.cu's device kernels: plain C types, no includes, no library calls.
 *
 * moed_ggml_weight(type, row, i): weight i of a row whose blocks start at `row`.
 */
#ifndef MOED_GGML_DECODE_H
#define MOED_GGML_DECODE_H

#ifdef __CUDACC__
#define MOED_DECODE __device__ __forceinline__
#else
#define MOED_DECODE static inline
#endif

/* GGML type ids (ggml.h; FP8_B128 / MXFP8 are moed's own, kernels/fp8_block_format.py) */
#define MOED_GT_Q4_0 2
#define MOED_GT_Q4_1 3
#define MOED_GT_Q5_0 6
#define MOED_GT_Q5_1 7
#define MOED_GT_Q8_0 8
#define MOED_GT_Q2_K 10
#define MOED_GT_Q3_K 11
#define MOED_GT_Q4_K 12
#define MOED_GT_Q5_K 13
#define MOED_GT_Q6_K 14
#define MOED_GT_IQ4_NL 20
#define MOED_GT_IQ4_XS 23
#define MOED_GT_MXFP4 39
#define MOED_GT_NVFP4 40
#define MOED_GT_FP8_B128 1001
#define MOED_GT_MXFP8 1002

MOED_DECODE float moed_bits_f32(unsigned int bits) {
    union { unsigned int u; float f; } v;
    v.u = bits;
    return v.f;
}

/* 2^e for e in [-126, 127] */
MOED_DECODE float moed_pow2(int e) { return moed_bits_f32((unsigned int)(e + 127) << 23); }

/* little-endian IEEE half at p -> float (exact) */
MOED_DECODE float moed_f16(const unsigned char* p) {
    const unsigned int h = (unsigned int)p[0] | ((unsigned int)p[1] << 8);
    const unsigned int sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1Fu) return moed_bits_f32(sign | 0x7F800000u | (man << 13)); /* inf, nan */
    if (exp == 0) {                                                           /* zero, subnormal: man * 2^-24 */
        const float v = (float)man * moed_pow2(-24);
        return sign ? -v : v;
    }
    return moed_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* code of weight j (0..31) of a 32-weight block of nibbles: low nibbles are weights 0-15, high 16-31 */
MOED_DECODE int moed_nibble32(const unsigned char* qs, int j) {
    return j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
}

/* twice an E2M1 code's value (ggml's kvalues_mxfp4: 0 1 2 3 4 6 8 12 and the negatives) */
MOED_DECODE int moed_e2m1_doubled(int code) {
    const int exp = (code >> 1) & 3, man = code & 1;
    const int mag = exp == 0 ? man : (man + 2) << (exp - 1);
    return code >= 8 ? -mag : mag;
}

/* e4m3fn byte -> float (torch.float8_e4m3fn's value; 0x7F / 0xFF are NaN) */
MOED_DECODE float moed_e4m3(int code) {
    const int e = (code >> 3) & 0x0F, m = code & 7;
    if ((code & 0x7F) == 0x7F) return moed_bits_f32(0x7FC00000u);
    const float v = e == 0 ? (float)m * moed_pow2(-9) : (float)(m + 8) * moed_pow2(e - 10);
    return (code & 0x80) ? -v : v;
}

MOED_DECODE int moed_iq4_level(int code) {
    const signed char levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return levels[code];
}

/* Q4_K / Q5_K: the 6-bit scale (which = 0) or min (which = 1) of sub-block sb of the 12 scale bytes s */
MOED_DECODE int moed_k_scale(const unsigned char* s, int sb, int which) {
    if (sb < 4) return s[sb + 4 * which] & 63;
    return which == 0 ? ((s[sb + 4] & 0x0F) | ((s[sb - 4] >> 6) << 4)) : ((s[sb + 4] >> 4) | ((s[sb] >> 6) << 4));
}

MOED_DECODE float moed_ggml_weight(int type, const unsigned char* row, int i) {
    switch (type) {
    case MOED_GT_Q4_0: { /* d, qs[16]: (q - 8) * d */
        const unsigned char* b = row + (i / 32) * 18;
        return (float)(moed_nibble32(b + 2, i % 32) - 8) * moed_f16(b);
    }
    case MOED_GT_Q4_1: { /* d, m, qs[16]: q * d + m */
        const unsigned char* b = row + (i / 32) * 20;
        const float w = (float)moed_nibble32(b + 4, i % 32) * moed_f16(b);
        return w + moed_f16(b + 2);
    }
    case MOED_GT_Q5_0: { /* d, qh (bit j: bit 4 of weight j), qs[16]: (q - 16) * d */
        const unsigned char* b = row + (i / 32) * 22;
        const int j = i % 32, q = moed_nibble32(b + 6, j) | (((b[2 + j / 8] >> (j % 8)) & 1) << 4);
        return (float)(q - 16) * moed_f16(b);
    }
    case MOED_GT_Q5_1: { /* d, m, qh, qs[16]: q * d + m */
        const unsigned char* b = row + (i / 32) * 24;
        const int j = i % 32, q = moed_nibble32(b + 8, j) | (((b[4 + j / 8] >> (j % 8)) & 1) << 4);
        const float w = (float)q * moed_f16(b);
        return w + moed_f16(b + 2);
    }
    case MOED_GT_Q8_0: { /* d, qs int8[32] */
        const unsigned char* b = row + (i / 32) * 34;
        return (float)(signed char)b[2 + i % 32] * moed_f16(b);
    }
    case MOED_GT_Q2_K: { /* scales[16] (low nibble sc, high m), qs[64], d, dmin: d*sc*q - dmin*m per 16 */
        const unsigned char* b = row + (i / 256) * 84;
        const int j = i % 256, h = j / 128, s = (j % 128) / 32, l = j % 32, sc = b[j / 16];
        const int q = (b[16 + h * 32 + l] >> (2 * s)) & 3;
        const float dl = moed_f16(b + 80) * (float)(sc & 0x0F), ml = moed_f16(b + 82) * (float)(sc >> 4);
        return dl * (float)q - ml;
    }
    case MOED_GT_Q3_K: { /* hmask[32], qs[64], scales[12] (16 x 6 bits, -32), d: d*sc*(q - 4*(1 - hbit)) */
        const unsigned char* b = row + (i / 256) * 110;
        const int j = i % 256, h = j / 128, s = (j % 128) / 32, l = j % 32, n = j / 16;
        const int sc = ((b[96 + n % 8] >> (4 * (n / 8))) & 0x0F) | (((b[104 + n % 4] >> (2 * (n / 4))) & 3) << 4);
        const int ql = (b[32 + h * 32 + l] >> (2 * s)) & 3, hb = (b[j % 32] >> (j / 32)) & 1;
        const float dl = moed_f16(b + 108) * (float)(sc - 32);
        return dl * (float)(ql - ((hb ^ 1) << 2));
    }
    case MOED_GT_Q4_K:   /* d, dmin, scales[12], qs[128]: d*sc*q - dmin*m per 32 */
    case MOED_GT_Q5_K: { /* as Q4_K with qh[32] before qs: bit sb of qh[l] is bit 4 of weight l of sub-block sb */
        const int q5 = type == MOED_GT_Q5_K;
        const unsigned char* b = row + (i / 256) * (q5 ? 176 : 144);
        const int j = i % 256, sb = j / 32, l = j % 32;
        int q = (b[(q5 ? 48 : 16) + (sb / 2) * 32 + l] >> (4 * (sb % 2))) & 0x0F;
        if (q5) q |= ((b[16 + l] >> sb) & 1) << 4;
        const float ds = moed_f16(b) * (float)moed_k_scale(b + 4, sb, 0);
        const float dm = moed_f16(b + 2) * (float)moed_k_scale(b + 4, sb, 1);
        return (float)q * ds - dm;
    }
    case MOED_GT_Q6_K: { /* ql[128], qh[64], scales int8[16], d: d*sc*(q - 32) per 16 */
        const unsigned char* b = row + (i / 256) * 210;
        const int j = i % 256, h = j / 128, jj = j % 128;
        const int low = jj < 64 ? (b[64 * h + jj] & 0x0F) : (b[64 * h + jj - 64] >> 4);
        const int high = (b[128 + 32 * h + jj % 32] >> (2 * (jj / 32))) & 3;
        const float ds = (float)(signed char)b[192 + j / 16] * moed_f16(b + 208);
        return (float)((low | (high << 4)) - 32) * ds;
    }
    case MOED_GT_IQ4_NL: { /* d, qs[16]: d * level(q) */
        const unsigned char* b = row + (i / 32) * 18;
        return (float)moed_iq4_level(moed_nibble32(b + 2, i % 32)) * moed_f16(b);
    }
    case MOED_GT_IQ4_XS: { /* d, scales_h u16, scales_l[4], qs[128]: d*(ls - 32)*level(q) per 32 */
        const unsigned char* b = row + (i / 256) * 136;
        const int j = i % 256, sb = j / 32, sh = b[2] | (b[3] << 8);
        const int ls = (((b[4 + sb / 2] >> (4 * (sb % 2))) & 0x0F) | (((sh >> (2 * sb)) & 3) << 4)) - 32;
        const float dl = moed_f16(b) * (float)ls;
        return dl * (float)moed_iq4_level(moed_nibble32(b + 8 + sb * 16, j % 32));
    }
    case MOED_GT_MXFP4: { /* e8m0, qs[16]: kvalue(code) * 2^(e - 128) (the doubled table, the halved scale) */
        const unsigned char* b = row + (i / 32) * 17;
        const unsigned int e = b[0];
        const float half = moed_bits_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23);
        return (float)moed_e2m1_doubled(moed_nibble32(b + 1, i % 32)) * half;
    }
    case MOED_GT_NVFP4: { /* ue4m3 d[4], qs[32] (8 bytes per 16 weights): kvalue(code) * d/2 */
        const unsigned char* b = row + (i / 64) * 36;
        const int j = i % 64, s = j / 16, jj = j % 16, x = b[s];
        const int code = jj < 8 ? (b[4 + s * 8 + jj] & 0x0F) : (b[4 + s * 8 + jj - 8] >> 4);
        const int e = (x >> 3) & 0x0F, m = x & 7;
        float d = e == 0 ? (float)m * moed_pow2(-10) : (float)(m + 8) * moed_pow2(e - 11);
        if (x == 0x7F) d = 0.0f;
        return (float)moed_e2m1_doubled(code) * d;
    }
    case MOED_GT_FP8_B128: { /* float32 scale, 128 e4m3 codes */
        const unsigned char* b = row + (i / 128) * 132;
        const unsigned int bits = (unsigned int)b[0] | ((unsigned int)b[1] << 8) | ((unsigned int)b[2] << 16)
                                  | ((unsigned int)b[3] << 24);
        return moed_e4m3(b[4 + i % 128]) * moed_bits_f32(bits);
    }
    case MOED_GT_MXFP8: { /* e8m0 (255: NaN), 32 e4m3 codes */
        const unsigned char* b = row + (i / 32) * 33;
        const unsigned int e = b[0];
        const float scale = moed_bits_f32(e == 255 ? 0x7FC00000u : e == 0 ? 0x00400000u : e << 23);
        return moed_e4m3(b[1 + i % 32]) * scale;
    }
    default:
        return 0.0f;
    }
}

#endif
