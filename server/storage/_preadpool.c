/* Blocking preads on native threads that never take the GIL, completions handed to the
 * event loop through an eventfd.
 *
 * Why: a pread on a slow file system blocks its thread for the storage's latency, so a
 * read in flight needs a thread. Python threads must take the GIL after every read, and
 * with hundreds of them the hand-offs cost more CPU than the reads (measured: 75% of
 * the server's CPU in the pool's loop). Here a worker only touches the GIL-free job
 * queues; the loop thread submits (one C call) and drains (one C call per wake-up).
 *
 * A job goes straight to an idle thread, woken by its own semaphore; a thread that
 * finishes takes a queued job before it sleeps. One condition variable shared by
 * hundreds of sleepers cost about 40% more CPU per read (woken threads fought over the
 * mutex; measured on the latency FS, bench/results/readpool.md). io_uring was
 * measured too and cost more: FUSE reads cannot complete inline, so io_uring hands each
 * to a kernel worker thread, which blocks like ours, plus its own bookkeeping.
 *
 * Pool(max_threads) -> pool
 *   pool.submit_ranges(token0, fd | mapping, [(offset, size), ...][, align])
 *                                               range i as token0 + i: preads of an open fd,
 *                                               copies out of a read-only mapping (see below),
 *                                               or (align > 0) reads of an fd opened with
 *                                               O_DIRECT (see below); one call for them all
 *   pool.submit_path(token, path, offset, size[, roots])
 *                                               open + pread + close (size -1: whole file);
 *                                               with roots, -EXDEV if the file opened lies
 *                                               outside them
 *   pool.submit_whole(token, path[, roots])      the whole file, and which file it was:
 *                                               (bytes, real, dev, ino, size, mtime_ns)
 *   pool.submit_files(token0, [path, ...], kind[, roots])
 *                                               file i as token0 + i, one call for a group:
 *                                               kind 0 its bytes, 1 as submit_whole, 2 as
 *                                               submit_identify
 *   pool.submit_identify(token, path[, roots])   which file `path` names now, without
 *                                               reading it: (real, dev, ino, size, mtime_ns)
 *                                               (opened O_PATH: no open request on FUSE)
 *   pool.fileno() -> eventfd, readable when completions wait
 *   pool.drain() -> [(token, bytes | tuple | -errno), ...]
 *   pool.latency                                a moving mean of the jobs' seconds, queued to
 *                                               done (the loop paces its drains by it)
 *   pool.close()
 * Threads start on demand, up to max_threads, and stay.
 *
 * The second read path: Mapping(fd) maps a file read-only (MADV_RANDOM: a row faults in
 * its own page, not 128 KB of read-around), and submit_ranges copies ranges out of it on a
 * pool thread, so the page faults are taken there, never on the event loop. Why: on FUSE
 * a buffered pread reaches the daemon as a *background* request, capped per mount by
 * max_background (kernel default 12), while a page fault is a synchronous request,
 * outside that cap (issue 21: 1,600 vs 8,600 reads/s at 5 ms from 256 threads). A file
 * truncated under the mapping raises SIGBUS in the copying thread: a handler installed
 * once jumps back out of that copy (a per-thread sigsetjmp guard), and the read ends
 * like a pread at the end of the file (fewer bytes, which the formats report as a
 * truncated file), or EIO; a SIGBUS outside a guarded copy goes to the handler that was
 * there before. A range past the mapped length (the file grew) is read with pread.
 *
 * The third path: submit_ranges with an align reads an fd opened with O_DIRECT (no page cache; on FUSE
 * each read goes to the daemon as one request of the size asked, not page by page). O_DIRECT
 * wants offset and size aligned (ext4, xfs: the logical block, 512 or 4096; FUSE: nothing),
 * and the buffer too: the thread reads the `align`-aligned range around the asked bytes
 * into a page-aligned buffer and moves those bytes to its start. direct_alignment(fd, size)
 * finds the smallest of 1, 512, 4096 a file accepts (one test read each).
 *
 * read_nowait(fd, ranges, max_bytes): ranges read on the calling thread from the page cache
 * alone (RWF_NOWAIT), or None where any is not there (see below).
 *
 * measure(fd, mapping | None, offsets, size, concurrency[, align]) -> (seconds, errors,
 * threads, seconds_dry, done_dry, cpu_seconds): that many reads, `concurrency` at once on
 * threads of its own (the store's probe of a mount; align > 0: fd is O_DIRECT, read as
 * above); *_dry: when the last read started, and how many had ended by then (a
 * steady-state rate, without the slowest reads' tail); cpu_seconds: the CPU those threads
 * used, theirs alone (the process's CPU clock would count a busy server's other threads,
 * and a probe beside them would read its reads as CPU-bound).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <semaphore.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A read-only mapping of a file, shared by the Python object and the jobs reading it:
 * unmapped when the last of them lets go. */
typedef struct mapping {
    atomic_int refs;
    char *addr; /* NULL for an empty file */
    size_t len;
    int fd;     /* its own dup: ranges past `len` and the size after a fault */
} mapping;

static void mapping_release(mapping *m) {
    if (atomic_fetch_sub(&m->refs, 1) != 1) return;
    if (m->addr) munmap(m->addr, m->len);
    close(m->fd);
    free(m);
}

typedef struct job {
    struct job *next;
    mapping *map;     /* non-NULL: copy out of this mapping */
    long long token;
    int fd;           /* -1: open `path` */
    char *path;
    long long offset;
    long long size;   /* -1: to the end of the file */
    char *buf;
    long long got;
    int err;          /* errno, 0 when fine */
    char *roots;      /* path jobs: NUL-separated folders the opened file must lie in, or NULL */
    size_t roots_len;
    long long align;  /* > 0: fd is opened with O_DIRECT, read in ranges aligned to this */
    int kind;         /* JOB_READ, or path jobs that also say which file they read (the cache's keys) */
    struct stat st;   /* JOB_WHOLE, JOB_IDENTIFY: the file opened; st_size -1 if it changed while read */
    char *real;       /* JOB_WHOLE, JOB_IDENTIFY: its resolved path (the kernel's name for the fd) */
    long long t0_ns;  /* when it was queued: its latency, as the loop sees it, ends when it is done */
} job;

enum { JOB_READ = 0, JOB_WHOLE = 1, JOB_IDENTIFY = 2 };

/* One native thread: sleeps on its own semaphore until `next` is handed to it. */
typedef struct reader {
    struct reader *next_idle;
    sem_t wake;
    job *next;
    void *pool;
} reader;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    reader *idle_head; /* threads asleep, waiting for a job */
    job *todo_head, *todo_tail; /* jobs no thread was free for */
    job *done_head, *done_tail;
    int efd;
    int threads, max_threads, closing;
    long long pending; /* submitted and not drained (loop thread only) */
    double latency_s;  /* moving mean of the jobs' latency, queued to done (under mu) */
} Pool;

static long long monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Jobs in the moving mean of the latency: a mount's pace, not one slow read's. */
#define LATENCY_WINDOW 64.0

/* The kernel's name for the open file `fd` lies in one of `roots` (NUL-separated, each a
 * resolved folder): checked on the file opened, so a link swapped after any earlier
 * check cannot send the read elsewhere. */
static ssize_t fd_real_path(int fd, char real[PATH_MAX + 1]) {
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(proc, real, PATH_MAX);
    real[n > 0 ? n : 0] = 0;
    return n;
}

