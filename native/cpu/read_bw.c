/* A STREAM-like read of a buffer on the pool's threads (moed_cpu_read_pass, moed_api.h): what `moed bench
 * kernels` sets the kernels against. It runs on the same threads as the kernels it is compared with; numba's
 * read pass did not (its OpenMP threads spin for milliseconds after each parallel region, and on two cores
 * they took them from the kernel pass that followed: a read through the pool just after numba's went at
 * 12-19 GB/s, 22-26 without the spinning, on a 2-core Zen 3 VM). Tasks of 256 KB, the MoE calls' size. */
#include <stdint.h>

#include "moed_api.h"
#include "moed_cpu.h"
#include "moed_pool.h"

int moed_cpu_isa(void);

enum { TASK = 262144 };

typedef struct {
    const uint8_t *buf;
    int64_t bytes;
    int isa;
    uint64_t sums[64];  /* per thread, so the reads are not optimised away */
} read_job;

/* the sum of the 8-byte words (little-endian, mod 2^64) and then of the bytes past the last whole word */
static uint64_t sum_scalar(const uint8_t *p, int64_t n) {
    uint64_t s = 0, w;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __builtin_memcpy(&w, p + i, 8);
        s += w;
    }
    for (; i < n; i++) s += p[i];
    return s;
}

#if MOED_X86
#include <immintrin.h>
/* the same sum */
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, int64_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
    return out[0] + out[1] + out[2] + out[3] + sum_scalar(p + i, n - i);
}
#endif

static void read_task(void *ctx, int64_t task, int thread) {
    read_job *j = (read_job *)ctx;
    const int64_t at = task * TASK, n = j->bytes - at < TASK ? j->bytes - at : TASK;
#if MOED_X86
    if (j->isa >= MOED_ISA_AVX2) {
        j->sums[thread & 63] += sum_avx2(j->buf + at, n);
        return;
    }
#endif
    j->sums[thread & 63] += sum_scalar(j->buf + at, n);
}

uint64_t moed_cpu_read_pass(void *h, const void *buf, int64_t bytes) {
    if (!h || !buf || bytes <= 0) return 0;
    read_job j = {(const uint8_t *)buf, bytes, moed_cpu_isa(), {0}};
    moed_pool_run((moed_pool *)h, read_task, &j, (bytes + TASK - 1) / TASK);
    uint64_t s = 0;
    for (int i = 0; i < 64; i++) s += j.sums[i];
    return s;
}
