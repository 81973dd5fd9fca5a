/* The floor under croupier's read pool: random small preads of files on one storage,
 * `inflight` at a time, with no Python and no hand-off.
 *
 *   rawreads threads|io_uring READS INFLIGHT SIZE SEED FILE...
 *
 * threads:  INFLIGHT threads, each doing blocking preads back to back (what a pool costs
 *           at the least: one blocked thread per read in flight).
 * io_uring: one thread keeping INFLIGHT reads queued on a ring (built only with liburing:
 *           -DWITH_URING -luring).
 * Prints one JSON line: reads, seconds, user and system CPU seconds of the process (the
 * kernel's io_uring workers belong to it and are counted).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef WITH_URING
#include <liburing.h>
#endif

static int fds[256], nfiles;
static long long span; /* reads fall in [0, span) of each file */
static long reads, size, next_read;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static unsigned long long step(unsigned long long *s) { /* xorshift64 */
    *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s;
}

static void *reader(void *arg) {
    unsigned long long s = (unsigned long long)(size_t)arg * 0x9E3779B97F4A7C15ULL + 1;
    char *buf = malloc((size_t)size);
    for (;;) {
        pthread_mutex_lock(&mu);
        long i = next_read++;
        pthread_mutex_unlock(&mu);
        if (i >= reads) break;
        unsigned long long r = step(&s);
        if (pread(fds[(r >> 40) % nfiles], buf, (size_t)size, (off_t)(r % span)) < 0) { perror("pread"); exit(1); }
    }
    free(buf);
    return NULL;
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }

int main(int argc, char **argv) {
    if (argc < 7) { fprintf(stderr, "usage: %s threads|io_uring READS INFLIGHT SIZE SEED FILE...\n", argv[0]); return 2; }
    const char *mode = argv[1];
    reads = atol(argv[2]);
    int inflight = atoi(argv[3]);
    size = atol(argv[4]);
    unsigned long long seed = strtoull(argv[5], NULL, 10) + 1;
    nfiles = argc - 6 < 256 ? argc - 6 : 256;
    span = -1;
    for (int i = 0; i < nfiles; i++) {
        fds[i] = open(argv[6 + i], O_RDONLY);
        if (fds[i] < 0) { perror(argv[6 + i]); return 1; }
        posix_fadvise(fds[i], 0, 0, POSIX_FADV_RANDOM);
        struct stat st;
        fstat(fds[i], &st);
        if (span < 0 || st.st_size - size < span) span = st.st_size - size;
    }
    if (span <= 0 || inflight < 1 || inflight > 4096) { fprintf(stderr, "files too small or bad INFLIGHT\n"); return 2; }
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    double t0 = now();
    if (!strcmp(mode, "threads")) {
        pthread_t *t = calloc((size_t)inflight, sizeof *t);
        for (int i = 0; i < inflight; i++) pthread_create(&t[i], NULL, reader, (void *)(size_t)(seed * 4096 + i));
        for (int i = 0; i < inflight; i++) pthread_join(t[i], NULL);
    } else if (!strcmp(mode, "io_uring")) {
#ifdef WITH_URING
        struct io_uring ring;
        if (io_uring_queue_init((unsigned)inflight * 2, &ring, 0)) { perror("io_uring_queue_init"); return 1; }
        unsigned workers[2] = {(unsigned)inflight, (unsigned)inflight}; /* bounded, unbound */
        io_uring_register_iowq_max_workers(&ring, workers);
        char *bufs = malloc((size_t)inflight * (size_t)size);
        long submitted = 0, done = 0;
        int queued = 0;
        unsigned long long s = seed;
        while (done < reads) {
            while (queued < inflight && submitted < reads) {
                struct io_uring_sqe *e = io_uring_get_sqe(&ring);
                unsigned long long r = step(&s);
                io_uring_prep_read(e, fds[(r >> 40) % nfiles], bufs + (size_t)(submitted % inflight) * (size_t)size,
                                   (unsigned)size, (off_t)(r % span));
                submitted++, queued++;
            }
            io_uring_submit_and_wait(&ring, 1);
            struct io_uring_cqe *cqe;
            unsigned head, n = 0;
            io_uring_for_each_cqe(&ring, head, cqe) {
                if (cqe->res < 0) { fprintf(stderr, "read: %s\n", strerror(-cqe->res)); return 1; }
                n++;
            }
            io_uring_cq_advance(&ring, n);
            done += n, queued -= (int)n;
        }
#else
        fprintf(stderr, "built without liburing\n");
        return 3;
#endif
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    double dt = now() - t0;
    getrusage(RUSAGE_SELF, &r1);
    double user = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) + (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1e6;
    double sys = (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) + (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e6;
    printf("{\"reads\": %ld, \"seconds\": %.6f, \"user_s\": %.6f, \"system_s\": %.6f}\n", reads, dt, user, sys);
    return 0;
}