static int real_under_roots(const char *real, ssize_t n, const char *roots, size_t roots_len) {
    if (n <= 0) return 0;
    for (const char *r = roots; r < roots + roots_len; r += strlen(r) + 1) {
        size_t rl = strlen(r);
        if (rl == 0) continue;
        if ((size_t)n == rl && memcmp(real, r, rl) == 0) return 1;
        if ((size_t)n > rl && memcmp(real, r, rl) == 0 && (real[rl] == '/' || r[rl - 1] == '/')) return 1;
    }
    return 0;
}

/* ---- SIGBUS guard around copies out of a mapping ------------------------------ */

static __thread sigjmp_buf *volatile copy_guard; /* set only while this thread copies */
static struct sigaction prev_sigbus;
static pthread_mutex_t sigbus_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *g = copy_guard;
    if (g) { /* a guarded copy touched a page past the file's end: back out of it */
        copy_guard = NULL;
        siglongjmp(*g, 1);
    }
    /* Not ours: hand the signal to the handler that was there before us. */
    sigaction(SIGBUS, &prev_sigbus, NULL);
    if (si == NULL || si->si_code <= 0) raise(sig); /* sent, not a fault: send it again */
    /* a fault: returning runs the faulting instruction again, under that handler */
    (void)uc;
}

/* Install on_sigbus unless it is the handler now (faulthandler, say, installed its own
 * since): called with the GIL held, before any mapping is read. */
