/*
 * latencyfs: a read-only FUSE passthrough that delays every read() by a seeded,
 * stated random distribution -- "really slow storage" that every benchmarked
 * system pays for the same way, through the kernel.
 *
 *   latencyfs [options] SOURCE MOUNTPOINT [-f] [-o fuse_opts]
 *   latencyfs --print-delays K [--median-ms M] [--sigma S] [--distribution D] [--seed N]
 *
 * Build:  cc -O2 -Wall -o latencyfs latencyfs.c $(pkg-config --cflags --libs fuse3) -lm -pthread
 * See README.md next to this file (delays, statistics, readahead, page cache).
 *
 * Delays. The k-th read request (k = 0, 1, 2, ... from one global atomic counter,
 * restarted by a reset) sleeps f(seed, k) after its pread:
 *   fixed      exactly median
 *   uniform    U[0, 2 * median]
 *   lognormal  exp(N(ln median, sigma^2)) = median * exp(sigma * z)
 * with u1 = U(seed, 2k), u2 = U(seed, 2k + 1) from a counter-based generator
 * (splitmix64's finaliser of a seed-derived key plus the index), and z from
 * Box-Muller on (u1, u2). So a delay depends only on (seed, k, distribution).
 *
 * Statistics: reading the virtual file /.latencyfs-stats (not listed by readdir,
 * not delayed, not counted) returns one JSON object, a snapshot taken at open().
 * Opening /.latencyfs-reset, or sending SIGUSR1 to the daemon, resets the counters:
 * requests (and so the delay index k), bytes, delay sums, the size histogram,
 * and max_in_flight (to the reads in flight at that moment).
 */

#define FUSE_USE_VERSION 314
#define _GNU_SOURCE

#include <fuse.h>
#include <fuse_lowlevel.h> /* fuse_parse_cmdline */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define STATS_NAME "/.latencyfs-stats"
#define RESET_NAME "/.latencyfs-reset"
#define N_SIZE_BUCKETS 10 /* <=4K, 8K, 16K, 32K, 64K, 128K, 256K, 512K, 1M, >1M */

enum dist { DIST_FIXED, DIST_UNIFORM, DIST_LOGNORMAL };
static const char *dist_names[] = {"fixed", "uniform", "lognormal"};

static struct {
	const char *source; /* realpath of the source folder */
	int root_fd;        /* O_PATH|O_DIRECTORY fd of it: every lookup is relative */
	double median_ms;
	double sigma;
	enum dist dist;
	uint64_t seed;
	uint64_t key; /* splitmix64(seed): the generator's stream key */
	unsigned max_threads;
	unsigned max_background;
	int kernel_background; /* --max-background 0: leave the kernel's default (12) */
	int sync_dio; /* --sync-dio: O_DIRECT reads as synchronous requests (no FUSE_CAP_ASYNC_DIO) */
	double timeout_s; /* entry/attr cache timeout (the source is static) */
	unsigned max_read; /* the -o max_read=N mount option, echoed to conn->max_read */
	struct timespec started;
	/* what the kernel negotiated at init (for the stats) */
	unsigned conn_max_read, conn_max_readahead, conn_max_background, conn_congestion;
	unsigned conn_max_write, conn_proto_major, conn_proto_minor;
	int conn_async_read, conn_async_dio;
} cfg = {
	.root_fd = -1,
	.median_ms = 5.0,
	.sigma = 0.5,
	.dist = DIST_LOGNORMAL,
	.seed = 0,
	.max_threads = 1024,
	.max_background = 0, /* 0: = max_threads, at most 65535 (set in main) */
	.timeout_s = 60.0,
};

/* ---- statistics ------------------------------------------------------- */

static struct {
	atomic_uint_fast64_t requests; /* also the delay index k */
	atomic_uint_fast64_t bytes;
	atomic_int_fast64_t in_flight;
	atomic_int_fast64_t max_in_flight;
	atomic_uint_fast64_t delay_ns;  /* planned: sum of f(seed, k) */
	atomic_uint_fast64_t slept_ns;  /* measured: wall time spent sleeping */
	atomic_uint_fast64_t read_ns;   /* measured: wall time in pread on the source */
	atomic_uint_fast64_t errors;
	atomic_uint_fast64_t opens;
	atomic_uint_fast64_t max_request;
	atomic_uint_fast64_t sizes[N_SIZE_BUCKETS];
	atomic_uint_fast64_t resets;
	atomic_uint_fast64_t threads_seen; /* distinct worker threads that served a read */
	atomic_uint_fast64_t seeks;        /* reads not starting where their handle's last one ended */
} st;

