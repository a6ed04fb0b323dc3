/* A persistent thread pool for the CPU kernels: the caller and N-1 workers take task indices
 * from one atomic counter, so a thread that shares its core with another program simply takes
 * fewer tasks. Idle threads spin for a short while (phases of one layer follow each other within
 * microseconds) and then sleep on a condition variable: they never spin for long, which is what
 * makes llama.cpp's barriers collapse when another program keeps a core busy.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "moed_pool.h"

struct moed_pool {
    int nthreads;            /* including the caller */
    int64_t spin_ns;         /* how long an idle thread spins before it sleeps */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t work_cv;  /* a new job (or stop) */
    pthread_cond_t done_cv;  /* the job's last task finished */
    atomic_uint_fast64_t generation;
    /* (generation << 32) | next task index: a task is claimed by compare-and-swap, so a thread
     * still holding an older job's description can never take a task of a newer job */
    atomic_uint_fast64_t next;
    atomic_int_fast64_t done;
    atomic_int stop;
    atomic_int sleeping_caller;
    /* the job: written by the caller under `lock`, copied by the workers under `lock` */
    moed_task_fn fn;
    void *ctx;
    int64_t ntasks;
    void *scratch;           /* moed_pool_scratch's buffer */
    size_t scratch_size;
};

typedef struct { moed_pool *pool; int index; } worker_arg;
typedef struct { moed_task_fn fn; void *ctx; int64_t ntasks; uint64_t gen; } job;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void run_tasks(moed_pool *p, const job *j, int thread) {
    for (;;) {
        uint_fast64_t v = atomic_load_explicit(&p->next, memory_order_acquire);
        if ((v >> 32) != (j->gen & 0xFFFFFFFFu)) return;  /* a newer job: ours is finished */
        int64_t i = (int64_t)(v & 0xFFFFFFFFu);
        if (i >= j->ntasks) return;
        if (!atomic_compare_exchange_weak_explicit(&p->next, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        j->fn(j->ctx, i, thread);
        if (atomic_fetch_add(&p->done, 1) + 1 == j->ntasks &&
            atomic_load(&p->sleeping_caller)) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done_cv);
            pthread_mutex_unlock(&p->lock);
        }
    }
}

static void *worker_main(void *arg) {
    worker_arg *wa = (worker_arg *)arg;
    moed_pool *p = wa->pool;
    int index = wa->index;
    free(wa);
    uint_fast64_t seen = atomic_load(&p->generation);
    for (;;) {
        int64_t start = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen && !atomic_load(&p->stop)) {
            cpu_relax();
            if (++spins % 64 == 0 && now_ns() - start > p->spin_ns) {
                pthread_mutex_lock(&p->lock);
                while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                    pthread_cond_wait(&p->work_cv, &p->lock);
                pthread_mutex_unlock(&p->lock);
                break;
            }
        }
        if (atomic_load(&p->stop)) break;
        job j;
        pthread_mutex_lock(&p->lock);
        j.fn = p->fn;
        j.ctx = p->ctx;
        j.ntasks = p->ntasks;
        j.gen = atomic_load(&p->generation);
        pthread_mutex_unlock(&p->lock);
        seen = j.gen;
        run_tasks(p, &j, index);
    }
    return NULL;
}

moed_pool *moed_pool_create(int nthreads, int64_t spin_ns) {
    moed_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->nthreads = nthreads < 1 ? 1 : nthreads;
    p->spin_ns = spin_ns < 0 ? 0 : spin_ns;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->next, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->sleeping_caller, 0);
    p->threads = calloc((size_t)p->nthreads, sizeof(pthread_t));
    int started = 1;
    for (int i = 1; i < p->nthreads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) break;
        wa->pool = p;
        wa->index = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) {
            free(wa);
            break;
        }
        started++;
    }
    p->nthreads = started;
    return p;
}

int moed_pool_threads(const moed_pool *p) { return p->nthreads; }

void moed_pool_run(moed_pool *p, moed_task_fn fn, void *ctx, int64_t ntasks) {
    if (ntasks <= 0) return;
    if (p->nthreads == 1 || ntasks == 1) {
        for (int64_t i = 0; i < ntasks; i++) fn(ctx, i, 0);
        return;
    }
    job j = { fn, ctx, ntasks, 0 };
    pthread_mutex_lock(&p->lock);
    p->fn = fn;
    p->ctx = ctx;
    p->ntasks = ntasks;
    j.gen = atomic_load(&p->generation) + 1;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->next, (uint_fast64_t)(j.gen & 0xFFFFFFFFu) << 32, memory_order_release);
    atomic_store_explicit(&p->generation, j.gen, memory_order_release);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->lock);
    run_tasks(p, &j, 0);
    if (atomic_load_explicit(&p->done, memory_order_acquire) == ntasks) return;
    int64_t start = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) != ntasks) {
        cpu_relax();
        if (++spins % 64 == 0 && now_ns() - start > p->spin_ns) {
            pthread_mutex_lock(&p->lock);
            atomic_store(&p->sleeping_caller, 1);
            while (atomic_load(&p->done) != ntasks) pthread_cond_wait(&p->done_cv, &p->lock);
            atomic_store(&p->sleeping_caller, 0);
            pthread_mutex_unlock(&p->lock);
            break;
        }
    }
}

void *moed_pool_scratch(moed_pool *p, size_t bytes) {
    /* a prefill's tens of MB are given back at the next small call (decode) instead of being held */
    const int shrink = p->scratch_size > ((size_t)32 << 20) && bytes < p->scratch_size / 16;
    if (bytes <= p->scratch_size && !shrink) return p->scratch;
    free(p->scratch);
    size_t size = bytes + bytes / 4;  /* some room: sizes vary a little with the routing */
    p->scratch = malloc(size);
    p->scratch_size = p->scratch ? size : 0;
    return p->scratch;
}

void moed_pool_destroy(moed_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->lock);
    free(p->threads);
    free(p->scratch);
    free(p);
}