static int ensure_sigbus_handler(void) {
    pthread_mutex_lock(&sigbus_mu);
    struct sigaction cur;
    int rc = sigaction(SIGBUS, NULL, &cur);
    if (rc == 0 && !((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER; /* NODEFER: no mask to restore after the jump */
        sigemptyset(&sa.sa_mask);
        prev_sigbus = cur;
        rc = sigaction(SIGBUS, &sa, NULL);
    }
    pthread_mutex_unlock(&sigbus_mu);
    return rc;
}

/* memcpy that returns -1 instead of dying when a page of `src` is past the file's end. */
static int guarded_copy(char *dst, const char *src, size_t n) {
    sigjmp_buf env;
    if (sigsetjmp(env, 0)) return -1; /* copy_guard was cleared by the handler */
    copy_guard = &env;
    atomic_signal_fence(memory_order_seq_cst);
    memcpy(dst, src, n);
    atomic_signal_fence(memory_order_seq_cst);
    copy_guard = NULL;
    return 0;
}

static void pread_into(job *j, int fd);

/* A range out of the mapping: copied (its pages faulted in on this thread), or read with
 * pread when it lies past the mapped length. A fault past the file's end (truncated
 * under the mapping) ends the read short, as a pread at the end of the file would. */
static void map_job(job *j) {
    mapping *m = j->map;
    if (j->size < 0 || m->addr == NULL || (unsigned long long)j->offset + (unsigned long long)j->size > m->len) {
        pread_into(j, m->fd);
        return;
    }
    j->buf = malloc(j->size > 0 ? (size_t)j->size : 1);
    if (!j->buf) { j->err = ENOMEM; return; }
    if (guarded_copy(j->buf, m->addr + j->offset, (size_t)j->size) == 0) { j->got = j->size; return; }
    struct stat st;
    if (fstat(m->fd, &st) != 0) { j->err = errno; return; }
    long long avail = st.st_size > j->offset ? st.st_size - j->offset : 0;
    if (avail >= j->size) { j->err = EIO; return; } /* a fault inside the file: an I/O error */
    if (avail > 0 && guarded_copy(j->buf, m->addr + j->offset, (size_t)avail) != 0) { j->err = EIO; return; }
    j->got = avail;
}

static void pread_into(job *j, int fd) {
    if (j->size < 0) {
        struct stat st;
        if (fstat(fd, &st) != 0) { j->err = errno; return; }
        j->size = st.st_size > j->offset ? st.st_size - j->offset : 0;
    }
    j->buf = malloc(j->size > 0 ? (size_t)j->size : 1);
    if (!j->buf) { j->err = ENOMEM; return; }
    while (j->got < j->size) { /* pread may return less than asked (signals, some file systems) */
        ssize_t n = pread(fd, j->buf + j->got, (size_t)(j->size - j->got), (off_t)(j->offset + j->got));
        if (n < 0) { if (errno == EINTR) continue; j->err = errno; break; }
        if (n == 0) break; /* end of file: the caller sees fewer bytes */
        j->got += n;
    }
}

/* Buffers of O_DIRECT reads: page-aligned, which every file system accepts. */
#define DIRECT_MEM_ALIGN 4096

/* `size` bytes at `offset` of `fd` (opened with O_DIRECT): the `align`-aligned range around
 * them read into an aligned buffer, the asked bytes moved to its start. Returns 0 or an
 * errno; *got is less than `size` at the end of the file. */
static int direct_read(int fd, long long offset, long long size, long long align, char **out, long long *got) {
    long long start = offset - offset % align;
    long long end = (offset + size + align - 1) / align * align;
    size_t len = (size_t)(end - start);
    char *buf = NULL;
    if (posix_memalign((void **)&buf, DIRECT_MEM_ALIGN, len > 0 ? len : DIRECT_MEM_ALIGN) != 0) return ENOMEM;
    size_t have = 0;
    while (have < len) {
        ssize_t n = pread(fd, buf + have, len - have, (off_t)(start + (long long)have));
        if (n < 0) { if (errno == EINTR) continue; int e = errno; free(buf); return e; }
        if (n == 0) break;
        have += (size_t)n;
        if (have % (size_t)align) break; /* short, off a boundary: the end of the file */
    }
    long long skip = offset - start, g = (long long)have > skip ? (long long)have - skip : 0;
    if (g > size) g = size;
    if (skip > 0 && g > 0) memmove(buf, buf + skip, (size_t)g);
    *out = buf;
    *got = g;
    return 0;
}

static void direct_job(job *j) {
    if (j->size < 0) {
        struct stat st;
        if (fstat(j->fd, &st) != 0) { j->err = errno; return; }
        j->size = st.st_size > j->offset ? st.st_size - j->offset : 0;
    }
    j->err = direct_read(j->fd, j->offset, j->size, j->align, &j->buf, &j->got);
}

/* Open a path job's file (O_PATH for JOB_IDENTIFY: a name resolved, nothing opened on
 * the file system), check it, and keep which file it is for the kinds that say so. */
/* The open file `fd` of a path job (or of files_nowait) checked: its resolved path `real`
 * (`*n` bytes; read where there are roots or the kind says which file) under `roots`, and
 * a regular file (`*st`). 0, or the errno its read fails with. */
static int check_opened(int fd, int kind, const char *roots, size_t roots_len, char real[PATH_MAX + 1], ssize_t *n,
                        struct stat *st) {
    if (*n > 0) roots = NULL; /* `real` known: built beneath a folder checked under the roots (files_nowait) */
    else *n = roots || kind != JOB_READ ? fd_real_path(fd, real) : 0;
    if (roots && !real_under_roots(real, *n, roots, roots_len)) return EXDEV;
    if (kind != JOB_READ && *n <= 0) return errno ? errno : ENOENT;
    if (fstat(fd, st) != 0) return errno;
    if (!S_ISREG(st->st_mode)) return EISDIR;
    return 0;
}

/* The file `fd` still has the size and mtime of `st` (else it changed while it was read). */
static int unchanged_since(int fd, const struct stat *st) {
    struct stat now;
    return fstat(fd, &now) == 0 && now.st_size == st->st_size && now.st_mtim.tv_sec == st->st_mtim.tv_sec
           && now.st_mtim.tv_nsec == st->st_mtim.tv_nsec;
}

static int open_checked(job *j) {
    /* O_NONBLOCK: a FIFO named like a data file must not block this thread in open(). */
    int flags = j->kind == JOB_IDENTIFY ? O_PATH | O_CLOEXEC : O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
    int fd = open(j->path, flags);
    if (fd < 0) { j->err = errno; return -1; }
    char real[PATH_MAX + 1];
    ssize_t n = 0;
    struct stat st;
    j->err = check_opened(fd, j->kind, j->roots, j->roots_len, real, &n, &st);
    if (!j->err && j->kind != JOB_READ && !(j->real = strndup(real, (size_t)n))) j->err = ENOMEM;
    if (j->err) { close(fd); return -1; }
    if (j->kind != JOB_READ) j->st = st;
    if (j->size < 0) j->size = st.st_size > j->offset ? st.st_size - j->offset : 0;
    return fd;
}

static void run_job(job *j) {
    if (j->map) { map_job(j); return; }
    if (j->align > 0) { direct_job(j); return; }
    int fd = j->fd, own = 0;
    if (fd < 0) {
        if ((fd = open_checked(j)) < 0) return;
        own = 1;
        if (j->kind == JOB_IDENTIFY) { close(fd); return; }
    }
    pread_into(j, fd);
    /* changed while read: these bytes are no version to keep */
    if (j->kind == JOB_WHOLE && !j->err && (!unchanged_since(fd, &j->st) || j->got != j->st.st_size))
        j->st.st_size = -1;
    if (own) close(fd);
}

static void push_todo(Pool *p, job *j) { /* with p->mu held */
    j->next = NULL;
    if (p->todo_tail) p->todo_tail->next = j; else p->todo_head = j;
    p->todo_tail = j;
}

static void *worker(void *arg) {
    reader *me = (reader *)arg;
    Pool *p = (Pool *)me->pool;
    /* A name of its own (else "python"), so per-thread CPU accounting can tell the readers apart. */
    pthread_setname_np(pthread_self(), "croupier-read");
    job *j = me->next; /* the job it was started for */
    while (j) {
        run_job(j);
        double took = (double)(monotonic_ns() - j->t0_ns) / 1e9;
        pthread_mutex_lock(&p->mu);
        p->latency_s += p->latency_s > 0 ? (took - p->latency_s) / LATENCY_WINDOW : took;
        int was_empty = p->done_head == NULL;
        j->next = NULL;
        if (p->done_tail) p->done_tail->next = j; else p->done_head = j;
        p->done_tail = j;
        j = p->todo_head; /* a queued job, else sleep until one is handed over */
        if (j) {
            p->todo_head = j->next;
            if (!p->todo_head) p->todo_tail = NULL;
        }
        int quit = !j && p->closing;
        if (!j && !quit) {
            me->next = NULL;
            me->next_idle = p->idle_head;
            p->idle_head = me;
        }
        pthread_mutex_unlock(&p->mu);
        if (was_empty) { /* one wake-up of the loop per batch of completions */
            uint64_t one = 1;
            ssize_t w = write(p->efd, &one, sizeof one);
            (void)w;
        }
        if (!j && !quit) {
            while (sem_wait(&me->wake) != 0) {} /* EINTR */
            j = me->next; /* NULL: the pool closes */
        }
    }
    pthread_mutex_lock(&p->mu);
    p->threads--;
    pthread_mutex_unlock(&p->mu);
    sem_destroy(&me->wake);
    free(me);
    return NULL;
}

static int enqueue(Pool *p, job *j) {
    j->t0_ns = monotonic_ns();
    pthread_mutex_lock(&p->mu);
    if (p->closing) { pthread_mutex_unlock(&p->mu); return -1; }
    p->pending++;
    reader *r = p->idle_head;
    if (r) { /* straight to an idle thread */
        p->idle_head = r->next_idle;
        r->next = j;
        pthread_mutex_unlock(&p->mu);
        sem_post(&r->wake);
        return 0;
    }
    int start = p->threads < p->max_threads;
    if (start) p->threads++;
    else push_todo(p, j); /* the next thread to finish takes it */
    pthread_mutex_unlock(&p->mu);
    if (!start) return 0;
    int rc = -1;
    reader *nr = calloc(1, sizeof *nr);
    if (nr && sem_init(&nr->wake, 0, 0) == 0) {
        nr->pool = p;
        nr->next = j;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024); /* a pread loop needs little stack */
        pthread_t t;
        rc = pthread_create(&t, &attr, worker, nr);
        pthread_attr_destroy(&attr);
        if (rc != 0) sem_destroy(&nr->wake);
    }
    if (rc != 0) { /* the running threads take the job */
        free(nr);
        pthread_mutex_lock(&p->mu);
        p->threads--;
        push_todo(p, j);
        pthread_mutex_unlock(&p->mu);
    }
    return 0;
}

/* The smallest of 1, 512, 4096 that `fd` (opened with O_DIRECT) accepts as offset and size
 * alignment, by a test read at an offset of that alignment; 4096 when the file is too small
 * to tell (a short read at its end would prove nothing). */
static PyObject *direct_alignment(PyObject *mod, PyObject *args) {
    int fd;
    long long file_size;
    if (!PyArg_ParseTuple(args, "iL", &fd, &file_size)) return NULL;
    static const long long tries[] = {1, 512};
    long long found = 4096;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    char *buf = NULL;
    if (posix_memalign((void **)&buf, DIRECT_MEM_ALIGN, 4096) != 0) err = ENOMEM;
    for (size_t i = 0; !err && i < sizeof tries / sizeof *tries; i++) {
        long long a = tries[i];
        if (file_size < 2 * a) break;
        ssize_t n;
        do n = pread(fd, buf, (size_t)a, (off_t)a); while (n < 0 && errno == EINTR);
        if (n == a) { found = a; break; }
        if (n < 0 && errno != EINVAL) err = errno;
    }
    free(buf);
    Py_END_ALLOW_THREADS
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLongLong(found);
}

static PyObject *submit_path_job(Pool *p, long long token, PyObject *path_obj, long long offset, long long size,
                                 const char *roots, Py_ssize_t roots_len, int kind);

static PyObject *Pool_submit_path(Pool *p, PyObject *args) {
    long long token, offset, size;
    PyObject *path_obj;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    if (!PyArg_ParseTuple(args, "LO&LL|y#", &token, PyUnicode_FSConverter, &path_obj, &offset, &size, &roots,
                          &roots_len)) return NULL;
    return submit_path_job(p, token, path_obj, offset, size, roots, roots_len, JOB_READ);
}

static PyObject *submit_kind(Pool *p, PyObject *args, int kind) {
    long long token;
    PyObject *path_obj;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    if (!PyArg_ParseTuple(args, "LO&|y#", &token, PyUnicode_FSConverter, &path_obj, &roots, &roots_len)) return NULL;
    return submit_path_job(p, token, path_obj, 0, -1, roots, roots_len, kind);
}

static PyObject *Pool_submit_whole(Pool *p, PyObject *args) { return submit_kind(p, args, JOB_WHOLE); }

/* Files, file i as token0 + i, one call for a group of images, not one each: kind 0 reads
 * each whole (bytes, as submit_path with size -1), 1 whole and which file it was (as
 * submit_whole), 2 only which file each name leads to now (as submit_identify). */
static PyObject *Pool_submit_files(Pool *p, PyObject *args) {
    long long token0;
    PyObject *paths;
    int kind;
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    if (!PyArg_ParseTuple(args, "LOi|z#", &token0, &paths, &kind, &roots, &roots_len)) return NULL;
    if (kind < JOB_READ || kind > JOB_IDENTIFY) { PyErr_Format(PyExc_ValueError, "no kind of file job %d", kind); return NULL; }
    PyObject *seq = PySequence_Fast(paths, "paths must be a sequence of paths");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *path_obj = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &path_obj)) { Py_DECREF(seq); return NULL; }
        PyObject *r = submit_path_job(p, token0 + i, path_obj, 0, -1, roots, roots_len, kind);
        if (!r) { Py_DECREF(seq); return NULL; } /* files before i are in flight: the caller's tokens say which */
        Py_DECREF(r);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}
