/* Which instruction set a call runs on, and the pool of threads that shares a job's parts. Part of
 * _blocks.c (see the rules there); after the paths, whose row functions a part calls. */
#include "_blocks.h"

/* The instruction sets, each a superset of the one before; a call runs on the best this CPU has,
 * at most the one it asks for (tests compare them: they give the same bits), and at most the
 * process's cap (limit_isa: to measure one against another). */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *ISA_NAMES[] = {"portable", "avx2", "avx512"};
static int cpu_best = -1, best_isa = -1;

static int cpu_isa(void) {
    if (cpu_best < 0) cpu_best = cpu_has_avx2() ? (cpu_has_avx512() ? ISA_AVX512 : ISA_AVX2) : ISA_PORTABLE;
    if (best_isa < 0) best_isa = cpu_best;
    return best_isa;
}

/* A call's instruction set: `cap` 0 asks for the best, 1 + i for ISA_NAMES[i] at most. */
static int isa_for(long long cap) {
    int best = cpu_isa();
    return cap > 0 && cap - 1 < best ? (int)cap - 1 : best;
}

/* ---- the pool ---- */

/* A matmul's share of work: output features [n0, n1) of every row. */
typedef struct {
    int qtype, isa, accumulate, tiled; /* tiled: the weight is in tiles of TILE rows (_blocks_tiles.c) */
    const uint8_t *w;
    int64_t row_bytes, n, m, nb; /* nb: x's blocks a row (32-wide, or 256-wide for a K type) */
    const void *xq;              /* XBlock or, for a K type, XKBlock */
    float *y;
} MatJob;

/* What the pool runs: fn(ctx, part, parts) once for every part; parts never depend on each other. */
typedef struct {
    void (*fn)(const void *ctx, int part, int parts);
    const void *ctx;
    int parts;
} Job;

/* Threads claim a job's parts one at a time, the caller too, so a thread the OS has not scheduled
 * (several daemons sharing a box's cores) holds up nothing: the others take its parts, and the caller
 * waits only for parts that are being computed. job_state is the job's number (high 32 bits) and
 * the parts not yet claimed (low 32): a claim is a compare-and-swap that also checks the number, so
 * a late thread never takes a part of a job that is not the one it saw. Which thread computes a
 * part never changes its bits. */
static Job job;
static _Atomic uint64_t job_state;
static atomic_uint job_gen;        /* the job's number again, 32 bits for the futex */
static atomic_int job_done;        /* parts finished */
static atomic_int sleepers;
static int pool_size = 0;          /* workers started (the caller is one more) */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
/* how long an idle worker spins before it sleeps: between the matmuls of a layer (one kernel call) and
 * between layers a few microseconds pass; longer waits (the network, sampling) are not worth a core
 * spinning, least of all on a box that several daemons share */
static const double SPIN_S = 50e-6;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void cpu_relax(void) {
#if HAVE_X86
    _mm_pause();
#endif
}

