/* The x8 layouts of GGUF block rows (ggml_x8.h): packing and unpacking (plain C), the fallback kernel
 * (a group unpacked and run row by row), and the choice of kernel. The SIMD kernels are in
 * ggml_x8_avx2.c. */
#include <stdlib.h>
#include <string.h>

#include "ggml_rows.h"
#include "ggml_x8.h"
#include "moed_api.h"
#include "moed_cpu.h"
#include "moed_pool.h"

int moed_ggml_x8_of(int type) {
    return type == MOED_GGML_Q4_0 || type == MOED_GGML_Q8_0 || type == MOED_GGML_Q4_K || type == MOED_GGML_MXFP4
               ? MOED_GGML_X8_BASE + type : 0;
}

int moed_ggml_x8_base(int type) {
    return type == MOED_GGML_Q4_0_X8 || type == MOED_GGML_Q8_0_X8 || type == MOED_GGML_Q4_K_X8
                   || type == MOED_GGML_MXFP4_X8
               ? type - MOED_GGML_X8_BASE : 0;
}

moed_ggml_dot8_fn moed_ggml_dot8_avx2(int x8type);  /* ggml_x8_avx2.c: NULL where it has none */

/* Where the per-row kernels are the 256-bit ones (AVX2, or AVX-512 VNNI on a CPU that splits 512-bit
 * instructions: moed_cpu_vector_bits() 256), the x8 kernels do the same integer work with about half
 * the vector instructions per block (docs/benchmarks.md, issue #31). Against the 512-bit VNNI kernels
 * (Intel) they are not measured: those CPUs keep the rows. */
int moed_ggml_x8_preferred(int type, int isa) {
    const int x8 = moed_ggml_x8_of(type);
    if (!x8 || isa < MOED_ISA_AVX2 || !moed_ggml_dot8_avx2(x8)) return 0;
    if (isa == MOED_ISA_AVX512VNNI && moed_cpu_vector_bits() != 256) return 0;
    return x8;
}

/* ---- Q4_0 and Q8_0: 8 x (2 + qs)-byte blocks <-> one x8 block (144 or 272 bytes), qs 16 or 32 ---- */

static void d16_pack(const uint8_t *const rows[8], uint8_t *o, int qs) {
    for (int r = 0; r < 8; r++) {
        memcpy(o + 2 * r, rows[r], 2);
        for (int c = 0; c < qs / 4; c++) memcpy(o + 16 + 32 * c + 4 * r, rows[r] + 2 + 4 * c, 4);
    }
}

static void d16_unpack(const uint8_t *o, uint8_t *const rows[8], int qs) {
    for (int r = 0; r < 8; r++) {
        memcpy(rows[r], o + 2 * r, 2);
        for (int c = 0; c < qs / 4; c++) memcpy(rows[r] + 2 + 4 * c, o + 16 + 32 * c + 4 * r, 4);
    }
}

/* ---- MXFP4: 8 x 17-byte blocks <-> one 136-byte x8 block (Q4_0's, with one E8M0 byte a row) ---- */

static void mxfp4_pack(const uint8_t *const rows[8], uint8_t *o) {
    for (int r = 0; r < 8; r++) {
        o[r] = rows[r][0];
        for (int c = 0; c < 4; c++) memcpy(o + 8 + 32 * c + 4 * r, rows[r] + 1 + 4 * c, 4);
    }
}

static void mxfp4_unpack(const uint8_t *o, uint8_t *const rows[8]) {
    for (int r = 0; r < 8; r++) {
        rows[r][0] = o[r];
        for (int c = 0; c < 4; c++) memcpy(rows[r] + 1 + 4 * c, o + 8 + 32 * c + 4 * r, 4);
    }
}

/* ---- Q4_K: 8 x 144-byte super-blocks <-> one 1152-byte x8 super-block ---- */

static void k4_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void q4_k_pack(const uint8_t *const rows[8], uint8_t *o) {
    memset(o + 96, 0, 32);
    for (int r = 0; r < 8; r++) {
        const uint8_t *b = rows[r];
        const int q = r / 4, r_ = r % 4;
        memcpy(o + 2 * r, b, 2);
        memcpy(o + 16 + 2 * r, b + 2, 2);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            k4_scale_min(b + 4, s, &sc, &m);
            const int h = s / 4, s_ = s % 4;
            o[32 + 32 * h + 16 * q + 4 * s_ + r_] = (uint8_t)((sc & 15) | (m & 15) << 4);
            o[96 + 16 * q + 4 * s_ + r_] |= (uint8_t)(((sc >> 4) | (m >> 4) << 2) << (4 * h));
        }
        for (int p = 0; p < 4; p++)
            for (int c = 0; c < 8; c++) memcpy(o + 128 + 256 * p + 32 * c + 4 * r, b + 16 + 32 * p + 4 * c, 4);
    }
}