static PyObject *Pool_submit_identify(Pool *p, PyObject *args) { return submit_kind(p, args, JOB_IDENTIFY); }

/* Takes the reference to path_obj (an FS-converted bytes). */
static PyObject *submit_path_job(Pool *p, long long token, PyObject *path_obj, long long offset, long long size,
                                 const char *roots, Py_ssize_t roots_len, int kind) {
    if (offset < 0) { Py_DECREF(path_obj); PyErr_SetString(PyExc_ValueError, "offset must not be negative"); return NULL; }
    job *j = calloc(1, sizeof *j);
    if (!j) { Py_DECREF(path_obj); return PyErr_NoMemory(); }
    j->path = strdup(PyBytes_AS_STRING(path_obj));
    Py_DECREF(path_obj);
    if (!j->path) { free(j); return PyErr_NoMemory(); }
    if (roots) {
        j->roots = malloc((size_t)roots_len + 1);
        if (!j->roots) { free(j->path); free(j); return PyErr_NoMemory(); }
        memcpy(j->roots, roots, (size_t)roots_len);
        j->roots[roots_len] = 0;
        j->roots_len = (size_t)roots_len;
    }
    j->token = token; j->fd = -1; j->offset = offset; j->size = size; j->kind = kind;
    if (enqueue(p, j) != 0) { free(j->roots); free(j->path); free(j); PyErr_SetString(PyExc_RuntimeError, "the read pool is closed"); return NULL; }
    Py_RETURN_NONE;
}

/* ---- Mapping: the Python face of a `mapping` ------------------------------------ */

typedef struct {
    PyObject_HEAD
    mapping *m; /* NULL once closed */
    long long size;
} Mapping;

static PyTypeObject MappingType;

static int Mapping_init(Mapping *self, PyObject *args, PyObject *kwds) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return -1;
    if (self->m) { PyErr_SetString(PyExc_RuntimeError, "Mapping already initialised"); return -1; }
    if (ensure_sigbus_handler() != 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    struct stat st;
    if (fstat(fd, &st) != 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    if (!S_ISREG(st.st_mode)) { errno = EISDIR; PyErr_SetFromErrno(PyExc_OSError); return -1; }
    mapping *m = calloc(1, sizeof *m);
    if (!m) { PyErr_NoMemory(); return -1; }
    m->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (m->fd < 0) { free(m); PyErr_SetFromErrno(PyExc_OSError); return -1; }
    m->len = (size_t)st.st_size;
    if (m->len > 0) {
        void *a = mmap(NULL, m->len, PROT_READ, MAP_SHARED, m->fd, 0);
        if (a == MAP_FAILED) { int e = errno; close(m->fd); free(m); errno = e; PyErr_SetFromErrno(PyExc_OSError); return -1; }
        madvise(a, m->len, MADV_RANDOM); /* a fault reads its page, not 128 KB of read-around */
        m->addr = a;
    }
    atomic_init(&m->refs, 1);
    self->m = m;
    self->size = (long long)st.st_size;
    return 0;
}

static PyObject *Mapping_close(Mapping *self, PyObject *unused) {
    if (self->m) { mapping_release(self->m); self->m = NULL; } /* reads in flight keep it mapped */
    Py_RETURN_NONE;
}

static void Mapping_dealloc(Mapping *self) {
    if (self->m) mapping_release(self->m);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Mapping_get_size(Mapping *self, void *closure) { return PyLong_FromLongLong(self->size); }
static PyObject *Mapping_get_closed(Mapping *self, void *closure) { return PyBool_FromLong(self->m == NULL); }

static PyMethodDef Mapping_methods[] = {
    {"close", (PyCFunction)Mapping_close, METH_NOARGS, "unmap once the reads in flight on it are done"},
    {NULL}};

static PyGetSetDef Mapping_getset[] = {
    {"size", (getter)Mapping_get_size, NULL, "bytes mapped (the file's size when mapped)", NULL},
    {"closed", (getter)Mapping_get_closed, NULL, "close() was called", NULL},
    {NULL}};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "croupier.server.storage._preadpool.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mapping(fd): a read-only MAP_SHARED mapping of the file (MADV_RANDOM), for submit_ranges.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mapping_init,
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_methods = Mapping_methods,
    .tp_getset = Mapping_getset,
};

/* Many ranges of one file in one call (issue 21 item 4: one crossing of the native boundary
 * per group of rows, not one per range): `target` a Mapping (copies out of it), or an fd
 * (preads; O_DIRECT ranges aligned to `align` when it is above 0); `ranges` a sequence of
 * (offset, size); range i gets token `token0 + i`. Every range is checked before any is
 * queued, so a bad one queues nothing. */
static PyObject *Pool_submit_ranges(Pool *p, PyObject *args) {
    long long token0, align = 0;
    PyObject *target, *ranges;
    if (!PyArg_ParseTuple(args, "LOO|L", &token0, &target, &ranges, &align)) return NULL;
    mapping *map = NULL;
    int fd = -1;
    if (PyObject_TypeCheck(target, &MappingType)) {
        map = ((Mapping *)target)->m;
        if (!map) { PyErr_SetString(PyExc_ValueError, "the mapping is closed"); return NULL; }
        if (align != 0) { PyErr_SetString(PyExc_ValueError, "a mapping's ranges take no alignment"); return NULL; }
    } else {
        long v = PyLong_AsLong(target);
        if (v == -1 && PyErr_Occurred()) return NULL;
        fd = v > INT_MAX ? -1 : (int)v;
        if (fd < 0 || align < 0) { PyErr_SetString(PyExc_ValueError, "fd and align must not be negative"); return NULL; }
    }
    PyObject *seq = PySequence_Fast(ranges, "ranges must be a sequence of (offset, size)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long *spans = PyMem_Malloc(sizeof(long long) * 2 * (size_t)(n ? n : 1));
    if (!spans) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError, "range %zd is not an (offset, size) tuple", i);
            goto fail;
        }
        spans[2 * i] = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0));
        spans[2 * i + 1] = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
        if (PyErr_Occurred()) goto fail;
        if (spans[2 * i] < 0) { PyErr_Format(PyExc_ValueError, "range %zd: offset must not be negative", i); goto fail; }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        job *j = calloc(1, sizeof *j);
        if (!j) { PyErr_NoMemory(); goto fail; }
        j->token = token0 + i; j->fd = fd; j->offset = spans[2 * i]; j->size = spans[2 * i + 1];
        j->align = align; j->map = map;
        if (map) atomic_fetch_add(&map->refs, 1);
        if (enqueue(p, j) != 0) {
            if (map) mapping_release(map);
            free(j);
            PyErr_SetString(PyExc_RuntimeError, "the read pool is closed");
            goto fail;
        }
    }
    PyMem_Free(spans);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    PyMem_Free(spans);
    Py_DECREF(seq);
    return NULL;
}