/* Thread ids of the callers whose read()s reached us (the kernel passes the requesting
 * thread's id): a test can tell which thread of a client faulted a mapped page or ran a
 * pread. A lock-free open-addressed set (reset from a signal handler): 0 is empty. */
#define N_CALLER_SLOTS 4096
static atomic_int callers[N_CALLER_SLOTS];

static void caller_seen(int tid)
{
	if (tid <= 0)
		return;
	unsigned h = ((unsigned)tid * 2654435761u) % N_CALLER_SLOTS;
	for (int i = 0; i < N_CALLER_SLOTS; i++, h = (h + 1) % N_CALLER_SLOTS) {
		int cur = atomic_load(&callers[h]);
		if (cur == tid)
			return;
		if (cur == 0 && atomic_compare_exchange_strong(&callers[h], &cur, tid))
			return;
		if (cur == tid) /* another thread put it there meanwhile */
			return;
	}
}

static _Thread_local int thread_seen;

static void stats_reset(void)
{
	atomic_store(&st.requests, 0);
	atomic_store(&st.bytes, 0);
	atomic_store(&st.delay_ns, 0);
	atomic_store(&st.slept_ns, 0);
	atomic_store(&st.read_ns, 0);
	atomic_store(&st.errors, 0);
	atomic_store(&st.opens, 0);
	atomic_store(&st.seeks, 0);
	atomic_store(&st.max_request, 0);
	for (int i = 0; i < N_SIZE_BUCKETS; i++)
		atomic_store(&st.sizes[i], 0);
	atomic_store(&st.max_in_flight, atomic_load(&st.in_flight));
	for (int i = 0; i < N_CALLER_SLOTS; i++)
		atomic_store(&callers[i], 0);
	atomic_fetch_add(&st.resets, 1);
}

static void on_sigusr1(int sig)
{
	(void)sig;
	stats_reset(); /* lock-free atomics only: async-signal-safe */
}

static void atomic_max_i64(atomic_int_fast64_t *m, int_fast64_t v)
{
	int_fast64_t cur = atomic_load(m);
	while (v > cur && !atomic_compare_exchange_weak(m, &cur, v))
		;
}

static void atomic_max_u64(atomic_uint_fast64_t *m, uint_fast64_t v)
{
	uint_fast64_t cur = atomic_load(m);
	while (v > cur && !atomic_compare_exchange_weak(m, &cur, v))
		;
}

static int size_bucket(size_t n)
{
	int b = 0;
	size_t lim = 4096;
	while (b < N_SIZE_BUCKETS - 1 && n > lim) {
		lim <<= 1;
		b++;
	}
	return b;
}

/* ---- the delay generator ---------------------------------------------- */

static uint64_t mix64(uint64_t z)
{
	z += 0x9E3779B97F4A7C15ULL;
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

/* U(0, 1), never 0 or 1: the i-th output of the stream keyed by cfg.key */
static double unit(uint64_t i)
{
	uint64_t h = mix64(cfg.key + i * 0x9E3779B97F4A7C15ULL);
	return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double delay_ms(uint64_t k)
{
	switch (cfg.dist) {
	case DIST_FIXED:
		return cfg.median_ms;
	case DIST_UNIFORM:
		return 2.0 * cfg.median_ms * unit(2 * k);
	case DIST_LOGNORMAL:
	default: {
		double u1 = unit(2 * k), u2 = unit(2 * k + 1);
		double z = sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
		return cfg.median_ms * exp(cfg.sigma * z);
	}
	}
}

static int64_t ns_since(const struct timespec *t0)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)(t.tv_sec - t0->tv_sec) * 1000000000LL + (t.tv_nsec - t0->tv_nsec);
}

