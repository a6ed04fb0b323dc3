/* The persistent thread pool of the CPU kernels (pool.c). */
#ifndef MOED_POOL_H
#define MOED_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct moed_pool moed_pool;
typedef void (*moed_task_fn)(void *ctx, int64_t task, int thread);

moed_pool *moed_pool_create(int nthreads, int64_t spin_ns);
int moed_pool_threads(const moed_pool *p);
/* run fn(ctx, i, thread) for i in [0, ntasks) on the pool and the calling thread; returns when all
 * are done. One job at a time per pool: callers serialise (the Python wrapper holds a lock). */
void moed_pool_run(moed_pool *p, moed_task_fn fn, void *ctx, int64_t ntasks);
/* a work buffer of at least `bytes` owned by the pool (kept between jobs: no malloc, mmap and page
 * faults per call), or NULL when out of memory; valid until the next call. Same serialisation as
 * moed_pool_run: one caller at a time. */
void *moed_pool_scratch(moed_pool *p, size_t bytes);
void moed_pool_destroy(moed_pool *p);

#endif