static void matmul_part(const void *ctx, int part, int parts) {
    const MatJob *j = ctx;
    /* split into whole strips (or tiles) so every thread's share starts on a strip's boundary */
    int64_t unit = j->tiled ? TILE : STRIP, strips = (j->n + unit - 1) / unit;
    int64_t s0 = strips * part / parts, s1 = strips * (part + 1) / parts;
    int64_t n0 = s0 * unit, n1 = s1 * unit < j->n ? s1 * unit : j->n;
    if (n0 >= n1) return;
    int k_type = block_elems(j->qtype) == QKK;
    if (j->tiled) {
#if HAVE_X86
        if (j->isa == ISA_AVX512) rows_tiled_512(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else if (j->isa) rows_tiled_avx2(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else
#endif
        rows_tiled_portable(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        return;
    }
#if HAVE_X86
    if (j->isa == ISA_AVX512) {
        if (k_type) rows_avx512_k(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else rows_avx512(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        return;
    }
    if (j->isa) {
        if (k_type && j->m >= K_STRIPS_FROM) rows_avx2_k_strips(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else if (k_type) rows_avx2_k(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        else rows_avx2(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
        return;
    }
#endif
    if (k_type) rows_portable_k(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
    else rows_portable(j->qtype, j->w, j->row_bytes, n0, n1, j->n, j->xq, j->m, j->nb, j->y, j->accumulate);
}

/* Claim and compute job `gen`'s parts until none is left (or another job is posted). */
static void take_parts(unsigned gen) {
    uint64_t s = atomic_load_explicit(&job_state, memory_order_acquire);
    for (;;) {
        if ((unsigned)(s >> 32) != gen || (uint32_t)s == 0) return;
        if (!atomic_compare_exchange_weak_explicit(&job_state, &s, s - 1, memory_order_acquire,
                                                   memory_order_acquire))
            continue; /* s now holds the new state */
        job.fn(job.ctx, (int)((uint32_t)s - 1), job.parts);
        atomic_fetch_add_explicit(&job_done, 1, memory_order_release);
        s = atomic_load_explicit(&job_state, memory_order_acquire);
    }
}

static void *worker(void *arg) {
    unsigned seen = *(unsigned *)arg; /* the job number when it was started: a later job is new to it */
    free(arg);
    for (;;) {
        unsigned gen;
        double until = now_s() + SPIN_S;
        int spins = 0;
        while ((gen = atomic_load_explicit(&job_gen, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_s() > until) {
                atomic_fetch_add(&sleepers, 1);
                if (atomic_load(&job_gen) == seen) syscall(SYS_futex, &job_gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                until = now_s() + SPIN_S;
            }
        }
        seen = gen;
        take_parts(gen);
    }
    return NULL;
}

/* a forked child has none of its parent's workers */
static void forget_pool(void) {
    pool_size = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, NULL);
}

static int ensure_pool(int threads) {
    static int hooked = 0;
    if (!hooked) {
        pthread_atfork(NULL, NULL, forget_pool);
        hooked = 1;
    }
    int want = threads - 1;
    if (want > MAX_THREADS - 1) want = MAX_THREADS - 1;
    pthread_mutex_lock(&pool_lock);
    while (pool_size < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        unsigned *start = malloc(sizeof *start);
        if (!start) break;
        *start = atomic_load(&job_gen);
        int rc = pthread_create(&t, &attr, worker, start);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            free(start);
            break;
        }
        pool_size++;
    }
    pthread_mutex_unlock(&pool_lock);
    return (pool_size + 1 < threads ? pool_size + 1 : threads);
}

static void run_job(const Job *j, int threads) {
    pthread_mutex_lock(&call_lock); /* one job at a time: the pool has one job slot */
    threads = threads > 1 ? ensure_pool(threads) : 1;
    if (threads == 1) {
        j->fn(j->ctx, 0, 1);
        pthread_mutex_unlock(&call_lock);
        return;
    }
    /* one part a thread: finer parts would balance better, but each part's start costs its stream of
     * weights a prefetcher ramp (two a thread: 2-4% slower over 30 layers' cold matmuls; four: 12%) */
    int parts = threads;
    job = *j;
    job.parts = parts;
    atomic_store_explicit(&job_done, 0, memory_order_relaxed);
    unsigned gen = atomic_load_explicit(&job_gen, memory_order_relaxed) + 1; /* only callers write it */
    atomic_store_explicit(&job_state, ((uint64_t)gen << 32) | (uint32_t)parts, memory_order_release);
    atomic_store(&job_gen, gen);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &job_gen, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    take_parts(gen);
    /* the parts left are being computed; a thread preempted in one gets the core back sooner if we yield */
    for (int spins = 0; atomic_load_explicit(&job_done, memory_order_acquire) < parts; spins++) {
        if (spins < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&call_lock);
}