static void sleep_ns(uint64_t ns)
{
	if (ns == 0)
		return;
	struct timespec now, until;
	clock_gettime(CLOCK_MONOTONIC, &now);
	until.tv_sec = now.tv_sec + (time_t)(ns / 1000000000ULL);
	until.tv_nsec = now.tv_nsec + (long)(ns % 1000000000ULL);
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR)
		;
}

/* ---- file handles ----------------------------------------------------- */

enum fh_kind { FH_REAL, FH_VIRTUAL };

struct lfs_file {
	enum fh_kind kind;
	int fd;     /* FH_REAL: fd of the source file */
	char *data; /* FH_VIRTUAL: snapshot returned by read */
	size_t len;
	/* FH_REAL: where the handle's last read ended (-1: none yet). A read that starts
	 * elsewhere is a seek: what a FUSE client of an object store answers with a new GET. */
	atomic_int_fast64_t next_off;
};

static const char *rel(const char *path)
{
	/* "/a/b" -> "a/b"; "/" -> "." (relative to cfg.root_fd) */
	while (*path == '/')
		path++;
	return *path ? path : ".";
}

static int is_virtual(const char *path)
{
	return path && (strcmp(path, STATS_NAME) == 0 || strcmp(path, RESET_NAME) == 0);
}

static char *stats_json(size_t *len)
{
	char *buf = NULL;
	size_t size = 0;
	FILE *f = open_memstream(&buf, &size);
	if (!f)
		return NULL;
	static const char *bucket_names[N_SIZE_BUCKETS] = {
		"le_4k", "le_8k", "le_16k", "le_32k", "le_64k",
		"le_128k", "le_256k", "le_512k", "le_1m", "gt_1m"};
	fprintf(f, "{\"requests\": %llu, \"bytes\": %llu, \"in_flight\": %lld, \"max_in_flight\": %lld, ",
		(unsigned long long)atomic_load(&st.requests), (unsigned long long)atomic_load(&st.bytes),
		(long long)atomic_load(&st.in_flight), (long long)atomic_load(&st.max_in_flight));
	fprintf(f, "\"delay_ms_total\": %.6f, \"slept_ms_total\": %.6f, \"pread_ms_total\": %.6f, ",
		atomic_load(&st.delay_ns) / 1e6, atomic_load(&st.slept_ns) / 1e6, atomic_load(&st.read_ns) / 1e6);
	fprintf(f, "\"errors\": %llu, \"opens\": %llu, \"max_request_bytes\": %llu, \"resets\": %llu, "
		   "\"threads_seen\": %llu, \"seeks\": %llu, ",
		(unsigned long long)atomic_load(&st.errors), (unsigned long long)atomic_load(&st.opens),
		(unsigned long long)atomic_load(&st.max_request), (unsigned long long)atomic_load(&st.resets),
		(unsigned long long)atomic_load(&st.threads_seen), (unsigned long long)atomic_load(&st.seeks));
	fprintf(f, "\"request_sizes\": {");
	for (int i = 0; i < N_SIZE_BUCKETS; i++)
		fprintf(f, "%s\"%s\": %llu", i ? ", " : "", bucket_names[i],
			(unsigned long long)atomic_load(&st.sizes[i]));
	fprintf(f, "}, \"caller_tids\": [");
	for (int i = 0, n = 0; i < N_CALLER_SLOTS; i++) {
		int tid = atomic_load(&callers[i]);
		if (tid)
			fprintf(f, "%s%d", n++ ? ", " : "", tid);
	}
	fprintf(f, "], ");
	fprintf(f, "\"config\": {\"distribution\": \"%s\", \"median_ms\": %.6g, \"sigma\": %.6g, "
		   "\"seed\": %llu, \"max_threads\": %u, \"max_background\": %u, \"timeout_s\": %.6g}, ",
		dist_names[cfg.dist], cfg.median_ms, cfg.sigma, (unsigned long long)cfg.seed,
		cfg.max_threads, cfg.max_background, cfg.timeout_s);
	fprintf(f, "\"kernel\": {\"proto\": \"%u.%u\", \"max_read\": %u, \"max_readahead\": %u, "
		   "\"max_background\": %u, \"congestion_threshold\": %u, \"max_write\": %u, \"async_read\": %s, "
		   "\"async_dio\": %s}, ",
		cfg.conn_proto_major, cfg.conn_proto_minor, cfg.conn_max_read, cfg.conn_max_readahead,
		cfg.conn_max_background, cfg.conn_congestion, cfg.conn_max_write,
		cfg.conn_async_read ? "true" : "false", cfg.conn_async_dio ? "true" : "false");
	fprintf(f, "\"libfuse\": \"%s\", \"pid\": %d, \"uptime_s\": %.3f}\n",
		fuse_pkgversion(), (int)getpid(), ns_since(&cfg.started) / 1e9);
	fclose(f);
	*len = size;
	return buf;
}

