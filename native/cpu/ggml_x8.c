/* The x8 layouts of GGUF block rows (ggml_x8.h): packing and unpacking (plain C), the fallback kernel
 * (a group unpacked and run row by row), and the choice of kernel. The SIMD kernels are in
 * ggml_x8_avx2.c. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_rows.h"
#include "ggml_x8.h"
#include "moed_api.h"
#include "moed_cpu.h"
#include "moed_pool.h"

int moed_ggml_x8_of(int type) {
    switch (type) {
    case MOED_GGML_Q4_0: case MOED_GGML_Q4_1: case MOED_GGML_Q5_0: case MOED_GGML_Q5_1: case MOED_GGML_Q8_0: case MOED_GGML_Q4_K: case MOED_GGML_Q5_K:
    case MOED_GGML_IQ4_NL: case MOED_GGML_IQ4_XS: case MOED_GGML_MXFP4: case MOED_GGML_NVFP4:
        return MOED_GGML_X8_BASE + type;
    default: return 0;
    }
}

int moed_ggml_x8_base(int type) {
    return type > MOED_GGML_X8_BASE && moed_ggml_x8_of(type - MOED_GGML_X8_BASE) == type ? type - MOED_GGML_X8_BASE
                                                                                         : 0;
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

/* ---- the 32-weight types (and NVFP4's 64): 8 x (head + qs)-byte blocks <-> one x8 block. The head is one
 * scale field (MXFP4's E8M0 byte; Q4_0, Q8_0 and IQ4_NL's fp16 d), two (Q4_1's d and m) or four (NVFP4's
 * E4M3 bytes), each field of rows 0..7 together; then the qs (16 or 32 bytes) four bytes a row ---- */

static void b32_fields(int type, int *head, int *field) {
    *head = type == MOED_GGML_MXFP4 ? 1 : type == MOED_GGML_Q4_1 || type == MOED_GGML_Q5_1 || type == MOED_GGML_NVFP4 ? 4 : 2;
    *field = type == MOED_GGML_MXFP4 || type == MOED_GGML_NVFP4 ? 1 : 2;
}

/* Q5_0/Q5_1's qh (32 bits, bit i weight i's fifth) <-> the x8 bytes of a row's lane (byte j: bit c that of
 * weight 4 c + j, bit 4 + c that of 16 + 4 c + j), through two 256-entry tables: qh byte b's bit t goes to lane
 * byte t % 4, bit t / 4 + 2 (b % 2) + 4 (b / 2); lane byte j's bit k comes from qh bit 16 (k / 4) + 4 (k % 4) + j */
static uint32_t qh_fwd[256], qh_inv[256];
static pthread_once_t qh_once = PTHREAD_ONCE_INIT;

static void qh_tables(void) {
    for (int x = 0; x < 256; x++) {
        uint32_t f = 0, v = 0;
        for (int t = 0; t < 8; t++)
            if (x >> t & 1) {
                f |= 1u << (8 * (t % 4) + t / 4);
                v |= 1u << (16 * (t / 4) + 4 * (t % 4));
            }
        qh_fwd[x] = f;
        qh_inv[x] = v;
    }
}

static void qh_to_lane(const uint8_t *qh, uint8_t *lane) {
    uint32_t out = 0;
    for (int b = 0; b < 4; b++) out |= qh_fwd[qh[b]] << (2 * (b & 1) + 4 * (b >> 1));
    for (int j = 0; j < 4; j++) lane[j] = (uint8_t)(out >> (8 * j));
}

static void qh_from_lane(const uint8_t *lane, uint8_t *qh) {
    uint32_t v = 0;
    for (int j = 0; j < 4; j++) v |= qh_inv[lane[j]] << j;
    for (int b = 0; b < 4; b++) qh[b] = (uint8_t)(v >> (8 * b));
}

/* qs: the code bytes after the head (Q5_0/Q5_1: after the head and qh, which go to their plane) */
static void b32_pack(int type, const uint8_t *const rows[8], uint8_t *o, int qs) {
    int head, field;
    b32_fields(type, &head, &field);
    const int five = type == MOED_GGML_Q5_0 || type == MOED_GGML_Q5_1, at = 8 * head + (five ? 32 : 0);
    for (int r = 0; r < 8; r++) {
        for (int f = 0; f < head / field; f++) memcpy(o + 8 * field * f + field * r, rows[r] + field * f, (size_t)field);
        if (five) qh_to_lane(rows[r] + head, o + 8 * head + 4 * r);
        for (int c = 0; c < qs / 4; c++) memcpy(o + at + 32 * c + 4 * r, rows[r] + head + (five ? 4 : 0) + 4 * c, 4);
    }
}

