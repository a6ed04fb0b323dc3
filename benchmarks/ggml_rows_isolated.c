/* One ggml row kernel in isolation: GB/s of one thread over rows that stay in L2 (the kernel's compute
 * rate, no memory stall) and over rows streamed from DRAM. Not part of CI.
 *
 *   gcc -O3 -std=c11 -pthread -Inative/cpu -o /tmp/ggml_rows_isolated benchmarks/ggml_rows_isolated.c \
 *       native/cpu/[a-z]*.c -lm
 *   /tmp/ggml_rows_isolated TYPE_ID [ISA 0-5] [K 2048] [T 1]   # e.g. 12 (Q4_K) 3 (AVX-512 VNNI)
 *   (ISA 4 / 5: the 256-bit / 512-bit VNNI kernels whatever moed_cpu_vector_bits() prefers)
 *
 * T > 1 multiplies each row with T tokens per call (a prefill chunk's tokens of one expert) and adds the rate in
 * multiply-adds (GMAC/s): the kernels' compute rate at prefill, where the rows stay in cache across tokens.
 *
 * Where the type has an x8 layout (native/cpu/ggml_x8.h: every 4- to 8-bit GGUF type but Q6_K) and the ISA an x8
 * kernel, a second line gives the same two rates for the rows interleaved in eights. The FP8 block types (1001
 * FP8_B128, 1002 MXFP8) run their float kernels (moed_ggml_fdot) on float activations.
 *
 * Random bytes (with denormals flushed) stand in for the blocks: only the time is read. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ggml_rows.h"
#include "ggml_x8.h"
#include "moed_api.h"
#include "moed_cpu.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int T = 1;  /* tokens per call */

/* seconds of one pass over `rows` rows (T tokens each), the best of `reps` passes after a warm one */
static double rate(moed_ggml_dot_fn f, const uint8_t *w, int64_t rows, int64_t rb, int64_t K, const int8_t *xq,
                   const float *xs, const float *xsum, float *y, int reps) {
    for (int64_t r = 0; r < rows; r++) f(w + r * rb, K, xq, xs, xsum, T, y + r, rows);
    double t0 = now();
    for (int k = 0; k < reps; k++)
        for (int64_t r = 0; r < rows; r++) f(w + r * rb, K, xq, xs, xsum, T, y + r, rows);
    return (now() - t0) / reps;
}

static double rate8(moed_ggml_dot8_fn f, const uint8_t *w, int64_t rows, int64_t rb, int64_t K, const int8_t *xq,
                    const float *xs, const float *xsum, float *y, int reps) {
    for (int64_t r = 0; r < rows; r += 8) f(w + r * rb, K, xq, xs, xsum, T, y + r, rows);
    double t0 = now();
    for (int k = 0; k < reps; k++)
        for (int64_t r = 0; r < rows; r += 8) f(w + r * rb, K, xq, xs, xsum, T, y + r, rows);
    return (now() - t0) / reps;
}

/* one line: GB/s of rows read per pass (in L2 and from DRAM); with T > 1 also the multiply-adds per second in L2 */
static void report(const char *what, int type, int isa, int64_t K, int64_t rb, int64_t hot, int64_t cold, double t_hot,
                   double t_cold) {
    printf("type %d%s, ISA %d, K %lld, T %d: in L2 %.1f GB/s, from DRAM %.1f GB/s (one thread)", type, what, isa,
           (long long)K, T, (double)hot * (double)rb / t_hot / 1e9, (double)cold * (double)rb / t_cold / 1e9);
    if (T > 1) printf("; %.1f GMAC/s in L2", (double)hot * (double)K * T / t_hot / 1e9);
    printf("\n");
}

static double ratef(moed_ggml_fdot_fn f, const uint8_t *w, int64_t rows, int64_t rb, int64_t K, const float *x,
                    float *y, int reps) {
    for (int64_t r = 0; r < rows; r++) f(w + r * rb, K, x, 1, y + r, 1);
    double t0 = now();
    for (int k = 0; k < reps; k++)
        for (int64_t r = 0; r < rows; r++) f(w + r * rb, K, x, 1, y + r, 1);
    return (double)rows * (double)rb * reps / (now() - t0) / 1e9;
}