/* ---- operations ------------------------------------------------------- */

static void *lfs_init(struct fuse_conn_info *conn, struct fuse_config *fc)
{
	fc->use_ino = 0;
	fc->nullpath_ok = 1; /* read/release go by fh: no path lookup, no tree lock */
	fc->entry_timeout = cfg.timeout_s;
	fc->attr_timeout = cfg.timeout_s;
	fc->negative_timeout = cfg.timeout_s;
	fc->kernel_cache = 0; /* each open() starts with a cold page cache for that file */
	fc->auto_cache = 0;
	fc->direct_io = 0; /* mmap must work (Arrow memory-maps files) */

	/* libfuse insists that init() repeats the max_read mount option */
	if (cfg.max_read)
		conn->max_read = cfg.max_read;

	/* Background requests (async readahead and, with async_read, every buffered read)
	 * are capped per connection by max_background (kernel default 12!). Raise it so
	 * that it never caps the concurrency below the thread count, unless asked to keep
	 * the kernel's default (0 at init leaves the kernel's 12 and 9): the case of most
	 * FUSE file systems users really mount. */
	if (!cfg.kernel_background) {
		unsigned bg = cfg.max_background;
		conn->max_background = bg;
		conn->congestion_threshold = bg - bg / 4;
	} else {
		conn->max_background = 0;
		conn->congestion_threshold = 0;
	}

	/* libfuse asks for async direct I/O by default: the kernel then sends an O_DIRECT
	 * read as background requests, under max_background; --sync-dio turns it off (as
	 * daemons that do not ask for it have it), so each is a synchronous request. */
	if (cfg.sync_dio)
		conn->want &= ~FUSE_CAP_ASYNC_DIO;

	cfg.conn_max_read = conn->max_read;
	cfg.conn_max_readahead = conn->max_readahead;
	cfg.conn_max_background = conn->max_background;
	cfg.conn_congestion = conn->congestion_threshold;
	cfg.conn_max_write = conn->max_write;
	cfg.conn_proto_major = conn->proto_major;
	cfg.conn_proto_minor = conn->proto_minor;
	cfg.conn_async_read = !!(conn->want & FUSE_CAP_ASYNC_READ);
	cfg.conn_async_dio = !!(conn->want & FUSE_CAP_ASYNC_DIO);
	return NULL;
}

static int lfs_getattr(const char *path, struct stat *sb, struct fuse_file_info *fi)
{
	struct lfs_file *h = fi ? (struct lfs_file *)(uintptr_t)fi->fh : NULL;
	if (is_virtual(path) || (h && h->kind == FH_VIRTUAL)) {
		memset(sb, 0, sizeof *sb);
		sb->st_mode = S_IFREG | 0444;
		sb->st_nlink = 1;
		sb->st_uid = getuid();
		sb->st_gid = getgid();
		sb->st_size = 0; /* served with direct_io: the size is whatever read returns */
		sb->st_mtime = sb->st_ctime = sb->st_atime = time(NULL);
		return 0;
	}
	int r;
	if (h)
		r = fstat(h->fd, sb);
	else if (path)
		r = fstatat(cfg.root_fd, rel(path), sb, AT_SYMLINK_NOFOLLOW | AT_EMPTY_PATH);
	else
		return -EBADF;
	if (r < 0)
		return -errno;
	sb->st_mode &= ~(mode_t)0222; /* read-only */
	return 0;
}