/* ---- measure: reads at a given concurrency, timed (the store's probe) ---------------- */

typedef struct {
    int fd;
    mapping *map;
    const long long *offsets;
    long long n, size, align; /* align > 0: fd is O_DIRECT */
    atomic_llong next, errors, done;
    atomic_int dry;           /* set by the first thread to find no read left to start */
    struct timespec t0, t_dry;
    long long done_at_dry;    /* reads completed by then: the rest were in flight */
    atomic_llong cpu_ns;      /* CPU the workers used, summed over them */
} probe;

static long long thread_cpu_ns(void) {
    struct timespec t;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t) != 0) return 0;
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *probe_worker(void *arg) {
    probe *pr = (probe *)arg;
    long long cpu0 = thread_cpu_ns();
    char *buf = malloc(pr->size > 0 ? (size_t)pr->size : 1);
    if (!buf) { atomic_fetch_add(&pr->errors, 1); return NULL; }
    for (;;) {
        long long i = atomic_fetch_add(&pr->next, 1);
        if (i >= pr->n) {
            if (!atomic_exchange(&pr->dry, 1)) {
                clock_gettime(CLOCK_MONOTONIC, &pr->t_dry);
                pr->done_at_dry = atomic_load(&pr->done);
            }
            break;
        }
        long long off = pr->offsets[i];
        int bad;
        if (pr->map && pr->map->addr && (unsigned long long)(off + pr->size) <= pr->map->len)
            bad = guarded_copy(buf, pr->map->addr + off, (size_t)pr->size) != 0;
        else if (pr->align > 0) {
            char *dbuf = NULL;
            long long got = 0;
            bad = direct_read(pr->fd, off, pr->size, pr->align, &dbuf, &got) != 0;
            free(dbuf);
        } else
            bad = pread(pr->fd, buf, (size_t)pr->size, (off_t)off) < 0;
        if (bad) atomic_fetch_add(&pr->errors, 1);
        atomic_fetch_add(&pr->done, 1);
    }
    free(buf);
    atomic_fetch_add(&pr->cpu_ns, thread_cpu_ns() - cpu0);
    return NULL;
}

/* `concurrency` threads of `worker(arg)`, waited for (none started: it runs on this thread);
 * `t0` is set just before they start, `t1` once the last ends. Call without the GIL.
 * Returns the threads started (at least 1: this one). */
static int run_workers(void *(*worker)(void *), void *arg, int concurrency, size_t stack, struct timespec *t0,
                       struct timespec *t1) {
    pthread_t *ts = calloc((size_t)concurrency, sizeof *ts);
    int started = 0;
    clock_gettime(CLOCK_MONOTONIC, t0);
    if (ts) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, stack);
        for (; started < concurrency; started++)
            if (pthread_create(&ts[started], &attr, worker, arg) != 0) break;
        pthread_attr_destroy(&attr);
    }
    if (started == 0) worker(arg);
    for (int i = 0; i < started; i++) pthread_join(ts[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, t1);
    free(ts);
    return started > 0 ? started : 1;
}

static PyObject *measure(PyObject *mod, PyObject *args) {
    int fd, concurrency;
    PyObject *map_obj, *offsets_obj;
    long long size, align = 0;
    if (!PyArg_ParseTuple(args, "iOOLi|L", &fd, &map_obj, &offsets_obj, &size, &concurrency, &align)) return NULL;
    if (concurrency < 1 || size < 0 || align < 0) {
        PyErr_SetString(PyExc_ValueError, "concurrency must be >= 1, size >= 0, align >= 0");
        return NULL;
    }
    mapping *m = NULL;
    if (map_obj != Py_None) {
        if (!PyObject_TypeCheck(map_obj, &MappingType) || !((Mapping *)map_obj)->m) {
            PyErr_SetString(PyExc_TypeError, "mapping must be an open Mapping or None");
            return NULL;
        }
        m = ((Mapping *)map_obj)->m;
    }
    PyObject *seq = PySequence_Fast(offsets_obj, "offsets must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long *offs = malloc((size_t)(n > 0 ? n : 1) * sizeof *offs);
    if (!offs) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        offs[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (offs[i] < 0) { free(offs); Py_DECREF(seq); if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative offset"); return NULL; }
    }
    Py_DECREF(seq);
    if (m) atomic_fetch_add(&m->refs, 1);
    probe pr = {.fd = fd, .map = m, .offsets = offs, .n = n, .size = size, .align = m ? 0 : align};
    atomic_init(&pr.next, 0);
    atomic_init(&pr.errors, 0);
    atomic_init(&pr.done, 0);
    atomic_init(&pr.dry, 0);
    atomic_init(&pr.cpu_ns, 0);
    int started;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &pr.t0); /* run_workers' own t0 is a moment later: the dry time counts from here */
    Py_BEGIN_ALLOW_THREADS
    started = run_workers(probe_worker, &pr, concurrency, 64 * 1024, &t0, &t1);
    Py_END_ALLOW_THREADS
    t0 = pr.t0;
    free(offs);
    if (m) mapping_release(m);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    double dry = (double)(pr.t_dry.tv_sec - t0.tv_sec) + (double)(pr.t_dry.tv_nsec - t0.tv_nsec) / 1e9;
    return Py_BuildValue("(dLidLd)", secs, (long long)atomic_load(&pr.errors), started, dry,
                         pr.done_at_dry, (double)atomic_load(&pr.cpu_ns) / 1e9);
}

/* measure_files: whole files read by bare C threads (open, fstat, read to the end, close each),
 * `concurrency` at once: the floor of a reader of one file a sample (an ImageFolder) through
 * the same storage, by the same syscalls croupier's whole-file jobs make. */
typedef struct {
    char **paths;
    long long n;
    atomic_llong next, errors, bytes, skipped;
    atomic_llong left;  /* bytes the files may still take (max_bytes); a file that would pass it is not read */
    atomic_llong cpu_ns;
} files_probe;

static void *files_worker(void *arg) {
    files_probe *pr = (files_probe *)arg;
    long long cpu0 = thread_cpu_ns();
    size_t cap = 1 << 16;
    char *buf = malloc(cap);
    if (!buf) { atomic_fetch_add(&pr->errors, 1); return NULL; }
    for (;;) {
        long long i = atomic_fetch_add(&pr->next, 1);
        if (i >= pr->n) break;
        int fd;
        do fd = open(pr->paths[i], O_RDONLY | O_CLOEXEC); while (fd < 0 && errno == EINTR);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) { atomic_fetch_add(&pr->errors, 1); if (fd >= 0) close(fd); continue; }
        if (atomic_fetch_sub(&pr->left, (long long)st.st_size) < (long long)st.st_size) { /* over the bound: unread */
            atomic_fetch_add(&pr->left, (long long)st.st_size);
            atomic_fetch_add(&pr->skipped, 1);
            close(fd);
            continue;
        }
        long long got = 0;
        for (;;) {
            ssize_t r;
            do r = read(fd, buf, cap); while (r < 0 && errno == EINTR);
            if (r < 0) { atomic_fetch_add(&pr->errors, 1); break; }
            if (r == 0) break;
            got += r;
        }
        atomic_fetch_add(&pr->bytes, got);
        close(fd);
    }
    free(buf);
    atomic_fetch_add(&pr->cpu_ns, thread_cpu_ns() - cpu0);
    return NULL;
}