/* the FP8 block types: their float kernel over the same two sets of rows */
static int fp8_main(int type, int isa, int64_t K) {
    int bw, bb, head;
    moed_ggml_fp8_block(type, &bw, &bb, &head);
    moed_ggml_fdot_fn f = K % bw == 0 && isa <= moed_cpu_detected_isa() ? moed_ggml_fdot(type, isa) : NULL;
    if (!f) {
        fprintf(stderr, "no kernel for type %d, ISA %d, K %lld\n", type, isa, (long long)K);
        return 1;
    }
    const int64_t rb = K / bw * bb, hot = 256, cold = (1LL << 30) / rb;
    uint8_t *w = malloc((size_t)(rb * cold));
    float *x = malloc(sizeof(float) * K), *y = malloc(sizeof(float) * cold);
    if (!w || !x || !y) return 1;
    for (int64_t i = 0; i < rb * cold; i++) w[i] = (uint8_t)rand();
    for (int64_t i = 0; i < K; i++) x[i] = (float)(rand() % 2001 - 1000) / 100.0f;
    printf("type %d, ISA %d, K %lld: in L2 %.1f GB/s, from DRAM %.1f GB/s (one thread)\n", type, isa, (long long)K,
           ratef(f, w, hot, rb, K, x, y, 2000), ratef(f, w, cold, rb, K, x, y, 2));
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TYPE_ID [ISA] [K]\n", argv[0]);
        return 2;
    }
    _mm_setcsr(_mm_getcsr() | 0x8040);
    const int type = atoi(argv[1]), isa = argc > 2 ? atoi(argv[2]) : moed_cpu_detected_isa();
    const int64_t K = argc > 3 ? atoll(argv[3]) : 2048;
    T = argc > 4 ? atoi(argv[4]) : 1;
    if (T < 1) return 2;
    int fw, fb, fh;
    if (moed_ggml_fp8_block(type, &fw, &fb, &fh)) return fp8_main(type, isa, K);
    const int bw = moed_ggml_block_weights(type);
    moed_ggml_dot_fn f = bw && K % bw == 0 && (isa <= moed_cpu_detected_isa() || (isa <= MOED_GGML_ISA_VNNI512 && moed_cpu_detected_isa() == MOED_ISA_AVX512VNNI))
                                  ? moed_ggml_dot(type, isa) : NULL;
    if (!f) {
        fprintf(stderr, "no kernel for type %d, ISA %d, K %lld\n", type, isa, (long long)K);
        return 1;
    }
    const int64_t rb = K / bw * moed_ggml_block_bytes(type), hot = 256, cold = (1LL << 30) / rb / T / 8 * 8;
    const int reps = 2000 / T > 2 ? 2000 / T : 2;
    uint8_t *w = malloc((size_t)(rb * cold));
    float *x = malloc(sizeof(float) * K * T), *xs = malloc(sizeof(float) * K / 32 * T),
          *xsum = malloc(sizeof(float) * K / 32 * T);
    int8_t *xq = aligned_alloc(64, (size_t)((K * T + 63) / 64 * 64));
    float *y = malloc(sizeof(float) * cold * T);
    if (!w || !x || !xs || !xsum || !xq || !y) return 1;
    for (int64_t i = 0; i < rb * cold; i++) w[i] = (uint8_t)rand();
    for (int64_t i = 0; i < K * T; i++) x[i] = (float)(rand() % 2001 - 1000) / 100.0f;
    moed_quantize_act_span(x, T, K, moed_ggml_act_span(type), xq, xs, xsum);
    report("", type, isa, K, rb, hot, cold, rate(f, w, hot, rb, K, xq, xs, xsum, y, reps),
           rate(f, w, cold, rb, K, xq, xs, xsum, y, 2));
    const int x8 = moed_ggml_x8_of(type);
    moed_ggml_dot8_fn f8 = x8 && isa >= MOED_ISA_AVX2 && isa <= moed_cpu_detected_isa() ? moed_ggml_dot8(x8, isa) : NULL;
    if (f8) {
        uint8_t *wi = malloc((size_t)(rb * cold));
        if (!wi || moed_ggml_x8_pack(type, w, cold / 8 * 8, K, wi)) return 1;
        report(" x8", type, isa, K, rb, hot, cold, rate8(f8, wi, hot, rb, K, xq, xs, xsum, y, reps),
               rate8(f8, wi, cold, rb, K, xq, xs, xsum, y, 2));
    }
    return 0;
}