static int lfs_access(const char *path, int mask)
{
	if (mask & W_OK)
		return -EROFS;
	if (is_virtual(path))
		return (mask & X_OK) ? -EACCES : 0;
	if (faccessat(cfg.root_fd, rel(path), mask, 0) < 0)
		return -errno;
	return 0;
}

static int lfs_readlink(const char *path, char *buf, size_t size)
{
	ssize_t n = readlinkat(cfg.root_fd, rel(path), buf, size - 1);
	if (n < 0)
		return -errno;
	buf[n] = '\0';
	return 0;
}

static int lfs_opendir(const char *path, struct fuse_file_info *fi)
{
	int fd = openat(cfg.root_fd, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	DIR *d = fdopendir(fd);
	if (!d) {
		int e = errno;
		close(fd);
		return -e;
	}
	fi->fh = (uint64_t)(uintptr_t)d;
	return 0;
}

static int lfs_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset,
		       struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
	(void)path;
	(void)offset;
	(void)flags;
	DIR *d = (DIR *)(uintptr_t)fi->fh;
	rewinddir(d);
	struct dirent *de;
	errno = 0;
	while ((de = readdir(d)) != NULL) {
		struct stat sb;
		memset(&sb, 0, sizeof sb);
		sb.st_ino = de->d_ino;
		sb.st_mode = (mode_t)de->d_type << 12;
		if (filler(buf, de->d_name, &sb, 0, 0))
			break;
	}
	return 0;
}

static int lfs_releasedir(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	closedir((DIR *)(uintptr_t)fi->fh);
	return 0;
}

static int lfs_open(const char *path, struct fuse_file_info *fi)
{
	if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC))
		return -EROFS;
	struct lfs_file *h = calloc(1, sizeof *h);
	if (!h)
		return -ENOMEM;
	if (is_virtual(path)) {
		if (strcmp(path, RESET_NAME) == 0)
			stats_reset();
		h->kind = FH_VIRTUAL;
		h->fd = -1;
		h->data = strcmp(path, STATS_NAME) == 0 ? stats_json(&h->len) : strdup("reset\n");
		if (h->data && h->len == 0)
			h->len = strlen(h->data);
		fi->direct_io = 1; /* not cached: each open is a fresh snapshot */
		fi->keep_cache = 0;
		fi->fh = (uint64_t)(uintptr_t)h;
		return 0;
	}
	int fd = openat(cfg.root_fd, rel(path), O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		int e = errno;
		free(h);
		return -e;
	}
	h->kind = FH_REAL;
	h->fd = fd;
	atomic_init(&h->next_off, -1);
	fi->keep_cache = 0; /* kernel drops this inode's cached pages at open */
	fi->direct_io = 0;
	fi->fh = (uint64_t)(uintptr_t)h;
	atomic_fetch_add(&st.opens, 1);
	return 0;
}

static int lfs_read(const char *path, char *buf, size_t size, off_t off, struct fuse_file_info *fi)
{
	(void)path;
	struct lfs_file *h = (struct lfs_file *)(uintptr_t)fi->fh;
	if (h->kind == FH_VIRTUAL) {
		if (!h->data || (size_t)off >= h->len)
			return 0;
		size_t n = h->len - (size_t)off;
		if (n > size)
			n = size;
		memcpy(buf, h->data + off, n);
		return (int)n;
	}

	if (!thread_seen) {
		thread_seen = 1;
		atomic_fetch_add(&st.threads_seen, 1);
	}
	int_fast64_t now = atomic_fetch_add(&st.in_flight, 1) + 1;
	atomic_max_i64(&st.max_in_flight, now);
	uint64_t k = atomic_fetch_add(&st.requests, 1);
	caller_seen((int)fuse_get_context()->pid);
	int_fast64_t was = atomic_exchange(&h->next_off, (int_fast64_t)off + (int_fast64_t)size);
	if (was >= 0 && was != (int_fast64_t)off)
		atomic_fetch_add(&st.seeks, 1);

	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ssize_t n = pread(h->fd, buf, size, off);
	int err = n < 0 ? errno : 0;
	int64_t t_read = ns_since(&t0);

	double d = delay_ms(k);
	uint64_t dns = d > 0 ? (uint64_t)llround(d * 1e6) : 0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	sleep_ns(dns);
	int64_t t_slept = ns_since(&t0);

	atomic_fetch_add(&st.read_ns, (uint64_t)t_read);
	atomic_fetch_add(&st.delay_ns, dns);
	atomic_fetch_add(&st.slept_ns, (uint64_t)t_slept);
	atomic_fetch_add(&st.sizes[size_bucket(size)], 1);
	atomic_max_u64(&st.max_request, size);
	if (n < 0)
		atomic_fetch_add(&st.errors, 1);
	else
		atomic_fetch_add(&st.bytes, (uint64_t)n);
	atomic_fetch_sub(&st.in_flight, 1);
	return n < 0 ? -err : (int)n;
}