static PyObject *measure_files(PyObject *mod, PyObject *args) {
    PyObject *paths_obj;
    int concurrency;
    long long max_bytes = LLONG_MAX;
    if (!PyArg_ParseTuple(args, "Oi|L", &paths_obj, &concurrency, &max_bytes)) return NULL;
    if (max_bytes < 0) { PyErr_SetString(PyExc_ValueError, "max_bytes must not be negative"); return NULL; }
    if (concurrency < 1) { PyErr_SetString(PyExc_ValueError, "concurrency must be >= 1"); return NULL; }
    PyObject *seq = PySequence_Fast(paths_obj, "paths must be a sequence of paths");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    char **paths = calloc((size_t)(n > 0 ? n : 1), sizeof *paths);
    if (!paths) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &b)) goto fail;
        paths[i] = strdup(PyBytes_AS_STRING(b));
        Py_DECREF(b);
        if (!paths[i]) { PyErr_NoMemory(); goto fail; }
    }
    Py_DECREF(seq);
    seq = NULL;
    files_probe pr = {.paths = paths, .n = n};
    atomic_init(&pr.next, 0);
    atomic_init(&pr.errors, 0);
    atomic_init(&pr.bytes, 0);
    atomic_init(&pr.skipped, 0);
    atomic_init(&pr.left, max_bytes);
    atomic_init(&pr.cpu_ns, 0);
    int started;
    struct timespec t0, t1;
    Py_BEGIN_ALLOW_THREADS
    started = run_workers(files_worker, &pr, concurrency, 128 * 1024, &t0, &t1);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) free(paths[i]);
    free(paths);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    return Py_BuildValue("(dLiLdL)", secs, (long long)atomic_load(&pr.errors), started,
                         (long long)atomic_load(&pr.bytes), (double)atomic_load(&pr.cpu_ns) / 1e9,
                         (long long)atomic_load(&pr.skipped));
fail:
    Py_XDECREF(seq);
    for (Py_ssize_t i = 0; i < n; i++) free(paths[i]);
    free(paths);
    return NULL;
}

static void free_job(job *j) {
    if (j->map) mapping_release(j->map);
    free(j->roots);
    free(j->real);
    free(j->buf);
    free(j->path);
    free(j);
}

/* A finished job's result: its bytes, and for the kinds that say which file, that too. */
/* Which file it was, (real, dev, ino, size, mtime_ns), after `data` where given (stolen):
 * JOB_WHOLE's (data, real, ...) and JOB_IDENTIFY's (real, ...). */