static void b32_unpack(int type, const uint8_t *o, uint8_t *const rows[8], int qs) {
    int head, field;
    b32_fields(type, &head, &field);
    const int five = type == MOED_GGML_Q5_0 || type == MOED_GGML_Q5_1, at = 8 * head + (five ? 32 : 0);
    for (int r = 0; r < 8; r++) {
        for (int f = 0; f < head / field; f++) memcpy(rows[r] + field * f, o + 8 * field * f + field * r, (size_t)field);
        if (five) qh_from_lane(o + 8 * head + 4 * r, rows[r] + head);
        for (int c = 0; c < qs / 4; c++) memcpy(rows[r] + head + (five ? 4 : 0) + 4 * c, o + at + 32 * c + 4 * r, 4);
    }
}

/* ---- IQ4_XS: 8 x 136-byte super-blocks <-> one 1088-byte x8 super-block ---- */

static int iq4xs_ls(const uint8_t *b, int s) {
    const int sh = b[2] | b[3] << 8;
    return ((b[4 + s / 2] >> (4 * (s % 2))) & 15) | ((sh >> (2 * s)) & 3) << 4;
}

static void iq4_xs_pack(const uint8_t *const rows[8], uint8_t *o) {
    memset(o + 16, 0, 48);
    for (int r = 0; r < 8; r++) {
        const uint8_t *b = rows[r];
        const int q = r / 4, r_ = r % 4;
        memcpy(o + 2 * r, b, 2);
        for (int s = 0; s < 8; s++) {
            const int ls = iq4xs_ls(b, s), h = s / 4, s_ = s % 4;
            o[16 + 16 * q + 4 * s_ + r_] |= (uint8_t)((ls & 15) << (4 * h));
            o[48 + 4 * s_ + r_] |= (uint8_t)((ls >> 4) << (2 * (2 * q + h)));
        }
        for (int s = 0; s < 8; s++)
            for (int c = 0; c < 4; c++) memcpy(o + 64 + 128 * s + 32 * c + 4 * r, b + 8 + 16 * s + 4 * c, 4);
    }
}

static void iq4_xs_unpack(const uint8_t *o, uint8_t *const rows[8]) {
    for (int r = 0; r < 8; r++) {
        uint8_t *b = rows[r];
        const int q = r / 4, r_ = r % 4;
        int sh = 0;
        memcpy(b, o + 2 * r, 2);
        memset(b + 4, 0, 4);
        for (int s = 0; s < 8; s++) {
            const int h = s / 4, s_ = s % 4;
            const int lo = (o[16 + 16 * q + 4 * s_ + r_] >> (4 * h)) & 15;
            const int hi = (o[48 + 4 * s_ + r_] >> (2 * (2 * q + h))) & 3;
            b[4 + s / 2] |= (uint8_t)(lo << (4 * (s % 2)));
            sh |= hi << (2 * s);
        }
        b[2] = (uint8_t)(sh & 255);
        b[3] = (uint8_t)(sh >> 8);
        for (int s = 0; s < 8; s++)
            for (int c = 0; c < 4; c++) memcpy(b + 8 + 16 * s + 4 * c, o + 64 + 128 * s + 32 * c + 4 * r, 4);
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

/* Q5_K (1408 bytes per 8 rows x 256 weights): Q4_K's head [0, 128), then the qh bytes four a row
 * (128 + 32 c + 4 r + j: row r's qh[4 c + j]), then Q4_K's codes at 384 */
static void q4_k_pack(const uint8_t *const rows[8], uint8_t *o, int five) {
    const int qs = five ? 48 : 16, at = five ? 384 : 128;
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
        if (five)
            for (int c = 0; c < 8; c++) memcpy(o + 128 + 32 * c + 4 * r, b + 16 + 4 * c, 4);
        for (int p = 0; p < 4; p++)
            for (int c = 0; c < 8; c++) memcpy(o + at + 256 * p + 32 * c + 4 * r, b + qs + 32 * p + 4 * c, 4);
    }
}

static void q4_k_unpack(const uint8_t *o, uint8_t *const rows[8], int five) {
    const int qs = five ? 48 : 16, at = five ? 384 : 128;
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
        if (five)
            for (int c = 0; c < 8; c++) memcpy(b + 16 + 4 * c, o + 128 + 32 * c + 4 * r, 4);
        for (int p = 0; p < 4; p++)
            for (int c = 0; c < 8; c++) memcpy(b + qs + 32 * p + 4 * c, o + at + 256 * p + 32 * c + 4 * r, 4);
    }
}