static int lfs_release(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	struct lfs_file *h = (struct lfs_file *)(uintptr_t)fi->fh;
	if (h->kind == FH_REAL)
		close(h->fd);
	free(h->data);
	free(h);
	return 0;
}

static int lfs_statfs(const char *path, struct statvfs *sv)
{
	(void)path;
	if (fstatvfs(cfg.root_fd, sv) < 0)
		return -errno;
	sv->f_flag |= ST_RDONLY;
	return 0;
}

static const struct fuse_operations lfs_ops = {
	.init = lfs_init,
	.getattr = lfs_getattr,
	.access = lfs_access,
	.readlink = lfs_readlink,
	.opendir = lfs_opendir,
	.readdir = lfs_readdir,
	.releasedir = lfs_releasedir,
	.open = lfs_open,
	.read = lfs_read,
	.release = lfs_release,
	.statfs = lfs_statfs,
};

/* ---- command line ----------------------------------------------------- */

static void usage(FILE *out, const char *prog)
{
	fprintf(out,
		"usage: %s [options] SOURCE MOUNTPOINT [-f] [-d] [-o opt,...]\n"
		"       %s --print-delays K [--median-ms M] [--sigma S] [--distribution D] [--seed N]\n"
		"\n"
		"A read-only FUSE passthrough of SOURCE that sleeps after every read request.\n"
		"\n"
		"  --median-ms M          median delay per read request in ms (default 5)\n"
		"  --sigma S              lognormal sigma (default 0.5)\n"
		"  --distribution D       fixed | uniform | lognormal (default lognormal)\n"
		"                           fixed: exactly M; uniform: U[0, 2M];\n"
		"                           lognormal: exp(N(ln M, S^2))\n"
		"  --seed N               seed of the delay sequence (default 0)\n"
		"  --max-threads N        libfuse worker threads at most (default 1024)\n"
		"  --max-background N     kernel cap on background (readahead, buffered read)\n"
		"                           requests (default = max threads, at most 65535;\n"
		"                           0: keep the kernel's default, 12)\n"
		"  --sync-dio             O_DIRECT reads as synchronous requests, outside\n"
		"                           max_background (default: async, libfuse's choice)\n"
		"  --timeout S            entry/attr cache timeout in seconds (default 60)\n"
		"  --print-delays K       print the first K delays in ms, one a line, and exit\n"
		"  --die-with-parent      get SIGTERM (so unmount) when the parent thread dies\n"
		"  -f                     stay in the foreground; SIGTERM/SIGINT unmount cleanly\n"
		"  -d                     FUSE debug output (implies -f)\n"
		"  -o OPTS                FUSE mount options (e.g. allow_other, max_read=N,\n"
		"                           max_readahead=N)\n"
		"\n"
		"Virtual files at the mount root (not listed, not delayed, not counted):\n"
		"  " STATS_NAME "  JSON statistics snapshot taken at open\n"
		"  " RESET_NAME "  opening it resets the statistics (as does SIGUSR1)\n",
		prog, prog);
}

static int parse_double(const char *s, double *out)
{
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || end == s || *end)
		return -1;
	*out = v;
	return 0;
}

static int parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (*s == '-')
		return -1;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || end == s || *end)
		return -1;
	*out = v;
	return 0;
}