static PyObject *file_value(PyObject *data, const char *real, const struct stat *st) {
    long long mtime_ns = (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    unsigned long long dev = (unsigned long long)st->st_dev, ino = (unsigned long long)st->st_ino;
    if (!data) return Py_BuildValue("(yKKLL)", real, dev, ino, (long long)st->st_size, mtime_ns);
    return Py_BuildValue("(NyKKLL)", data, real, dev, ino, (long long)st->st_size, mtime_ns);
}

static PyObject *job_value(job *j) {
    if (j->kind == JOB_IDENTIFY) return file_value(NULL, j->real, &j->st);
    PyObject *data = PyBytes_FromStringAndSize(j->buf, (Py_ssize_t)j->got);
    if (!data || j->kind == JOB_READ) return data;
    return file_value(data, j->real, &j->st);
}

static PyObject *Pool_drain(Pool *p, PyObject *unused) {
    uint64_t count;
    ssize_t r = read(p->efd, &count, sizeof count); /* nonblocking: EAGAIN when already drained */
    (void)r;
    pthread_mutex_lock(&p->mu);
    job *j = p->done_head;
    p->done_head = p->done_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    while (j) {
        job *next = j->next;
        PyObject *value = j->err ? PyLong_FromLong(-j->err) : job_value(j);
        PyObject *item = value ? Py_BuildValue("(LN)", j->token, value) : NULL;
        if (!item || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            while (j) { next = j->next; free_job(j); j = next; }
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
        p->pending--;
        free_job(j);
        j = next;
    }
    return out;
}

static PyObject *Pool_fileno(Pool *p, PyObject *unused) { return PyLong_FromLong(p->efd); }

static PyObject *Pool_close(Pool *p, PyObject *unused) {
    pthread_mutex_lock(&p->mu);
    p->closing = 1;
    reader *r = p->idle_head; /* wake the sleepers with no job: they exit */
    p->idle_head = NULL;
    pthread_mutex_unlock(&p->mu);
    while (r) {
        reader *n = r->next_idle;
        r->next = NULL;
        sem_post(&r->wake);
        r = n;
    }
    Py_RETURN_NONE;
}

static PyObject *Pool_get_threads(Pool *p, void *closure) {
    pthread_mutex_lock(&p->mu);
    int n = p->threads;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromLong(n);
}

static PyObject *Pool_get_pending(Pool *p, void *closure) { return PyLong_FromLongLong(p->pending); }

static PyObject *Pool_get_latency(Pool *p, void *closure) {
    pthread_mutex_lock(&p->mu);
    double s = p->latency_s;
    pthread_mutex_unlock(&p->mu);
    return PyFloat_FromDouble(s);
}

static int Pool_init(Pool *p, PyObject *args, PyObject *kwds) {
    int max_threads;
    if (!PyArg_ParseTuple(args, "i", &max_threads)) return -1;
    if (max_threads < 1) { PyErr_SetString(PyExc_ValueError, "max_threads must be at least 1"); return -1; }
    p->max_threads = max_threads;
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
    pthread_mutex_init(&p->mu, NULL);
    return 0;
}

static void Pool_dealloc(Pool *p) {
    /* Workers hold `p`: a pool is never freed while threads run. The store keeps its
     * pool for the life of the process after close(); this only runs for pools that
     * never started a thread. */
    if (p->threads == 0) {
        if (p->efd >= 0) close(p->efd);
        job *j = p->done_head;
        while (j) { job *n = j->next; free_job(j); j = n; }
        j = p->todo_head;
        while (j) { job *n = j->next; free_job(j); j = n; }
        Py_TYPE(p)->tp_free((PyObject *)p);
    }
}

static PyMethodDef Pool_methods[] = {
    {"submit_path", (PyCFunction)Pool_submit_path, METH_VARARGS, "submit_path(token, path, offset, size[, roots]): open, check, pread, close"},
    {"submit_whole", (PyCFunction)Pool_submit_whole, METH_VARARGS,
     "submit_whole(token, path[, roots]): the whole file and which it was: (bytes, real, dev, ino, size, mtime_ns)"},
    {"submit_files", (PyCFunction)Pool_submit_files, METH_VARARGS,
     "submit_files(token0, [path, ...], kind[, roots]): file i as token0 + i, one call; kind 0: bytes, 1: as "
     "submit_whole, 2: as submit_identify"},
    {"submit_identify", (PyCFunction)Pool_submit_identify, METH_VARARGS,
     "submit_identify(token, path[, roots]): which file path names now, unread: (real, dev, ino, size, mtime_ns)"},
    {"submit_ranges", (PyCFunction)Pool_submit_ranges, METH_VARARGS,
     "submit_ranges(token0, mapping or fd, [(offset, size), ...][, align]): range i as token0 + i, one call"},
    {"drain", (PyCFunction)Pool_drain, METH_NOARGS, "drain() -> [(token, bytes or -errno)]"},
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS, "the eventfd that is readable when completions wait"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "let the threads exit once the queued jobs are done"},
    {NULL}};

static PyGetSetDef Pool_getset[] = {
    {"threads", (getter)Pool_get_threads, NULL, "threads started", NULL},
    {"pending", (getter)Pool_get_pending, NULL, "jobs submitted and not drained", NULL},
    {"latency", (getter)Pool_get_latency, NULL, "moving mean of the jobs' seconds from queued to done (0: none yet)", NULL},
    {NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "croupier.server.storage._preadpool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Blocking preads on native threads; completions through an eventfd.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

/* read_nowait(fd, ranges, max_bytes) -> [bytes, ...] | None: every (offset, size) of
 * `ranges` read now, on the calling thread, from the page cache alone (preadv2 with
 * RWF_NOWAIT, which returns EAGAIN rather than wait for storage), or None: a range not all
 * cached (EAGAIN, or fewer bytes than asked: the end of the file, or a page missing), a size
 * not given, more than `max_bytes` in all, or any other error (the pool's read says which).
 * OSError(EOPNOTSUPP) where the file system does not take RWF_NOWAIT (FUSE): the caller
 * stops asking for that file. Why: a read the page cache holds costs ~1 us inline, and
 * several on a pool thread (a wake-up, a hand-back through the eventfd, a drain); on 2
 * cores the woken reader also takes the loop's core. */
static PyObject *read_nowait(PyObject *mod, PyObject *args) {
    int fd;
    PyObject *ranges;
    long long max_bytes;
    if (!PyArg_ParseTuple(args, "iOL", &fd, &ranges, &max_bytes)) return NULL;
    PyObject *seq = PySequence_Fast(ranges, "ranges must be a sequence of (offset, size)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    long long total = 0;
    long long (*rs)[2] = n ? PyMem_Malloc((size_t)n * sizeof *rs) : NULL;
    if (n && !rs) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(t, "LL", &rs[i][0], &rs[i][1])) { PyMem_Free(rs); Py_DECREF(seq); return NULL; }
        total += rs[i][1];
        if (rs[i][0] < 0 || rs[i][1] <= 0 || total > max_bytes) { PyMem_Free(rs); Py_DECREF(seq); Py_RETURN_NONE; }
    }
    Py_DECREF(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)rs[i][1]);
        if (!b) { Py_CLEAR(out); break; }
        struct iovec v = {PyBytes_AS_STRING(b), (size_t)rs[i][1]};
        ssize_t got;
        do got = preadv2(fd, &v, 1, (off_t)rs[i][0], RWF_NOWAIT); while (got < 0 && errno == EINTR);
        if (got < 0 && (errno == EOPNOTSUPP || errno == EINVAL)) {
            Py_DECREF(b); Py_CLEAR(out); PyMem_Free(rs);
            errno = EOPNOTSUPP;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (got != rs[i][1]) { Py_DECREF(b); Py_CLEAR(out); PyMem_Free(rs); Py_RETURN_NONE; }
        PyList_SET_ITEM(out, i, b);
    }
    PyMem_Free(rs);
    return out;
}

/* ---- files_nowait: small files read whole on the calling thread, from the page cache ---- */

/* openat2(2)'s argument and flags (Linux 5.6, RESOLVE_CACHED 5.12), spelled out so the
 * module builds where the kernel headers predate them; the kernel answers ENOSYS or EINVAL
 * where it does not know them, and the caller stops asking. */
struct croupier_open_how { unsigned long long flags, mode, resolve; };
#define CROUPIER_RESOLVE_NO_XDEV 0x01ULL
#define CROUPIER_RESOLVE_NO_MAGICLINKS 0x02ULL
#define CROUPIER_RESOLVE_NO_SYMLINKS 0x04ULL
#define CROUPIER_RESOLVE_BENEATH 0x08ULL
#define CROUPIER_RESOLVE_CACHED 0x20ULL
#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture */
#endif

/* `rel` names a file beneath its folder by plain components only (no "", "." or ".."), so
 * that, resolved without links, its real path is the folder's followed by "/" and `rel`. */
static int plain_relative(const char *rel) {
    if (!*rel) return 0;
    for (const char *c = rel;;) {
        const char *end = strchr(c, '/');
        size_t len = end ? (size_t)(end - c) : strlen(c);
        if (len == 0 || (len == 1 && c[0] == '.') || (len == 2 && c[0] == '.' && c[1] == '.')) return 0;
        if (!end) return 1;
        c = end + 1;
    }
}

/* One file for files_nowait: its value as the pool's job would give it (bytes, or for
 * JOB_WHOLE (bytes, real, dev, ino, size, mtime_ns)), NULL with no error set where it
 * cannot be read now without waiting (left to the pool, which says why where it fails),
 * NULL with an error set where this way of reading is not available at all. `folder`: the
 * real path of `dirfd` where it lies under the roots (NULL: not known to), so that a name
 * resolved without links (RESOLVE_NO_SYMLINKS) is the folder's path and `rel` with no
 * /proc/self/fd readlink to check it (about 2 us an image); a link on the way (ELOOP) is
 * opened again and checked as the pool checks it. */
static PyObject *file_nowait(int dirfd, const char *folder, size_t folder_len, const char *rel, int kind,
                             const char *roots, size_t roots_len, long long max_bytes) {
    const unsigned long long base = CROUPIER_RESOLVE_CACHED | CROUPIER_RESOLVE_BENEATH | CROUPIER_RESOLVE_NO_XDEV
                                    | CROUPIER_RESOLVE_NO_MAGICLINKS;
    size_t rel_len = strlen(rel);
    int known = folder && folder_len + 1 + rel_len <= PATH_MAX && plain_relative(rel);
    struct croupier_open_how how = {O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0,
                                    base | (known ? CROUPIER_RESOLVE_NO_SYMLINKS : 0)};
    int fd = (int)syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
    if (fd < 0 && known && errno == ELOOP) { /* a link beneath: resolved and checked as the pool does */
        known = 0;
        how.resolve = base;
        fd = (int)syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
    }
    if (fd < 0) {
        if (errno == ENOSYS || errno == EINVAL || errno == EPERM) { /* no openat2, or not these flags */
            errno = ENOSYS;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return NULL; /* EAGAIN (a name not cached), EXDEV (another mount), ENOENT...: the pool's */
    }
    char real[PATH_MAX + 1];
    ssize_t n = 0;
    if (known) {
        memcpy(real, folder, folder_len);
        real[folder_len] = '/';
        memcpy(real + folder_len + 1, rel, rel_len + 1);
        n = (ssize_t)(folder_len + 1 + rel_len);
    }
    struct stat st;
    PyObject *data = NULL;
    if (check_opened(fd, kind, roots, roots_len, real, &n, &st) != 0 || st.st_size > max_bytes) goto out;
    data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)st.st_size);
    if (!data) goto out;
    size_t have = 0;
    while (have < (size_t)st.st_size) {
        struct iovec v = {PyBytes_AS_STRING(data) + have, (size_t)st.st_size - have};
        ssize_t got = preadv2(fd, &v, 1, (off_t)have, RWF_NOWAIT);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EOPNOTSUPP || errno == EINVAL)) { /* this file system does not take RWF_NOWAIT */
            Py_CLEAR(data);
            errno = EOPNOTSUPP;
            PyErr_SetFromErrno(PyExc_OSError);
            goto out;
        }
        if (got <= 0) { Py_CLEAR(data); goto out; } /* EAGAIN: a page not cached; 0: it shrank */
        have += (size_t)got;
    }
    if (kind == JOB_WHOLE && !unchanged_since(fd, &st)) Py_CLEAR(data); /* changed while read: the pool reads it again */
    else if (kind == JOB_WHOLE) data = file_value(data, real, &st);
