/* How much of a neighbour's CPU a 2-thread fork-join team loses, and whether a different team would lose less.
 *
 * A "step" is 150 regions of 16 compute-bound items of ~25 us (no memory traffic), run by one of three teams:
 *   omp      libgomp, schedule(static): what the C kernels do (worker/cpu/csrc/gemm.c);
 *   dynamic  an own pool: items taken from a shared counter, a region complete when its items are done (a
 *            helper that never got a core in it is not waited for), waiters spin 50 us then sleep (futex);
 *   migrate  dynamic, and a waiter that has spun 50 us while another thread still holds an item moves that
 *            thread onto its own CPU (sched_setaffinity) before it sleeps, so the holder need not wait for the
 *            neighbour's time slice to end on its own core.
 * As a neighbour: `stall_probe noise BUSY_US SLEEP_US SECONDS POLICY NICE` burns BUSY_US of CPU, sleeps a
 * uniform 0..SLEEP_US, and prints the cores it took. Driven by run.sh; results in BENCHMARKS.md.
 *   stall_probe TEAM SECONDS   ->  steps/s */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define THREADS 2
#define REGIONS 150
#define ITEMS 16
#define ITEM_US 25
#define SPIN_S 50e-6

static double clock_s(clockid_t id) {
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static double now(void) { return clock_s(CLOCK_MONOTONIC); }

static volatile float sink;
static void work(int us) { /* a dependent chain of ~700 multiply-adds a microsecond, opaque to the compiler */
    float a = sink + 0.5f;
    for (int u = 0; u < us; ++u)
        for (int i = 0; i < 700; ++i) {
            a = a * 0.9999f + 0.0001f;
            __asm__ volatile("" : "+x"(a));
        }
    sink = a;
}

static long futex(_Atomic int *addr, int op, int val) { return syscall(SYS_futex, addr, op, val, NULL, NULL, 0); }

typedef struct {
    _Atomic int gen, next, done, stop;
    _Atomic int holding[THREADS], moved[THREADS];
    pid_t tid[THREADS];
    int migrate;
} Pool;
static Pool pool;

static void all_cpus(void) {
    cpu_set_t s;
    CPU_ZERO(&s);
    for (int c = 0; c < CPU_SETSIZE && c < 64; ++c) CPU_SET(c, &s);
    sched_setaffinity(0, sizeof s, &s);
}

static void take_items(int me) {
    while (atomic_fetch_add(&pool.next, 1) < ITEMS) {
        atomic_store(&pool.holding[me], 1);
        work(ITEM_US);
        atomic_store(&pool.holding[me], 0);
        if (atomic_fetch_add(&pool.done, 1) + 1 == ITEMS) futex(&pool.done, FUTEX_WAKE_PRIVATE, THREADS);
    }
    if (atomic_exchange(&pool.moved[me], 0)) all_cpus();
}

static void move_holders_here(int me) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(sched_getcpu(), &s);
    for (int t = 0; t < THREADS; ++t)
        if (t != me && atomic_load(&pool.holding[t]) && sched_setaffinity(pool.tid[t], sizeof s, &s) == 0)
            atomic_store(&pool.moved[t], 1);
}

static void wait_done(int me) {
    const double t0 = now();
    for (int spins = 0, d; (d = atomic_load(&pool.done)) < ITEMS;) {
        _mm_pause();
        if (++spins % 64 || now() - t0 < SPIN_S) continue;
        if (pool.migrate) move_holders_here(me);
        futex(&pool.done, FUTEX_WAIT_PRIVATE, d);
    }
}

static void *helper(void *arg) {
    pool.tid[1] = (pid_t)syscall(SYS_gettid);
    for (int seen = 0; !atomic_load(&pool.stop);) {
        const double t0 = now();
        for (int spins = 0; atomic_load(&pool.gen) == seen && !atomic_load(&pool.stop);) {
            _mm_pause();
            if (++spins % 64 == 0 && now() - t0 > 2e-3) futex(&pool.gen, FUTEX_WAIT_PRIVATE, seen);
        }
        seen = atomic_load(&pool.gen);
        take_items(1);
    }
    return arg;
}

static void pool_region(void) {
    atomic_store(&pool.done, 0); /* before next: a late helper's item of this region must count */
    atomic_store(&pool.next, 0);
    atomic_fetch_add(&pool.gen, 1);
    futex(&pool.gen, FUTEX_WAKE_PRIVATE, THREADS);
    take_items(0);
    wait_done(0);
}

static void omp_region(void) {
#pragma omp parallel for schedule(static) num_threads(THREADS)
    for (int i = 0; i < ITEMS; ++i) work(ITEM_US);
}

static int team(const char *name, double seconds) {
    const int use_pool = strcmp(name, "omp") != 0;
    pthread_t th;
    pool.migrate = strcmp(name, "migrate") == 0;
    if (use_pool) {
        pool.tid[0] = (pid_t)syscall(SYS_gettid);
        pthread_create(&th, NULL, helper, NULL);
    }
    const double t0 = now();
    long steps = 0;
    for (; now() - t0 < seconds; ++steps)
        for (int r = 0; r < REGIONS; ++r) use_pool ? pool_region() : omp_region();
    const double el = now() - t0;
    printf("%s steps/s %.2f (step %.1f ms)\n", name, (double)steps / el, 1e3 * el / (double)steps);
    if (use_pool) {
        atomic_store(&pool.stop, 1);
        atomic_fetch_add(&pool.gen, 1);
        futex(&pool.gen, FUTEX_WAKE_PRIVATE, THREADS);
        pthread_join(th, NULL);
    }
    return 0;
}

static int noise(double busy_s, double sleep_us, double seconds, int batch, int niceness) {
    struct sched_param p = {0};
    if (batch) sched_setscheduler(0, SCHED_BATCH, &p);
    setpriority(PRIO_PROCESS, 0, niceness);
    srand((unsigned)getpid());
    const double t0 = now();
    while (now() - t0 < seconds) {
        const double b = clock_s(CLOCK_THREAD_CPUTIME_ID);
        while (clock_s(CLOCK_THREAD_CPUTIME_ID) - b < busy_s) continue;
        usleep((useconds_t)(rand() / (double)RAND_MAX * sleep_us));
    }
    fprintf(stderr, "noise cores %.3f\n", clock_s(CLOCK_THREAD_CPUTIME_ID) / (now() - t0));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 7 && strcmp(argv[1], "noise") == 0)
        return noise(atof(argv[2]) * 1e-6, atof(argv[3]), atof(argv[4]), argv[5][0] == 'b', atoi(argv[6]));
    if (argc == 3 && (!strcmp(argv[1], "omp") || !strcmp(argv[1], "dynamic") || !strcmp(argv[1], "migrate")))
        return team(argv[1], atof(argv[2]));
    fprintf(stderr, "usage: stall_probe omp|dynamic|migrate SECONDS | noise BUSY_US SLEEP_US SECONDS batch|other NICE\n");
    return 2;
}