/* "--name value" or "--name=value" */
static const char *opt_value(int argc, char **argv, int *i, const char *name)
{
	size_t n = strlen(name);
	if (strncmp(argv[*i], name, n) != 0)
		return NULL;
	if (argv[*i][n] == '=')
		return argv[*i] + n + 1;
	if (argv[*i][n] == '\0') {
		if (*i + 1 >= argc) {
			fprintf(stderr, "latencyfs: %s needs a value\n", name);
			exit(2);
		}
		return argv[++*i];
	}
	return NULL;
}

int main(int argc, char **argv)
{
	clock_gettime(CLOCK_MONOTONIC, &cfg.started);
	uint64_t print_k = 0;
	int print_mode = 0;
	int die_with_parent = 0;
	char **fargv = calloc((size_t)argc + 8, sizeof *fargv);
	int fargc = 0;
	const char *positional[2] = {NULL, NULL};
	int npos = 0;
	fargv[fargc++] = argv[0];

	for (int i = 1; i < argc; i++) {
		const char *v;
		uint64_t u;
		if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
			usage(stdout, argv[0]);
			return 0;
		} else if ((v = opt_value(argc, argv, &i, "--median-ms"))) {
			if (parse_double(v, &cfg.median_ms) || !(cfg.median_ms >= 0)) {
				fprintf(stderr, "latencyfs: bad --median-ms %s\n", v);
				return 2;
			}
		} else if ((v = opt_value(argc, argv, &i, "--sigma"))) {
			if (parse_double(v, &cfg.sigma) || !(cfg.sigma >= 0)) {
				fprintf(stderr, "latencyfs: bad --sigma %s\n", v);
				return 2;
			}
		} else if ((v = opt_value(argc, argv, &i, "--distribution"))) {
			int ok = 0;
			for (int d = 0; d < 3; d++)
				if (strcmp(v, dist_names[d]) == 0) {
					cfg.dist = (enum dist)d;
					ok = 1;
				}
			if (!ok) {
				fprintf(stderr, "latencyfs: --distribution must be fixed, uniform or lognormal\n");
				return 2;
			}
		} else if ((v = opt_value(argc, argv, &i, "--seed"))) {
			if (parse_u64(v, &cfg.seed)) {
				fprintf(stderr, "latencyfs: bad --seed %s\n", v);
				return 2;
			}
		} else if ((v = opt_value(argc, argv, &i, "--max-threads"))) {
			if (parse_u64(v, &u) || u < 1 || u > 100000) {
				fprintf(stderr, "latencyfs: bad --max-threads %s\n", v);
				return 2;
			}
			cfg.max_threads = (unsigned)u;
		} else if ((v = opt_value(argc, argv, &i, "--max-background"))) {
			if (parse_u64(v, &u) || u > 65535) {
				fprintf(stderr, "latencyfs: bad --max-background %s\n", v);
				return 2;
			}
			cfg.max_background = (unsigned)u;
			cfg.kernel_background = u == 0;
		} else if ((v = opt_value(argc, argv, &i, "--timeout"))) {
			if (parse_double(v, &cfg.timeout_s) || !(cfg.timeout_s >= 0)) {
				fprintf(stderr, "latencyfs: bad --timeout %s\n", v);
				return 2;
			}
		} else if ((v = opt_value(argc, argv, &i, "--print-delays"))) {
			if (parse_u64(v, &print_k)) {
				fprintf(stderr, "latencyfs: bad --print-delays %s\n", v);
				return 2;
			}
			print_mode = 1;
		} else if (strcmp(argv[i], "--sync-dio") == 0) {
			cfg.sync_dio = 1;
		} else if (strcmp(argv[i], "--die-with-parent") == 0) {
			die_with_parent = 1;
		} else if (strcmp(argv[i], "-o") == 0 && i + 1 < argc) {
			fargv[fargc++] = argv[i++];
			fargv[fargc++] = argv[i];
		} else if (argv[i][0] == '-') {
			fargv[fargc++] = argv[i]; /* -f, -d, -s, -oopts: for libfuse */
		} else if (npos < 2) {
			positional[npos++] = argv[i];
		} else {
			fprintf(stderr, "latencyfs: unexpected argument %s\n", argv[i]);
			return 2;
		}
	}
	cfg.key = mix64(cfg.seed);
	for (int i = 1; i < fargc; i++) { /* find max_read=N among the -o options */
		const char *o = NULL;
		if (strcmp(fargv[i - 1], "-o") == 0)
			o = fargv[i];
		else if (strncmp(fargv[i], "-o", 2) == 0 && fargv[i][2])
			o = fargv[i] + 2;
		for (const char *p = o; p && (p = strstr(p, "max_read=")); p += 9)
			if (p == o || p[-1] == ',')
				cfg.max_read = (unsigned)strtoul(p + 9, NULL, 0);
	}
	if (!cfg.max_background && !cfg.kernel_background)
		cfg.max_background = cfg.max_threads < 65535 ? cfg.max_threads : 65535;

	if (print_mode) {
		for (uint64_t k = 0; k < print_k; k++)
			printf("%.6f\n", delay_ms(k));
		return fflush(stdout) == 0 ? 0 : 1;
	}
	if (npos != 2) {
		usage(stderr, argv[0]);
		return 2;
	}

	if (die_with_parent) {
		pid_t parent = getppid();
		prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0);
		if (getppid() != parent) /* it died before the prctl */
			return 1;
	}

	char *src = realpath(positional[0], NULL);
	if (!src) {
		fprintf(stderr, "latencyfs: source %s: %s\n", positional[0], strerror(errno));
		return 1;
	}
	cfg.source = src;
	cfg.root_fd = open(src, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (cfg.root_fd < 0) {
		fprintf(stderr, "latencyfs: source %s: %s\n", src, strerror(errno));
		return 1;
	}
	fargv[fargc++] = (char *)positional[1];
	fargv[fargc++] = "-o";
	fargv[fargc++] = "ro,default_permissions,fsname=latencyfs,subtype=latencyfs";
	fargv[fargc] = NULL;

	struct fuse_args args = FUSE_ARGS_INIT(fargc, fargv);
	struct fuse_cmdline_opts opts;
	if (fuse_parse_cmdline(&args, &opts) != 0)
		return 2;
	if (opts.show_help || opts.show_version || !opts.mountpoint) {
		if (opts.show_version)
			printf("libfuse %s\n", fuse_pkgversion());
		else
			usage(opts.mountpoint ? stdout : stderr, argv[0]);
		return opts.mountpoint ? 0 : 2;
	}

	/* Nanosleep precision: the default 50 us timer slack is inherited by workers. */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);

	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_sigusr1;
	sa.sa_flags = SA_RESTART;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGUSR1, &sa, NULL);

	int ret = 1;
	struct fuse *fuse = fuse_new(&args, &lfs_ops, sizeof lfs_ops, NULL);
	if (!fuse)
		goto out_args;
	if (fuse_mount(fuse, opts.mountpoint) != 0)
		goto out_destroy;
	if (fuse_daemonize(opts.foreground) != 0)
		goto out_unmount;
	struct fuse_session *se = fuse_get_session(fuse);
	if (fuse_set_signal_handlers(se) != 0)
		goto out_unmount;

	if (opts.singlethread) {
		ret = fuse_loop(fuse);
	} else {
		struct fuse_loop_config *lc = fuse_loop_cfg_create();
		fuse_loop_cfg_set_clone_fd(lc, opts.clone_fd);
		/* idle workers: libfuse >= 3.12 keeps them all by default (no thread churn) */
		fuse_loop_cfg_set_max_threads(lc, cfg.max_threads);
		ret = fuse_loop_mt(fuse, lc);
		fuse_loop_cfg_destroy(lc);
	}
	/* the loop returns 0, -errno, or the number of the signal that ended it */
	if (ret == SIGTERM || ret == SIGINT || ret == SIGHUP)
		ret = 0;
	fuse_remove_signal_handlers(se);
out_unmount:
	fuse_unmount(fuse);
out_destroy:
	fuse_destroy(fuse);
out_args:
	free(opts.mountpoint);
	fuse_opt_free_args(&args);
	close(cfg.root_fd);
	free(src);
	return ret ? 1 : 0;
}