out:
    close(fd);
    return data;
}

/* files_nowait(dirfd, prefix, paths, kind, roots, max_bytes) -> (landed, rest, nbytes): each
 * of `paths` (str or bytes) that starts with `prefix` (the folder of `dirfd`, ending in
 * "/") opened from `dirfd` by the rest of its name, checked and read whole now, on the
 * calling thread, where nothing would wait: its path already in the kernel's lookup cache
 * (RESOLVE_CACHED), beneath `dirfd` on the same mount (RESOLVE_BENEATH, RESOLVE_NO_XDEV:
 * never another file system's open, a FUSE daemon's say), every page in the page cache
 * (RWF_NOWAIT), at most `max_bytes`, a regular file, its real path under `roots` (as the
 * pool checks it). `landed`: [(position, value, None)] of those read (the pool's values),
 * `rest`: the positions of the others (the pool reads them, and names any error), `nbytes`:
 * the bytes read. OSError(ENOSYS) where the kernel has no openat2 with these flags,
 * OSError(EOPNOTSUPP) where the file system does not take RWF_NOWAIT: the caller stops
 * asking. Why: a small cached file costs a few syscalls here, against a thread woken, a
 * hand-back through the eventfd and a drain on the pool (images on a local disk), and the
 * group's per-file bookkeeping is one call. */
static PyObject *files_nowait(PyObject *mod, PyObject *args) {
    int dirfd, kind;
    PyObject *paths, *roots_obj;
    const char *prefix;
    Py_ssize_t prefix_len;
    long long max_bytes;
    if (!PyArg_ParseTuple(args, "iy#OiOL", &dirfd, &prefix, &prefix_len, &paths, &kind, &roots_obj, &max_bytes))
        return NULL;
    if (kind != JOB_READ && kind != JOB_WHOLE) { PyErr_SetString(PyExc_ValueError, "kind must be 0 or 1"); return NULL; }
    const char *roots = NULL;
    Py_ssize_t roots_len = 0;
    if (roots_obj != Py_None && PyBytes_AsStringAndSize(roots_obj, (char **)&roots, &roots_len) < 0) return NULL;
    /* The folder's real path, once a call: where it lies under the roots, so does every
     * name resolved beneath it without a link. */
    char folder[PATH_MAX + 1];
    ssize_t folder_len = fd_real_path(dirfd, folder);
    int folder_ok = folder_len > 0 && (!roots || real_under_roots(folder, folder_len, roots, (size_t)roots_len));
    if (folder_ok && folder_len == 1) folder_len = 0; /* "/": "/" + "/" + rel would not be its real path */
    PyObject *seq = PySequence_Fast(paths, "paths must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject *landed = PyList_New(0), *rest = PyList_New(0), *result = NULL;
    long long nbytes = 0;
    for (Py_ssize_t i = 0; landed && rest && i < count; i++) {
        PyObject *path = PySequence_Fast_GET_ITEM(seq, i), *encoded = NULL, *value = NULL;
        if (PyUnicode_Check(path)) {
            if (!(encoded = PyUnicode_EncodeFSDefault(path))) goto fail;
        } else if (PyBytes_Check(path)) {
            encoded = Py_NewRef(path);
        } else {
            PyErr_Format(PyExc_TypeError, "path %zd is not str or bytes", i);
            goto fail;
        }
        const char *name = PyBytes_AS_STRING(encoded);
        if (PyBytes_GET_SIZE(encoded) > prefix_len && memcmp(name, prefix, (size_t)prefix_len) == 0
            && strlen(name) == (size_t)PyBytes_GET_SIZE(encoded)) {
            value = file_nowait(dirfd, folder_ok ? folder : NULL, (size_t)folder_len, name + prefix_len, kind, roots,
                                (size_t)roots_len, max_bytes);
        }
        Py_DECREF(encoded);
        if (!value && PyErr_Occurred()) goto fail;
        PyObject *pos = PyLong_FromSsize_t(i);
        if (!pos) { Py_XDECREF(value); goto fail; }
        int bad;
        if (value) {
            nbytes += PyBytes_GET_SIZE(PyBytes_Check(value) ? value : PyTuple_GET_ITEM(value, 0));
            PyObject *item = PyTuple_Pack(3, pos, value, Py_None);
            Py_DECREF(value);
            bad = !item || PyList_Append(landed, item) < 0;
            Py_XDECREF(item);
        } else {
            bad = PyList_Append(rest, pos) < 0;
        }
        Py_DECREF(pos);
        if (bad) goto fail;
    }
    if (landed && rest) result = Py_BuildValue("(OOL)", landed, rest, nbytes);
fail:
    Py_XDECREF(landed);
    Py_XDECREF(rest);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef module_methods[] = {
    {"measure", measure, METH_VARARGS,
     "measure(fd, mapping | None, offsets, size, concurrency[, align]) -> (seconds, errors, threads, seconds_dry, done_dry, cpu_seconds)"},
    {"measure_files", measure_files, METH_VARARGS,
     "measure_files(paths, concurrency[, max_bytes]) -> (seconds, errors, threads, bytes, cpu_seconds, skipped): "
     "each file opened, fstat'ed, read whole and closed by bare threads, concurrency at once; a file whose size "
     "would take the bytes read past max_bytes is closed unread (skipped)"},
    {"files_nowait", files_nowait, METH_VARARGS,
     "files_nowait(dirfd, prefix, paths, kind, roots, max_bytes) -> (landed, rest, nbytes): small files under "
     "dirfd (the folder `prefix`) read whole now where nothing would wait (lookup and page cache): landed "
     "[(position, value, None)], the positions of the rest, the bytes read"},
    {"read_nowait", read_nowait, METH_VARARGS,
     "read_nowait(fd, ranges, max_bytes) -> [bytes, ...] | None: the ranges from the page cache now, else None"},
    {"direct_alignment", direct_alignment, METH_VARARGS,
     "direct_alignment(fd, file_size) -> the offset and size alignment an O_DIRECT fd accepts (1, 512 or 4096)"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_preadpool", "Preads on native threads.", -1, module_methods};

PyMODINIT_FUNC PyInit__preadpool(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&MappingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) { Py_DECREF(&PoolType); Py_DECREF(m); return NULL; }
    Py_INCREF(&MappingType);
    if (PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType) < 0) { Py_DECREF(&MappingType); Py_DECREF(m); return NULL; }
    return m;
}