static void q4_k_unpack(const uint8_t *o, uint8_t *const rows[8]) {
    for (int r = 0; r < 8; r++) {
        uint8_t *b = rows[r];
        const int q = r / 4, r_ = r % 4;
        int sc[8], m[8];
        memcpy(b, o + 2 * r, 2);
        memcpy(b + 2, o + 16 + 2 * r, 2);
        for (int s = 0; s < 8; s++) {
            const int h = s / 4, s_ = s % 4;
            const int lo = o[32 + 32 * h + 16 * q + 4 * s_ + r_], hi = (o[96 + 16 * q + 4 * s_ + r_] >> (4 * h)) & 15;
            sc[s] = (lo & 15) | (hi & 3) << 4;
            m[s] = (lo >> 4) | (hi >> 2) << 4;
        }
        uint8_t *s6 = b + 4;
        for (int j = 0; j < 4; j++) {
            s6[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            s6[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
            s6[j + 8] = (uint8_t)((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
        }
        for (int p = 0; p < 4; p++)
            for (int c = 0; c < 8; c++) memcpy(b + 16 + 32 * p + 4 * c, o + 128 + 256 * p + 32 * c + 4 * r, 4);
    }
}

static int x8_args(int type, const uint8_t *src, int64_t rows, int64_t K, const uint8_t *dst, int same_ok) {
    const int bw = moed_ggml_block_weights(type);
    return moed_ggml_x8_of(type) && src && dst && (same_ok || src != dst) && rows > 0 && rows % 8 == 0 && K > 0
        && K % bw == 0;
}

static void x8_convert(int type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst, int pack) {
    const int64_t bb = moed_ggml_block_bytes(type), nb = K / moed_ggml_block_weights(type), rb = nb * bb;
    for (int64_t g = 0; g < rows / 8; g++) {
        const uint8_t *gs = src + g * 8 * rb;
        uint8_t *gd = dst + g * 8 * rb;
        for (int64_t b = 0; b < nb; b++) {
            if (pack) {
                const uint8_t *rp[8];
                for (int r = 0; r < 8; r++) rp[r] = gs + r * rb + b * bb;
                if (type == MOED_GGML_Q4_0 || type == MOED_GGML_Q8_0) d16_pack(rp, gd + 8 * b * bb, (int)bb - 2);
                else if (type == MOED_GGML_MXFP4) mxfp4_pack(rp, gd + 8 * b * bb);
                else q4_k_pack(rp, gd + 8 * b * bb);
            } else {
                uint8_t *rp[8];
                for (int r = 0; r < 8; r++) rp[r] = gd + r * rb + b * bb;
                if (type == MOED_GGML_Q4_0 || type == MOED_GGML_Q8_0) d16_unpack(gs + 8 * b * bb, rp, (int)bb - 2);
                else if (type == MOED_GGML_MXFP4) mxfp4_unpack(gs + 8 * b * bb, rp);
                else q4_k_unpack(gs + 8 * b * bb, rp);
            }
        }
    }
}

int moed_ggml_x8_pack(int type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst) {
    if (!x8_args(type, src, rows, K, dst, 0)) return -1;
    x8_convert(type, src, rows, K, dst, 1);
    return 0;
}

int moed_ggml_x8_unpack(int type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst) {
    if (!x8_args(type, src, rows, K, dst, 0)) return -1;
    x8_convert(type, src, rows, K, dst, 0);
    return 0;
}

/* ---- the fallback: the group back as rows, the per-row kernels ---- */

static void dot8_rows(int type, const uint8_t *group, int64_t K, const int8_t *xq, const float *xs, const float *xsum,
                      int T, float *y, int64_t ldy) {
    const int64_t rb = K / moed_ggml_block_weights(type) * moed_ggml_block_bytes(type);
    uint8_t *rows = (uint8_t *)malloc((size_t)(8 * rb));
    if (!rows) {  /* no memory for 8 rows: the result is NaN rather than a crash */
        for (int t = 0; t < T; t++)
            for (int r = 0; r < 8; r++) y[(int64_t)t * ldy + r] = __builtin_nanf("");
        return;
    }
    x8_convert(type, group, 8, K, rows, 0);
    moed_ggml_dot_fn dot = moed_ggml_dot(type, moed_cpu_isa());
    for (int r = 0; r < 8; r++) dot(rows + r * rb, K, xq, xs, xsum, T, y + r, ldy);
    free(rows);
}

static void dot8_rows_q4_0(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                           float *y, int64_t ldy) {
    dot8_rows(MOED_GGML_Q4_0, g, K, xq, xs, xsum, T, y, ldy);
}

static void dot8_rows_q8_0(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                           float *y, int64_t ldy) {
    dot8_rows(MOED_GGML_Q8_0, g, K, xq, xs, xsum, T, y, ldy);
}

static void dot8_rows_q4_k(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                           float *y, int64_t ldy) {
    dot8_rows(MOED_GGML_Q4_K, g, K, xq, xs, xsum, T, y, ldy);
}

static void dot8_rows_mxfp4(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,
                            float *y, int64_t ldy) {
    dot8_rows(MOED_GGML_MXFP4, g, K, xq, xs, xsum, T, y, ldy);
}

moed_ggml_dot8_fn moed_ggml_dot8(int x8type, int isa) {
    if (isa >= MOED_ISA_AVX2) {
        moed_ggml_dot8_fn fast = moed_ggml_dot8_avx2(x8type);
        if (fast) return fast;
    }
    switch (x8type) {
    case MOED_GGML_Q4_0_X8: return dot8_rows_q4_0;
    case MOED_GGML_Q8_0_X8: return dot8_rows_q8_0;
    case MOED_GGML_Q4_K_X8: return dot8_rows_q4_k;
    case MOED_GGML_MXFP4_X8: return dot8_rows_mxfp4;
    default: return NULL;
    }
}

/* ---- packing on the pool (a bank's tensors at load) ---- */

typedef struct {
    int type, pack;
    const uint8_t *src;
    uint8_t *dst;
    int64_t K, row_bytes, groups_per_task, groups;
} convert_job;

/* in place (src == dst): each group converted into a buffer of its size (in L1/L2) and copied back, so the
 * bank is read and written once, with no second copy of it */
static void convert_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    const convert_job *j = (const convert_job *)ctx;
    const int64_t g0 = task * j->groups_per_task, g1 = g0 + j->groups_per_task < j->groups ? g0 + j->groups_per_task
                                                                                           : j->groups;
    const int64_t off = g0 * 8 * j->row_bytes, group = 8 * j->row_bytes;
    if (j->src != j->dst) {
        x8_convert(j->type, j->src + off, 8 * (g1 - g0), j->K, j->dst + off, j->pack);
        return;
    }
    uint8_t *tmp = (uint8_t *)malloc((size_t)group);
    if (!tmp) return;  /* checked by the caller before the run: cannot happen for a group this size */
    for (int64_t g = g0; g < g1; g++) {
        x8_convert(j->type, j->src + g * group, 8, j->K, tmp, j->pack);
        memcpy(j->dst + g * group, tmp, (size_t)group);
    }
    free(tmp);
}

int moed_cpu_ggml_x8_convert(void *h, int type, int pack, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst) {
    if (!h || !x8_args(type, src, rows, K, dst, 1)) return -1;
    const int64_t rb = K / moed_ggml_block_weights(type) * moed_ggml_block_bytes(type);
    convert_job j = {type, pack != 0, src, dst, K, rb, 0, rows / 8};
    j.groups_per_task = (1 << 20) / (8 * rb) + 1;  /* ~1 MB a task */
    moed_pool_run((moed_pool *)h, convert_task, &j, (j.groups + j.groups_per_task - 1) / j.groups_per_task);
    return 0;
}

/* one group's dot at one ISA (tests): y [T][8]; 0, or -1 for a type that is not x8 */
int moed_ggml_dot8_one(int x8type, int isa, const uint8_t *group, int64_t K, const int8_t *xq, const float *xs,
                       const float *xsum, int T, float *y) {
    moed_ggml_dot8_fn f = moed_ggml_dot8(x8type, isa);
    const int base = moed_ggml_x8_base(x8type);
    if (!f || !group || !xq || !xs || !xsum || !y || T < 1 || K < 1 || K % moed_ggml_block_weights(base)) return -1;
    f(group, K, xq, xs, xsum, T, y, 8);
    return 0;
}