static int x8_args(int type, const uint8_t *src, int64_t rows, int64_t K, const uint8_t *dst, int same_ok) {
    const int bw = moed_ggml_block_weights(type);
    return moed_ggml_x8_of(type) && src && dst && (same_ok || src != dst) && rows > 0 && rows % 8 == 0 && K > 0
        && K % bw == 0;
}

static void x8_convert(int type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst, int pack) {
    pthread_once(&qh_once, qh_tables);
    const int64_t bb = moed_ggml_block_bytes(type), nb = K / moed_ggml_block_weights(type), rb = nb * bb;
    for (int64_t g = 0; g < rows / 8; g++) {
        const uint8_t *gs = src + g * 8 * rb;
        uint8_t *gd = dst + g * 8 * rb;
        for (int64_t b = 0; b < nb; b++) {
            const int k_quant = type == MOED_GGML_Q4_K || type == MOED_GGML_Q5_K;
            int head, field;
            b32_fields(type, &head, &field);
            if (pack) {
                const uint8_t *rp[8];
                for (int r = 0; r < 8; r++) rp[r] = gs + r * rb + b * bb;
                if (k_quant) q4_k_pack(rp, gd + 8 * b * bb, type == MOED_GGML_Q5_K);
                else if (type == MOED_GGML_IQ4_XS) iq4_xs_pack(rp, gd + 8 * b * bb);
                else b32_pack(type, rp, gd + 8 * b * bb, type == MOED_GGML_Q5_0 || type == MOED_GGML_Q5_1 ? 16 : (int)bb - head);
            } else {
                uint8_t *rp[8];
                for (int r = 0; r < 8; r++) rp[r] = gd + r * rb + b * bb;
                if (k_quant) q4_k_unpack(gs + 8 * b * bb, rp, type == MOED_GGML_Q5_K);
                else if (type == MOED_GGML_IQ4_XS) iq4_xs_unpack(gs + 8 * b * bb, rp);
                else b32_unpack(type, gs + 8 * b * bb, rp, type == MOED_GGML_Q5_0 || type == MOED_GGML_Q5_1 ? 16 : (int)bb - head);
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

/* the fallback of each x8 type (a kernel pointer carries no type: one wrapper per type) */
#define DOT8_ROWS(name, type)                                                                                        \
    static void name(const uint8_t *g, int64_t K, const int8_t *xq, const float *xs, const float *xsum, int T,     \
                     float *y, int64_t ldy) {                                                                        \
        dot8_rows(type, g, K, xq, xs, xsum, T, y, ldy);                                                              \
    }
DOT8_ROWS(dot8_rows_q4_0, MOED_GGML_Q4_0)
DOT8_ROWS(dot8_rows_q4_1, MOED_GGML_Q4_1)
DOT8_ROWS(dot8_rows_q5_0, MOED_GGML_Q5_0)
DOT8_ROWS(dot8_rows_q5_1, MOED_GGML_Q5_1)
DOT8_ROWS(dot8_rows_q8_0, MOED_GGML_Q8_0)
DOT8_ROWS(dot8_rows_q4_k, MOED_GGML_Q4_K)
DOT8_ROWS(dot8_rows_q5_k, MOED_GGML_Q5_K)
DOT8_ROWS(dot8_rows_iq4_nl, MOED_GGML_IQ4_NL)
DOT8_ROWS(dot8_rows_iq4_xs, MOED_GGML_IQ4_XS)
DOT8_ROWS(dot8_rows_mxfp4, MOED_GGML_MXFP4)
DOT8_ROWS(dot8_rows_nvfp4, MOED_GGML_NVFP4)

moed_ggml_dot8_fn moed_ggml_dot8(int x8type, int isa) {
    if (isa >= MOED_ISA_AVX2) {
        moed_ggml_dot8_fn fast = moed_ggml_dot8_avx2(x8type);
        if (fast) return fast;
    }
    switch (x8type - MOED_GGML_X8_BASE) {
    case MOED_GGML_Q4_0: return dot8_rows_q4_0;
    case MOED_GGML_Q4_1: return dot8_rows_q4_1;
    case MOED_GGML_Q5_0: return dot8_rows_q5_0;
    case MOED_GGML_Q5_1: return dot8_rows_q5_1;
    case MOED_GGML_Q8_0: return dot8_rows_q8_0;
    case MOED_GGML_Q4_K: return dot8_rows_q4_k;
    case MOED_GGML_Q5_K: return dot8_rows_q5_k;
    case MOED_GGML_IQ4_NL: return dot8_rows_iq4_nl;
    case MOED_GGML_IQ4_XS: return dot8_rows_iq4_xs;
    case MOED_GGML_MXFP4: return dot8_rows_mxfp4;
    case MOED_GGML_NVFP4: return dot8_rows_nvfp4;
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
