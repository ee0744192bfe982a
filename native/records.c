/* tierkv._native: the disk tier's record runs, read and written without the GIL.
 *
 * read_run   reads a run of raw block records straight into a restore's destination slabs, verifies
 *            each (header fields and checksum, namespace, key, token ids, payload checksum) on the
 *            reading threads, and says per record whether it may be served. Records already in the
 *            page cache are read buffered straight into place (mincore tells which are);
 *            the rest with O_DIRECT at a queue depth of several threads, through aligned bounce buffers.
 * write_run  appends a run of records to a segment file (buffered, each padded to a page) in chunks:
 *            sealer threads compute the chunks' checksums ahead while the caller writes the sealed ones
 *            and starts their writeback; one fdatasync at the end.
 * copy_blocks copies whole blocks between a memory tier's slots (or a save's private copies) and a KV
 *            tensor's slabs, on a few threads (a large run with streamed stores).
 * copy_paged  copies canonical blocks (slots, or a KV tensor's slabs) into or out of an engine's paged KV
 *            cache, whose page places K and V by strides (vLLM-CPU stores K head_dim-major), on a few
 *            threads: a restore lands in the engine's pages with one copy.
 *
 * xxh3-64 comes from the system's libxxhash (dlopen, no header needed: the functions used are its stable
 * ABI); without it the module reports itself unavailable and tierkv keeps its Python path, which is also
 * the reference the tests compare this one with. The GIL is released only around the I/O and memory work
 * on buffers the caller keeps alive for the call; every offset is checked against the sizes given.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <immintrin.h> /* SSE2 only: the x86-64 baseline */
#endif

#define ABI 12 /* tierkv/native.py refuses a build of another version (a stale in-place build) */
#define ALIGN 4096
#define IOV_CAP 1024              /* Linux's IOV_MAX */
#define WRITE_CHUNK_NBYTES (8 << 20) /* write_run, buffered: hashed, written and sent to the disk in chunks this size */
/* write_run, O_DIRECT: chunks this size (in images of IMAGE_NBYTES). Smaller chunks overlap each
 * thread's sealing with the others' writes more finely: a 480 MiB durable save, warm, 1.27-1.36 against
 * 1.09-1.18 GB/s with 8 MiB (alternated fresh processes, 2026-12-05), and a fifth of the system time. */
#ifndef DIRECT_CHUNK_NBYTES
#define DIRECT_CHUNK_NBYTES (2 << 20)
#endif
/* An image holds a chunk, or one record up to this size (an 8B model's 16-token block, vLLM's, is 2 MiB
 * and a page: one write, not a second of 4 KiB); a larger record goes through images in pieces this size. */
#define IMAGE_NBYTES (4 << 20)
_Static_assert(DIRECT_CHUNK_NBYTES <= IMAGE_NBYTES, "a chunk of several records must fit an image");
#ifndef GROUP_NBYTES
#define GROUP_NBYTES (1u << 20)   /* one read request: adjacent records coalesced up to this */
#endif
/* A read lands, and is hashed, in pieces this size: each piece's checksum reads it from the cache it was
 * just copied into (L2 holds it), not from memory. Warm 480 MiB, 2 threads: 8.7-9.4 GB/s against 7.9-8.5
 * with a 768 KiB record hashed after its whole read (2026-12-06). */
#ifndef HASH_PIECE_NBYTES
#define HASH_PIECE_NBYTES (256 << 10)
#endif
_Static_assert(HASH_PIECE_NBYTES > 0, "the read loops advance by a piece");
#define MAX_THREADS 64
#define STREAM_MIN_NBYTES (16ll << 20) /* copy_blocks: runs this large stream past the caches */
#define MAX_NDIM 6
#define FIELDS_NBYTES 168         /* codec.py's _FIELDS.size */
#define HEADER_NBYTES 176         /* fields + their xxh3-64 */
#define MAX_PAYLOAD_NBYTES (1ull << 34)
#define PAYLOAD_ALIGN 64          /* record version 2: the payload starts at a multiple of this (codec.py) */

/* Zeros between a record's token ids and its payload: none in version 1; in version 2, up to the next
 * multiple of PAYLOAD_ALIGN from the record's start (a page-cache read is copied into a 64-aligned slab
 * a third faster when its source is 64-aligned too). */
static inline int64_t inner_pad(int version, int64_t token_nbytes) {
    int64_t end = HEADER_NBYTES + token_nbytes;
    return version >= 2 ? (end + PAYLOAD_ALIGN - 1) / PAYLOAD_ALIGN * PAYLOAD_ALIGN - end : 0;
}

/* Per-record outcome, as read_run returns it. */
enum { ST_OK = 0, ST_BAD = 1, ST_MEDIA = 2, ST_PYTHON = 3, ST_TRANSIENT = 4 };

/* ------------------------------------------------------------------ the threads' CPUs */
/* An engine may pin each of its threads to one core (vLLM-CPU does), and a thread inherits its creator's
 * pin: the helper threads of a call made on the model's thread would all share that one core. With a set
 * given (set_work_cpus: every CPU the process's threads may use), each helper thread gets it instead. */
static cpu_set_t work_cpus;
static atomic_int have_work_cpus;

static int start_thread(pthread_t *tid, void *(*fn)(void *), void *arg) {
    int err = pthread_create(tid, NULL, fn, arg);
    if (err == 0 && atomic_load(&have_work_cpus)) pthread_setaffinity_np(*tid, sizeof work_cpus, &work_cpus);
    return err;
}

static PyObject *set_work_cpus(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "set_work_cpus: a sequence of CPU numbers");
    if (!seq) return NULL;
    cpu_set_t set;
    CPU_ZERO(&set);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long cpu = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (cpu == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET((int)cpu, &set); /* beyond a cpu_set_t: not spread to */
    }
    Py_DECREF(seq);
    /* Set at import and again in a forked child or when an engine has pinned its threads, before any call
     * spawns helpers (tierkv.cpus): off while the set is written, so no helper reads it half-written. */
    atomic_store(&have_work_cpus, 0);
    if (CPU_COUNT(&set)) {
        work_cpus = set;
        atomic_store(&have_work_cpus, 1);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ xxh3 from libxxhash */
typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_fn)(const void *);
typedef int (*xxh3_free_fn)(void *);
static xxh3_fn xxh3;
static xxh3_create_fn xxh3_create;
static xxh3_reset_fn xxh3_reset;
static xxh3_update_fn xxh3_update;
static xxh3_digest_fn xxh3_digest;
static xxh3_free_fn xxh3_free;
static int xxh3_dispatched; /* the library's runtime-dispatched entry points (AVX2, AVX-512) are in use */
static char unavailable[256];

static int load_xxhash(void) {
    void *lib = dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        char first[160];
        snprintf(first, sizeof first, "%s", dlerror()); /* the runtime library's error, not the -dev link's */
        lib = dlopen("libxxhash.so", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            snprintf(unavailable, sizeof unavailable,
                     "no libxxhash.so.0 on this system (install libxxhash0 on Debian/Ubuntu, xxhash-libs on "
                     "Fedora): %s", first);
            return 0;
        }
    }
    xxh3 = (xxh3_fn)dlsym(lib, "XXH3_64bits");
    xxh3_create = (xxh3_create_fn)dlsym(lib, "XXH3_createState");
    xxh3_reset = (xxh3_reset_fn)dlsym(lib, "XXH3_64bits_reset");
    xxh3_update = (xxh3_update_fn)dlsym(lib, "XXH3_64bits_update");
    xxh3_digest = (xxh3_digest_fn)dlsym(lib, "XXH3_64bits_digest");
    xxh3_free = (xxh3_free_fn)dlsym(lib, "XXH3_freeState");
    if (!xxh3 || !xxh3_create || !xxh3_reset || !xxh3_update || !xxh3_digest || !xxh3_free) {
        snprintf(unavailable, sizeof unavailable, "libxxhash lacks the XXH3 functions");
        return 0;
    }
    /* A library built with its x86 dispatcher (Debian's 0.8.1 is) also exports entry points that pick
     * AVX2 or AVX-512 at run time; the plain ones are SSE2 only. Same results, same state (reset and
     * digest are shared): 39 against 18 GB/s on this machine's EPYC, and the checksum is most of a warm
     * read's and a seal's work beside the copy. */
    xxh3_fn fast = (xxh3_fn)dlsym(lib, "XXH3_64bits_dispatch");
    xxh3_update_fn fast_update = (xxh3_update_fn)dlsym(lib, "XXH3_64bits_update_dispatch");
    const char *plain = getenv("TIERKV_XXH3_PLAIN");
    if (fast && fast_update && !(plain && strcmp(plain, "1") == 0)) {
        /* The dispatcher picks its code on its first call of more than 240 bytes: made here, once,
         * under the GIL, not raced by the reading threads. */
        static const uint8_t prime[256];
        (void)fast(prime, sizeof prime);
        xxh3 = fast;
        xxh3_update = fast_update;
        xxh3_dispatched = 1;
    }
    return 1;
}

/* ------------------------------------------------------------------ injected faults (tests only) */
/* A read (or, for a fault listed for writes, a write) that overlaps a listed byte range of a listed file
 * fails with the listed errno, as a bad sector would: the fault tests use the same faults against this
 * path and the Python one. A fault listed for O_DIRECT only (FAULT_DIRECT) fails only the reads or writes
 * through an O_DIRECT descriptor: a file system refusing O_DIRECT after it opened. */
#define FAULT_WRITES 1
#define FAULT_DIRECT 2
typedef struct { dev_t dev; ino_t ino; int64_t start, end; int err, kind; } fault_t;
static fault_t faults[64];
static atomic_int nfaults;
static pthread_mutex_t faults_lock = PTHREAD_MUTEX_INITIALIZER;

static int injected(int fd, int64_t off, int64_t len, int writes) {
    if (atomic_load(&nfaults) == 0) return 0;
    struct stat st;
    if (fstat(fd, &st) != 0) return 0;
    int direct = (fcntl(fd, F_GETFL) & O_DIRECT) != 0, err = 0;
    pthread_mutex_lock(&faults_lock);
    for (int i = 0; i < atomic_load(&nfaults) && !err; i++)
        if ((faults[i].kind & FAULT_WRITES) == (writes ? FAULT_WRITES : 0) &&
            (direct || !(faults[i].kind & FAULT_DIRECT)) && faults[i].dev == st.st_dev &&
            faults[i].ino == st.st_ino && off < faults[i].end && faults[i].start < off + len)
            err = faults[i].err;
    pthread_mutex_unlock(&faults_lock);
    return err;
}

/* ------------------------------------------------------------------ bounce buffers */
/* Aligned O_DIRECT buffers, kept between calls: a fresh one pays a page fault per 4 KiB. */
#define BOUNCE_KEEP 16
static void *bounce_free[BOUNCE_KEEP];
static int bounce_nfree;
static pthread_mutex_t bounce_lock = PTHREAD_MUTEX_INITIALIZER;

static void *bounce_get(void) {
    void *p = NULL;
    pthread_mutex_lock(&bounce_lock);
    if (bounce_nfree) p = bounce_free[--bounce_nfree];
    pthread_mutex_unlock(&bounce_lock);
    if (!p && posix_memalign(&p, ALIGN, GROUP_NBYTES + ALIGN) != 0) p = NULL;
    return p;
}

static void bounce_put(void *p) {
    if (!p) return;
    pthread_mutex_lock(&bounce_lock);
    if (bounce_nfree < BOUNCE_KEEP) {
        bounce_free[bounce_nfree++] = p;
        p = NULL;
    }
    pthread_mutex_unlock(&bounce_lock);
    free(p);
}

static int usable_cpus(void);

/* ------------------------------------------------------------------ a run to read */
typedef struct {
    /* as packed by Python, 6 x int64 per record: the segment's descriptors (with readahead, without, and
     * O_DIRECT or -1), the record's offset and length, its block position in the destination */
    int64_t fd, rfd, dfd, offset, nbytes, pos;
} req_t;

typedef struct {
    /* inputs */
    const req_t *reqs;
    int64_t n;
    const uint64_t *rows; /* (layer, k/v) slab base addresses */
    int64_t nrows, chunk, row_nbytes;
    uint8_t *prefix;      /* n x prefix_nbytes: each record's header and token ids land here */
    int64_t prefix_nbytes, token_nbytes;
    int64_t record_nbytes; /* a version-1 record's length; a version-2 one's is inner_pad(2, ...) longer */
    const uint8_t *ns_digest, *keys, *tokens;
    int dtype, ndim;
    uint32_t shape[MAX_NDIM];
    int direct_ok;
    /* groups of adjacent records: [first, count) */
    int64_t *gfirst, *gcount, ngroups;
    uint8_t *gahead;      /* per group: read with readahead (it lies in a run of adjacent records) */
    atomic_long next;
    /* per record: its payload's xxh3, taken as its bytes arrived (``hashed``), else verify hashes it */
    uint64_t *checks;
    uint8_t *hashed;
    /* outputs */
    uint8_t *status;
    int *errnos;
    atomic_llong nbytes_cached, nbytes_direct, nbytes_blocking;
} run_t;

static inline int64_t aligned(int64_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* A file system refusing O_DIRECT: EINVAL (Linux's own), EOPNOTSUPP (some FUSE and network ones). */
static int refuses_direct(int err) { return err == EINVAL || err == EOPNOTSUPP; }

static int is_media(int err) {
    return err == EIO || err == ENODATA || err == EBADMSG || err == EUCLEAN || err == EREMOTEIO;
}

/* The iovecs of records [first, first+count) as they lie in the file: each record's prefix, (version 2)
 * the zeros before its payload into a scratch page, its slab pieces, then (between records) its page
 * padding into the scratch page. */
static int build_iov(run_t *r, int64_t first, int64_t count, struct iovec *iov, uint8_t *pad) {
    int k = 0;
    for (int64_t j = first; j < first + count; j++) {
        const req_t *q = &r->reqs[j];
        iov[k].iov_base = r->prefix + j * r->prefix_nbytes;
        iov[k++].iov_len = (size_t)r->prefix_nbytes;
        if (q->nbytes > r->record_nbytes) { /* version 2's zeros before the payload (checked at the call) */
            iov[k].iov_base = pad;
            iov[k++].iov_len = (size_t)(q->nbytes - r->record_nbytes);
        }
        for (int64_t row = 0; row < r->nrows; row++) {
            iov[k].iov_base = (void *)(uintptr_t)(r->rows[row] + (uint64_t)(q->pos * r->chunk));
            iov[k++].iov_len = (size_t)r->chunk;
        }
        int64_t padn = aligned(q->nbytes) - q->nbytes;
        if (padn && j != first + count - 1) {
            iov[k].iov_base = pad;
            iov[k++].iov_len = (size_t)padn;
        }
    }
    return k;
}

/* Drop the first `n` bytes of an iovec list in place; returns the new start index. */
static int iov_advance(struct iovec *iov, int k, int at, size_t n) {
    while (at < k && n >= iov[at].iov_len) {
        n -= iov[at].iov_len;
        at++;
    }
    if (at < k && n) {
        iov[at].iov_base = (uint8_t *)iov[at].iov_base + n;
        iov[at].iov_len -= n;
    }
    return at;
}

/* Copy `n` bytes from `src` into the iovec list, consuming it. */
static int iov_fill(struct iovec *iov, int k, int at, const uint8_t *src, size_t n) {
    while (at < k && n) {
        size_t m = n < iov[at].iov_len ? n : iov[at].iov_len;
        memcpy(iov[at].iov_base, src, m);
        src += m;
        n -= m;
        if (m == iov[at].iov_len) at++;
        else {
            iov[at].iov_base = (uint8_t *)iov[at].iov_base + m;
            iov[at].iov_len -= m;
        }
    }
    return at;
}

/* How many bytes from `off` (page-aligned) the page cache holds without a gap, up to `len`. mincore on a
 * mapping of the range: unlike a RWF_NOWAIT read, it starts no readahead (which would read the same
 * bytes twice, once buffered and once with O_DIRECT). */
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* the same number on every architecture (Linux 6.5) */
#endif
static atomic_int no_cachestat;

/* Whether the page cache holds all of [off, off + len): 1 or 0, or -1 where cachestat(2) is missing.
 * cachestat counts cached pages without touching the process's memory map (mincore needs a mapping, and
 * mmap/munmap take the map's lock for writing, against the model's page faults). */
static int cached_whole(int fd, int64_t off, int64_t len) {
    static long page;
    if (!page) page = sysconf(_SC_PAGESIZE);
    if (atomic_load(&no_cachestat)) return -1;
    struct { uint64_t off, len; } range = {(uint64_t)off, (uint64_t)len};
    struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } cs;
    if (syscall(__NR_cachestat, fd, &range, &cs, 0) == 0) {
        uint64_t pages = (uint64_t)((off + len + page - 1) / page - off / page);
        return cs.nr_cache >= pages;
    }
    if (errno == ENOSYS || errno == EPERM) atomic_store(&no_cachestat, 1);
    return -1;
}

static int64_t resident_prefix(int fd, int64_t off, int64_t len) {
    static long page;
    if (!page) page = sysconf(_SC_PAGESIZE);
    int whole = cached_whole(fd, off, len); /* all or nothing: a range not wholly cached is read from disk */
    if (whole >= 0) return whole ? len : 0;
    int64_t done = 0;
    unsigned char vec[512];
    while (done < len) {
        int64_t at = off + done, map_off = at / page * page;
        int64_t span = (int64_t)sizeof vec * page - (at - map_off);
        if (span > len - done) span = len - done;
        size_t map_len = (size_t)(at - map_off + span);
        void *m = mmap(NULL, map_len, PROT_READ, MAP_SHARED, fd, map_off);
        if (m == MAP_FAILED) return done;
        int rc = mincore(m, map_len, vec);
        munmap(m, map_len);
        if (rc != 0) return done;
        size_t npages = (map_len + (size_t)page - 1) / (size_t)page, p = 0;
        while (p < npages && (vec[p] & 1)) p++;
        int64_t resident = (int64_t)(p * (size_t)page) - (at - map_off);
        if (p < npages) return done + (resident > 0 ? resident : 0);
        done += span;
    }
    return len;
}

/* A buffered read of `limit` bytes into the iovec list (consumed); the bytes read, or -errno. */
static int64_t preadv_upto(int fd, struct iovec *iov, int k, int *at, int64_t off, int64_t limit) {
    int64_t done = 0;
    while (done < limit && *at < k) {
        struct iovec part[IOV_CAP];
        int m = 0;
        int64_t want = 0;
        for (int i = *at; i < k && want < limit - done; i++, m++) {
            part[m] = iov[i];
            if (want + (int64_t)part[m].iov_len > limit - done) part[m].iov_len = (size_t)(limit - done - want);
            want += (int64_t)part[m].iov_len;
        }
        ssize_t got = preadv(fd, part, m, off + done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) break;
        done += got;
        *at = iov_advance(iov, k, *at, (size_t)got);
    }
    return done;
}

static atomic_llong hashed_total; /* records whose payload was hashed as it arrived (tests: hashed_on_arrival) */

/* Where the hashing of a group's payloads stands: record j, hashed up to file offset pos. */
typedef struct {
    int64_t j, end, pos;
} hcur_t;

/* The payload bytes of the group's records now in place up to file offset ``upto``, hashed: each record's
 * digest into r->checks once its payload is whole. Hashes the destination, what a restore serves. */
static void hash_arrived(run_t *r, hcur_t *c, int64_t upto, void *state) {
    int64_t payload_nbytes = r->nrows * r->chunk;
    while (c->j < c->end) {
        const req_t *q = &r->reqs[c->j];
        int64_t p1 = q->offset + q->nbytes, p0 = p1 - payload_nbytes;
        if (c->pos < p0) { /* this record's payload starts */
            if (upto <= p0) return;
            if (xxh3_reset(state) != 0) {
                c->j = c->end; /* verify hashes them */
                return;
            }
            c->pos = p0;
        }
        int64_t stop = upto < p1 ? upto : p1;
        while (c->pos < stop) {
            int64_t rel = c->pos - p0, row = rel / r->chunk, within = rel % r->chunk;
            int64_t m = r->chunk - within < stop - c->pos ? r->chunk - within : stop - c->pos;
            xxh3_update(state, (const uint8_t *)(uintptr_t)(r->rows[row] + (uint64_t)(q->pos * r->chunk)) + within,
                        (size_t)m);
            c->pos += m;
        }
        if (c->pos < p1) return;
        r->checks[c->j] = xxh3_digest(state);
        r->hashed[c->j++] = 1;
        atomic_fetch_add(&hashed_total, 1);
    }
}

/* Read one group into place, with readahead if ``ahead``. Returns 0, a positive errno (the read failed),
 * or -1 (short: the file ends before the records do). */
static int read_group(run_t *r, int64_t first, int64_t count, int ahead, void **bounce, uint8_t *pad,
                      void *state) {
    const req_t *q0 = &r->reqs[first], *ql = &r->reqs[first + count - 1];
    int64_t off = q0->offset, total = ql->offset + ql->nbytes - off;
    /* Readahead only within a run of adjacent records: a lone record's neighbours belong to other
     * prefixes, and reading them would halve the bandwidth. Not by the group's size alone: a record of
     * 1 MiB or more is a group of its own, and what a read without readahead brings into the page cache
     * is kept in single pages, which a warm read later copies out 1.6x slower than readahead's large
     * folios (measured: 5.8-6.9 against 9.6-11.5 GB/s, 2026-12-05). */
    int fd = (int)(ahead ? q0->fd : q0->rfd);
    struct iovec iov[IOV_CAP];
    int k = build_iov(r, first, count, iov, pad), at = 0;
    int64_t done = 0;
    hcur_t cur = {first, first + count, -1};
    memset(r->hashed + first, 0, (size_t)count);
    int err = injected(fd, off, total, 0);
    if (err) return err;
    /* What the page cache holds: straight into place, one copy. */
    int64_t cached = r->direct_ok && q0->dfd >= 0 ? resident_prefix(fd, off, total) : 0;
    while (done < cached) {
        int64_t want = cached - done < HASH_PIECE_NBYTES ? cached - done : HASH_PIECE_NBYTES;
        int64_t got = preadv_upto(fd, iov, k, &at, off + done, want);
        if (got < 0) return (int)-got;
        done += got;
        hash_arrived(r, &cur, off + done, state);
        if (got < want) break; /* the file ends: what is left, below */
    }
    atomic_fetch_add(&r->nbytes_cached, done);
    if (done == total) return 0;
    if (r->direct_ok && q0->dfd >= 0) {
        /* The rest from the disk: O_DIRECT from the page boundary at or before it, through the bounce
         * buffer (GROUP_NBYTES + ALIGN long), then copied into place. */
        if (!*bounce) *bounce = bounce_get();
        int64_t pos = off + done, end = off + total;
        while (*bounce && pos < end) {
            int64_t start = pos / ALIGN * ALIGN, want = aligned(end) - start;
            size_t len = (size_t)(want < (int64_t)GROUP_NBYTES ? want : (int64_t)GROUP_NBYTES);
            int fault = injected((int)q0->dfd, start, (int64_t)len, 0);
            if (fault) errno = fault;
            ssize_t got = fault ? -1 : pread((int)q0->dfd, *bounce, len, start);
            if (got < 0) {
                if (errno == EINTR) continue;
                if (refuses_direct(errno)) break; /* this file or range refuses O_DIRECT: buffered below */
                return errno;
            }
            if (got == 0) return -1;
            atomic_fetch_add(&r->nbytes_direct, got);
            int64_t useful = start + got < end ? start + got : end;
            while (useful > pos) {
                int64_t m = useful - pos < HASH_PIECE_NBYTES ? useful - pos : HASH_PIECE_NBYTES;
                at = iov_fill(iov, k, at, (uint8_t *)*bounce + (pos - start), (size_t)m);
                pos += m;
                hash_arrived(r, &cur, pos, state);
            }
            if (got % ALIGN) break; /* the file ends inside a page: what is left, buffered below */
        }
        done = pos - off;
        if (done == total) return 0;
    }
    /* No O_DIRECT here (tmpfs, an unaligned tail, no memory for a bounce): a plain blocking read. In pieces
     * only where the page cache holds it all: a range it lacks is one request, all of it in flight (a lone
     * record is read without readahead, and pieces would go to the disk one after another). */
    int64_t piece = cached_whole(fd, off + done, total - done) == 1 ? HASH_PIECE_NBYTES : total - done;
    while (done < total) {
        int64_t want = total - done < piece ? total - done : piece;
        int64_t got = preadv_upto(fd, iov, k, &at, off + done, want);
        if (got < 0) return (int)-got;
        if (got == 0) return -1;
        atomic_fetch_add(&r->nbytes_blocking, got);
        done += got;
        hash_arrived(r, &cur, off + done, state);
    }
    return 0;
}

/* Whether record j, now in place, is the block asked for. */
static int verify(run_t *r, int64_t j, void *state) {
    const req_t *q = &r->reqs[j];
    const uint8_t *h = r->prefix + j * r->prefix_nbytes;
    int version = rd16(h + 4);
    if (memcmp(h, "TKVB", 4) != 0 || (version != 1 && version != 2)) return ST_BAD;
    uint32_t token_count = rd32(h + 36);
    if (token_count * 4ull != (uint64_t)r->token_nbytes) return ST_BAD;
    if (xxh3_reset(state) != 0) return ST_BAD;
    xxh3_update(state, h, FIELDS_NBYTES);
    xxh3_update(state, h + HEADER_NBYTES, (size_t)r->token_nbytes);
    if (xxh3_digest(state) != rd64(h + FIELDS_NBYTES)) return ST_BAD;
    /* The header is as written; now, is it this block? */
    int codec = h[6], dtype = h[7], ndim = h[8];
    if (dtype != r->dtype || ndim != r->ndim) return ST_BAD;
    for (int d = 0; d < ndim; d++)
        if (rd32(h + 12 + 4 * d) != r->shape[d]) return ST_BAD;
    if (memcmp(h + 40, r->ns_digest, 32) != 0) return ST_BAD;
    if (memcmp(h + 104, r->keys + 32 * j, 32) != 0) return ST_BAD;
    if (memcmp(h + HEADER_NBYTES, r->tokens + r->token_nbytes * j, (size_t)r->token_nbytes) != 0) return ST_BAD;
    uint64_t raw_nbytes = rd64(h + 144), stored = rd64(h + 152), check = rd64(h + 160);
    if (stored > MAX_PAYLOAD_NBYTES || raw_nbytes > MAX_PAYLOAD_NBYTES) return ST_BAD;
    /* compressed yet of a raw record's length: Python decodes it (from the bytes after its token ids:
     * its payload may start elsewhere than the length's layout put it) */
    if (codec != 0) return ST_PYTHON;
    /* raw: the layout it was read with (from its length) must be its version's */
    if (stored != raw_nbytes) return ST_BAD;
    if ((uint64_t)(r->prefix_nbytes + inner_pad(version, r->token_nbytes)) + stored != (uint64_t)q->nbytes) return ST_BAD;
    if (raw_nbytes != (uint64_t)(r->nrows * r->chunk)) return ST_BAD;
    if (r->hashed[j]) return r->checks[j] == check ? ST_OK : ST_BAD; /* hashed as it arrived */
    if (xxh3_reset(state) != 0) return ST_BAD;
    for (int64_t row = 0; row < r->nrows; row++)
        xxh3_update(state, (const void *)(uintptr_t)(r->rows[row] + (uint64_t)(q->pos * r->chunk)), (size_t)r->chunk);
    return xxh3_digest(state) == check ? ST_OK : ST_BAD;
}

static void settle(run_t *r, int64_t first, int64_t count, int err, void *state) {
    for (int64_t j = first; j < first + count; j++) {
        if (err > 0) {
            r->status[j] = is_media(err) ? ST_MEDIA : ST_TRANSIENT;
            r->errnos[j] = err;
        } else if (err < 0) {
            r->status[j] = ST_BAD;
        } else {
            r->status[j] = (uint8_t)verify(r, j, state);
        }
    }
}

static void *worker(void *arg) {
    run_t *r = arg;
    void *bounce = NULL, *state = xxh3_create();
    uint8_t *pad = NULL;
    if (posix_memalign((void **)&pad, ALIGN, ALIGN) != 0) pad = NULL;
    for (;;) {
        long g = atomic_fetch_add(&r->next, 1);
        if (g >= r->ngroups) break;
        int64_t first = r->gfirst[g], count = r->gcount[g];
        if (!state || !pad) {
            settle(r, first, count, ENOMEM, NULL);
            continue;
        }
        int err = read_group(r, first, count, r->gahead[g], &bounce, pad, state);
        if (count > 1 && (err < 0 || (err > 0 && is_media(err)))) {
            /* A bad sector or the file's end: which record is it in? Each alone: the others are served. */
            for (int64_t j = first; j < first + count; j++)
                settle(r, j, 1, read_group(r, j, 1, 0, &bounce, pad, state), state);
            continue;
        }
        settle(r, first, count, err, state);
    }
    bounce_put(bounce);
    if (state) xxh3_free(state);
    free(pad);
    return NULL;
}

/* ------------------------------------------------------------------ Python: read_run */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: a contiguous%s buffer is needed", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(read_run_doc,
    "read_run(reqs, rows, chunk, row_nbytes, prefix, token_nbytes, ns_digest, keys, tokens, dtype, shape,\n"
    "         threads, direct) -> (status: bytes, errnos: list, (cached, direct, blocking) bytes)\n\n"
    "reqs: int64 [n, 6] (fd, fd without readahead, O_DIRECT fd or -1, offset, record nbytes, block position);\n"
    "a segment; rows: int64 addresses of the destination's (layer, k/v) slabs, each row_nbytes long;\n"
    "prefix: writable, n x (176 + token_nbytes) bytes, receives each record's header and token ids.");

static PyObject *read_run(PyObject *self, PyObject *args) {
    PyObject *o_reqs, *o_rows, *o_prefix, *o_ns, *o_keys, *o_tokens, *o_shape;
    long long chunk, row_nbytes, token_nbytes;
    int dtype, threads, direct;
    if (!PyArg_ParseTuple(args, "OOLLOLOOOiOii", &o_reqs, &o_rows, &chunk, &row_nbytes, &o_prefix, &token_nbytes,
                          &o_ns, &o_keys, &o_tokens, &dtype, &o_shape, &threads, &direct))
        return NULL;
    if (!xxh3) return PyErr_Format(PyExc_RuntimeError, "tierkv._native unavailable: %s", unavailable);
    Py_buffer reqs = {0}, rows = {0}, prefix = {0}, ns = {0}, keys = {0}, tokens = {0};
    PyObject *result = NULL;
    run_t r;
    memset(&r, 0, sizeof r);
    if (get_buffer(o_reqs, &reqs, 0, "reqs") || get_buffer(o_rows, &rows, 0, "rows") ||
        get_buffer(o_prefix, &prefix, 1, "prefix") || get_buffer(o_ns, &ns, 0, "ns_digest") ||
        get_buffer(o_keys, &keys, 0, "keys") || get_buffer(o_tokens, &tokens, 0, "tokens"))
        goto done;
    int64_t n = reqs.len / (Py_ssize_t)sizeof(req_t);
    int64_t nrows = rows.len / 8, prefix_nbytes = HEADER_NBYTES + token_nbytes;
    int64_t keys_len, tokens_len, prefix_len, payload_nbytes, record_nbytes;
    /* Everything the threads will touch, checked here, with the GIL (the row addresses and row_nbytes are
     * the caller's word: tierkv passes a live tensor's). */
    if (reqs.len % (Py_ssize_t)sizeof(req_t) || rows.len % 8 || nrows < 1 || chunk <= 0 || row_nbytes <= 0 ||
        token_nbytes < 0 || token_nbytes % 4 || token_nbytes > (1 << 24) || ns.len != 32 ||
        __builtin_mul_overflow(n, 32, &keys_len) || keys.len != keys_len ||
        __builtin_mul_overflow(n, token_nbytes, &tokens_len) || tokens.len != tokens_len ||
        __builtin_mul_overflow(n, prefix_nbytes, &prefix_len) || prefix.len < prefix_len ||
        __builtin_mul_overflow(nrows, chunk, &payload_nbytes) ||
        __builtin_add_overflow(payload_nbytes, prefix_nbytes, &record_nbytes) || (int64_t)(nrows + 3) > IOV_CAP) {
        PyErr_SetString(PyExc_ValueError, "read_run: inconsistent sizes");
        goto done;
    }
    if (!PySequence_Check(o_shape) || PySequence_Size(o_shape) < 1 || PySequence_Size(o_shape) > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "read_run: shape must have 1 to 6 dimensions");
        goto done;
    }
    r.ndim = (int)PySequence_Size(o_shape);
    for (int d = 0; d < r.ndim; d++) {
        PyObject *it = PySequence_GetItem(o_shape, d);
        long v = it ? PyLong_AsLong(it) : -1;
        Py_XDECREF(it);
        if (v < 0 || v > UINT32_MAX) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "read_run: bad shape");
            goto done;
        }
        r.shape[d] = (uint32_t)v;
    }
    const req_t *rq = reqs.buf;
    /* Each record's own place: two at one position would leave one's bytes where the other's were checked. */
    uint8_t *taken = PyMem_Calloc((size_t)(row_nbytes / chunk) + 1, 1);
    if (!taken) {
        PyErr_NoMemory();
        goto done;
    }
    for (int64_t j = 0; j < n; j++) {
        int64_t end_nbytes, file_end;
        if (rq[j].fd < 0 || rq[j].rfd < 0 || rq[j].offset < 0 || rq[j].offset % ALIGN || rq[j].pos < 0 ||
            __builtin_mul_overflow(rq[j].pos + 1, chunk, &end_nbytes) || end_nbytes > row_nbytes ||
            (rq[j].nbytes != record_nbytes && rq[j].nbytes != record_nbytes + inner_pad(2, token_nbytes)) ||
            __builtin_add_overflow(rq[j].offset, aligned(rq[j].nbytes), &file_end)) {
            PyErr_Format(PyExc_ValueError, "read_run: record %lld out of bounds", (long long)j);
            PyMem_Free(taken);
            goto done;
        }
        if (taken[rq[j].pos]++) {
            PyErr_Format(PyExc_ValueError, "read_run: records at one position (%lld)", (long long)rq[j].pos);
            PyMem_Free(taken);
            goto done;
        }
    }
    PyMem_Free(taken);
    r.reqs = rq;
    r.n = n;
    r.rows = rows.buf;
    r.nrows = nrows;
    r.chunk = chunk;
    r.row_nbytes = row_nbytes;
    r.prefix = prefix.buf;
    r.prefix_nbytes = prefix_nbytes;
    r.token_nbytes = token_nbytes;
    r.record_nbytes = record_nbytes;
    r.ns_digest = ns.buf;
    r.keys = keys.buf;
    r.tokens = tokens.buf;
    r.dtype = dtype;
    r.direct_ok = direct;
    r.gfirst = PyMem_Calloc((size_t)n + 1, sizeof(int64_t));
    r.gcount = PyMem_Calloc((size_t)n + 1, sizeof(int64_t));
    r.gahead = PyMem_Calloc((size_t)n + 1, 1);
    r.status = PyMem_Malloc((size_t)n + 1);
    r.errnos = PyMem_Calloc((size_t)n + 1, sizeof(int));
    r.checks = PyMem_Calloc((size_t)n + 1, sizeof(uint64_t));
    r.hashed = PyMem_Calloc((size_t)n + 1, 1);
    if (!r.gfirst || !r.gcount || !r.gahead || !r.status || !r.errnos || !r.checks || !r.hashed) {
        PyErr_NoMemory();
        goto done;
    }
    memset(r.status, ST_BAD, (size_t)n + 1); /* a record no thread settled is never served */
    /* Adjacent records of one file make one request, up to GROUP_NBYTES and the iovec limit. */
    int64_t per_rec_iov = nrows + 3;
    for (int64_t j = 0; j < n; j++) {
        if (r.ngroups) {
            int64_t g = r.ngroups - 1, last = r.gfirst[g] + r.gcount[g] - 1;
            int64_t span = rq[j].offset + rq[j].nbytes - rq[r.gfirst[g]].offset;
            int adjacent = rq[last].fd == rq[j].fd && rq[last].rfd == rq[j].rfd &&
                           rq[last].offset + aligned(rq[last].nbytes) == rq[j].offset;
            if (adjacent && span <= (int64_t)GROUP_NBYTES && (r.gcount[g] + 1) * per_rec_iov <= IOV_CAP) {
                r.gcount[g]++;
                r.gahead[g] = 1;
                continue;
            }
            if (adjacent) r.gahead[g] = r.gahead[r.ngroups] = 1; /* one run, cut into groups */
        }
        r.gfirst[r.ngroups] = j;
        r.gcount[r.ngroups++] = 1;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > r.ngroups) threads = (int)r.ngroups;
    Py_BEGIN_ALLOW_THREADS
    /* A run the page cache holds (its first and last groups say: a prompt's records are written, and
     * read, together) is copying, not waiting: more threads than CPUs only take turns (warm 48 MiB
     * restores: 8.0 GB/s on 8 threads, 8.5 on 2, with 2 CPUs). A disk needs the queue depth. */
    if (threads > 1 && r.ngroups) {
        /* the helpers' CPUs (set_work_cpus: an engine may pin the calling thread to one core) */
        int cpus = atomic_load(&have_work_cpus) ? CPU_COUNT(&work_cpus) : usable_cpus();
        if (cpus < 1) cpus = 1;
        const req_t *a = &rq[r.gfirst[0]], *b = &rq[r.gfirst[r.ngroups - 1] + r.gcount[r.ngroups - 1] - 1];
        const req_t *a_end = &rq[r.gfirst[0] + r.gcount[0] - 1], *b_first = &rq[r.gfirst[r.ngroups - 1]];
        if (threads > cpus && cached_whole((int)a->fd, a->offset, a_end->offset + a_end->nbytes - a->offset) == 1 &&
            cached_whole((int)b->fd, b_first->offset, b->offset + b->nbytes - b_first->offset) == 1)
            threads = cpus;
    }
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (start_thread(&tids[started], worker, &r) != 0) break;
        started++;
    }
    if (r.ngroups) worker(&r); /* the calling thread reads too */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    {
        PyObject *errs = PyList_New(0);
        if (!errs) goto done;
        for (int64_t j = 0; j < n; j++) {
            PyObject *e = PyLong_FromLong(r.errnos[j]);
            if (!e || PyList_Append(errs, e) != 0) {
                Py_XDECREF(e);
                Py_DECREF(errs);
                goto done;
            }
            Py_DECREF(e);
        }
        result = Py_BuildValue("(y#N(LLL))", (const char *)r.status, (Py_ssize_t)n, errs,
                               (long long)atomic_load(&r.nbytes_cached), (long long)atomic_load(&r.nbytes_direct),
                               (long long)atomic_load(&r.nbytes_blocking));
    }
done:
    PyMem_Free(r.gfirst);
    PyMem_Free(r.gcount);
    PyMem_Free(r.gahead);
    PyMem_Free(r.status);
    PyMem_Free(r.errnos);
    PyMem_Free(r.checks);
    PyMem_Free(r.hashed);
    if (reqs.obj) PyBuffer_Release(&reqs);
    if (rows.obj) PyBuffer_Release(&rows);
    if (prefix.obj) PyBuffer_Release(&prefix);
    if (ns.obj) PyBuffer_Release(&ns);
    if (keys.obj) PyBuffer_Release(&keys);
    if (tokens.obj) PyBuffer_Release(&tokens);
    return result;
}

/* ------------------------------------------------------------------ the writer's file operations (tests) */
/* The power-cut harness records every write and sync that reaches a segment file; the native writer's
 * happen here, so it logs them when asked (trace_writes), in order, for the harness to replay. */
typedef struct { int sync; int fd; int64_t offset, nbytes; } wtrace_t; /* sync: 0 write, 1 sync, 2 allocate, 3 punch */
static wtrace_t wtrace[8192];
static int wtrace_n, wtrace_on, wtrace_lost;
static pthread_mutex_t wtrace_lock = PTHREAD_MUTEX_INITIALIZER;

static void wtrace_add(int sync, int fd, int64_t offset, int64_t nbytes) {
    if (!wtrace_on) return;
    pthread_mutex_lock(&wtrace_lock);
    if (wtrace_n < (int)(sizeof wtrace / sizeof *wtrace)) wtrace[wtrace_n++] = (wtrace_t){sync, fd, offset, nbytes};
    else wtrace_lost = 1;
    pthread_mutex_unlock(&wtrace_lock);
}

static PyObject *trace_writes(PyObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    pthread_mutex_lock(&wtrace_lock);
    int lost = wtrace_lost;
    PyObject *out = lost ? NULL : PyList_New(wtrace_n);
    for (int i = 0; out && i < wtrace_n; i++) {
        static const char *kinds[] = {"write", "sync", "allocate", "punch"};
        const char *kind = kinds[wtrace[i].sync];
        PyObject *ev = Py_BuildValue("(siLL)", kind, wtrace[i].fd,
                                     (long long)wtrace[i].offset, (long long)wtrace[i].nbytes);
        if (!ev) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, ev);
    }
    wtrace_n = wtrace_lost = 0;
    wtrace_on = on;
    pthread_mutex_unlock(&wtrace_lock);
    if (lost) PyErr_SetString(PyExc_OverflowError, "trace_writes: more operations than the trace holds");
    return out;
}

/* ------------------------------------------------------------------ write_run */
/* Background byte work runs at SCHED_IDLE only here, with the GIL released: a thread preempted at idle
 * priority while holding the GIL would stall every Python thread for as long as the cores stay busy. */
typedef struct { int policy; int ok; } prio_t;

static atomic_int idle_broken; /* a return from SCHED_IDLE failed once: never go idle again */

static prio_t go_idle(int idle) {
    prio_t p = {SCHED_OTHER, 0};
    if (!idle || atomic_load(&idle_broken)) return p;
    p.policy = sched_getscheduler(0);
    struct sched_param sp = {0};
    p.ok = p.policy == SCHED_OTHER && sched_setscheduler(0, SCHED_IDLE, &sp) == 0;
    return p;
}

static void come_back(prio_t p) {
    struct sched_param sp = {0};
    if (p.ok && sched_setscheduler(0, p.policy, &sp) != 0) {
        atomic_store(&idle_broken, 1);
        setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19); /* the least harm left: nice 19 */
    }
}

/* Whether a thread of this process may go to SCHED_IDLE and come back: tried on a throwaway pthread, so
 * no Python runs at idle priority meanwhile (what capabilities say is not enough: CAP_SYS_NICE inside a
 * user namespace is checked against the initial one). */
static void *idle_probe(void *arg) {
    struct sched_param sp = {0};
    int *ok = arg;
    if (sched_setscheduler(0, SCHED_IDLE, &sp) == 0) *ok = sched_setscheduler(0, SCHED_OTHER, &sp) == 0;
    return NULL;
}

static PyObject *can_leave_idle(PyObject *self, PyObject *unused) {
    int ok = 0;
    pthread_t t;
    Py_BEGIN_ALLOW_THREADS
    if (pthread_create(&t, NULL, idle_probe, &ok) == 0) pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

typedef struct { Py_buffer head, tokens, payload; int64_t pad; } wrec_t; /* pad: inner_pad of its version */

/* write_run's chunk images (O_DIRECT): page-aligned buffers of IMAGE_NBYTES, kept between calls
 * and faulted in when allocated, at the caller's own priority: a page fault taken at idle priority holds
 * the process's memory map lock for as long as the cores stay busy. A chunk of one larger record goes
 * through two of them (``seal_write_large``); a chunk without an image (no memory) is written buffered. */
#define MAX_SEALERS 4
#define IMAGE_KEEP (2 * (MAX_SEALERS + 1)) /* two per sealing thread (a large record's) */
static void *image_free[IMAGE_KEEP];
static int image_nfree;
static pthread_mutex_t image_lock = PTHREAD_MUTEX_INITIALIZER;

/* Tests only (fail_images): the next image_skip calls succeed, then image_fail calls get no image. */
static atomic_int image_skip, image_fail;

static void *image_get(void) {
    void *p = NULL;
    if (atomic_load(&image_fail) > 0) {
        if (atomic_fetch_sub(&image_skip, 1) <= 0 && atomic_fetch_sub(&image_fail, 1) > 0) return NULL;
    }
    pthread_mutex_lock(&image_lock);
    if (image_nfree) p = image_free[--image_nfree];
    pthread_mutex_unlock(&image_lock);
    if (!p) {
        if (posix_memalign(&p, ALIGN, IMAGE_NBYTES) != 0) return NULL;
        memset(p, 0, IMAGE_NBYTES); /* its pages faulted in here, not at idle priority */
    }
    return p;
}

static void image_put(void *p) {
    if (!p) return;
    pthread_mutex_lock(&image_lock);
    if (image_nfree < IMAGE_KEEP) {
        image_free[image_nfree++] = p;
        p = NULL;
    }
    pthread_mutex_unlock(&image_lock);
    free(p);
}

/* write_run's sealing: the two checksums of each record, chunk by chunk, on a few threads. Buffered, the
 * caller writes the sealed chunks in order; with O_DIRECT, each thread lays the chunk it sealed out in an
 * aligned image and writes it itself, at its offset, so that several writes are in flight at once. */
#define COPY_PIECE_NBYTES (256 << 10) /* an image's payload is copied and hashed piece by piece, in cache */
typedef struct {
    wrec_t *recs;
    uint8_t *heads;    /* each record's sealed header, when not sealed into an image */
    Py_ssize_t *first; /* chunk c: records [first[c], first[c + 1]) */
    int64_t *nbytes;   /* chunk c's bytes, padding included */
    int64_t *at;       /* chunk c's offset in the file */
    int nchunks, idle;
    int fd, direct_fd; /* direct_fd >= 0: each chunk written by the thread that sealed it */
    atomic_int direct; /* O_DIRECT writes still accepted (a refusal, refuses_direct, turns them off for the rest) */
    int *state;        /* per chunk, under lock: 0 not done, 1 sealed (and written, with O_DIRECT), -errno */
    int next;          /* under lock: the next chunk to claim */
    int err;           /* under lock: the first chunk's failure (its errno) */
    atomic_int stop;
    pthread_mutex_t lock;
    pthread_cond_t cond;
} seal_t;

static int chunk_state(seal_t *s, int c) {
    pthread_mutex_lock(&s->lock);
    int st = s->state[c];
    pthread_mutex_unlock(&s->lock);
    return st;
}

/* Record j's header checksums: the payload's (already in ``check``), then the header's over its fields
 * and the token ids. ``h`` is the header being sealed (in ``heads`` or in the chunk's image). */
static void seal_header(uint8_t *h, const wrec_t *r, uint64_t check, void *state) {
    memcpy(h + 160, &check, 8);
    xxh3_reset(state);
    xxh3_update(state, h, FIELDS_NBYTES);
    xxh3_update(state, r->tokens.buf, (size_t)r->tokens.len);
    check = xxh3_digest(state);
    memcpy(h + FIELDS_NBYTES, &check, 8);
}

/* nbytes of src copied to dst and hashed into ``state``, piece by piece, so that the hash reads what the
 * copy just wrote to the cache. */
static void copy_hashed(uint8_t *dst, const uint8_t *src, int64_t nbytes, void *state) {
    for (int64_t at = 0; at < nbytes; at += COPY_PIECE_NBYTES) {
        size_t n = (size_t)(nbytes - at < COPY_PIECE_NBYTES ? nbytes - at : COPY_PIECE_NBYTES);
        memcpy(dst + at, src + at, n);
        xxh3_update(state, dst + at, n);
    }
}

/* Chunk c laid out in ``img``: each record's header, token ids, payload (copied and hashed piece by
 * piece, so the hash reads what the copy just wrote to the cache) and zero padding, sealed. */
static void seal_image(seal_t *s, int c, uint8_t *img, void *state) {
    int64_t pos = 0;
    for (Py_ssize_t j = s->first[c]; j < s->first[c + 1]; j++) {
        wrec_t *r = &s->recs[j];
        uint8_t *h = img + pos;
        int64_t nbytes = HEADER_NBYTES + r->tokens.len + r->pad + r->payload.len;
        memcpy(h, r->head.buf, HEADER_NBYTES);
        memcpy(h + HEADER_NBYTES, r->tokens.buf, (size_t)r->tokens.len);
        memset(h + HEADER_NBYTES + r->tokens.len, 0, (size_t)r->pad);
        uint8_t *dst = h + HEADER_NBYTES + r->tokens.len + r->pad;
        xxh3_reset(state);
        copy_hashed(dst, r->payload.buf, r->payload.len, state);
        seal_header(h, r, xxh3_digest(state), state); /* streamed xxh3 equals the one-shot one */
        memset(h + nbytes, 0, (size_t)(aligned(nbytes) - nbytes));
        pos += aligned(nbytes);
    }
}

/* Writes all of buf at off (a short write resumes where it stopped); 0 or an errno. */
static int pwrite_all(int fd, const uint8_t *buf, int64_t nbytes, int64_t off) {
    int64_t done = 0;
    int fault = injected(fd, off, nbytes, 1);
    if (fault) return fault;
    while (done < nbytes) {
        ssize_t w = pwrite(fd, buf + done, (size_t)(nbytes - done), off + done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        wtrace_add(0, fd, off + done, w);
        done += w;
    }
    return 0;
}

/* Writes chunk c's records in place, buffered (header from ``heads``, token ids and payload where they
 * are, zero padding); 0 or an errno. */
static int write_gathered(seal_t *s, int c, const void *zeros) {
    struct iovec iov[IOV_CAP]; /* a chunk has at most IOV_CAP / 5 records */
    int k = 0;
    int fault = injected(s->fd, s->at[c], s->nbytes[c], 1);
    if (fault) return fault;
    for (Py_ssize_t j = s->first[c]; j < s->first[c + 1]; j++) {
        wrec_t *r = &s->recs[j];
        int64_t nbytes = HEADER_NBYTES + r->tokens.len + r->pad + r->payload.len;
        iov[k++] = (struct iovec){s->heads + j * HEADER_NBYTES, HEADER_NBYTES};
        if (r->tokens.len) iov[k++] = (struct iovec){r->tokens.buf, (size_t)r->tokens.len};
        if (r->pad) iov[k++] = (struct iovec){(void *)zeros, (size_t)r->pad};
        if (r->payload.len) iov[k++] = (struct iovec){r->payload.buf, (size_t)r->payload.len};
        if (aligned(nbytes) > nbytes) iov[k++] = (struct iovec){(void *)zeros, (size_t)(aligned(nbytes) - nbytes)};
    }
    int at = 0;
    int64_t written = 0;
    while (at < k) {
        ssize_t w = pwritev(s->fd, iov + at, k - at, s->at[c] + written);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        wtrace_add(0, s->fd, s->at[c] + written, w);
        written += w;
        at = iov_advance(iov, k, at, (size_t)w);
    }
    return written == s->nbytes[c] ? 0 : EIO;
}

static const uint8_t zero_page[ALIGN];

/* An image of ``nbytes`` written at ``at`` with O_DIRECT, or buffered once the file system refused
 * O_DIRECT (for the rest of the run); 0 or an errno. */
static int write_image(seal_t *s, const uint8_t *img, int64_t nbytes, int64_t at) {
    int err = atomic_load(&s->direct) ? pwrite_all(s->direct_fd, img, nbytes, at) : EINVAL;
    if (refuses_direct(err)) { /* a file system that opens O_DIRECT but refuses this write: buffered */
        atomic_store(&s->direct, 0);
        err = pwrite_all(s->fd, img, nbytes, at);
    }
    return err;
}

/* Chunk c, one record larger than an image, with O_DIRECT: its start (header, token ids, the payload's
 * first bytes) laid out in ``first``, the rest of it copied and hashed into ``rest`` an image at a time
 * and written, then ``first`` sealed and written last, once the payload's checksum is known (the record
 * counts only once indexed, after the run's fdatasync: the order of its writes does not matter). The
 * layouts at idle priority with ``idle``, the writes at the thread's own. 0 or an errno. */
static int seal_write_large(seal_t *s, int c, uint8_t *first, uint8_t *rest, void *state, int idle) {
    const wrec_t *r = &s->recs[s->first[c]];
    int64_t lead = HEADER_NBYTES + r->tokens.len + r->pad; /* the record's bytes before its payload */
    int64_t nbytes = lead + r->payload.len, total = s->nbytes[c];
    if (lead >= IMAGE_NBYTES || total != aligned(nbytes) || total <= IMAGE_NBYTES) return EINVAL; /* seal_next's to rule out */
    const uint8_t *src = r->payload.buf;
    prio_t prio = go_idle(idle);
    memcpy(first, r->head.buf, HEADER_NBYTES);
    memcpy(first + HEADER_NBYTES, r->tokens.buf, (size_t)r->tokens.len);
    memset(first + HEADER_NBYTES + r->tokens.len, 0, (size_t)r->pad);
    xxh3_reset(state);
    copy_hashed(first + lead, src, IMAGE_NBYTES - lead, state);
    come_back(prio);
    int err = 0;
    for (int64_t pos = IMAGE_NBYTES; !err && pos < total; pos += IMAGE_NBYTES) {
        if (atomic_load(&s->stop)) return ECANCELED; /* another chunk failed: the run is given back */
        int64_t len = total - pos < IMAGE_NBYTES ? total - pos : IMAGE_NBYTES;
        int64_t pay = nbytes - pos < len ? nbytes - pos : len; /* > 0: total is nbytes rounded up to a page */
        prio = go_idle(idle);
        copy_hashed(rest, src + (pos - lead), pay, state);
        memset(rest + pay, 0, (size_t)(len - pay));
        come_back(prio);
        err = write_image(s, rest, len, s->at[c] + pos);
    }
    if (err) return err;
    seal_header(first, r, xxh3_digest(state), state); /* streamed xxh3 equals the one-shot one */
    return write_image(s, first, IMAGE_NBYTES, s->at[c]);
}

/* Claims and seals the next unclaimed chunk with ``state`` (a hash state: created before any idle
 * section, as a malloc may take locks others wait for), at idle priority with ``idle``; with O_DIRECT,
 * writes it too, back at this thread's own priority. 0 when none is left. The writer calls it at its own
 * priority (it returns to Python: never at idle), the sealer threads at idle priority (theirs end here). */
static int seal_next(seal_t *s, void *state, int idle) {
    pthread_mutex_lock(&s->lock);
    int c = atomic_load(&s->stop) ? s->nchunks : s->next;
    if (c < s->nchunks) s->next++;
    pthread_mutex_unlock(&s->lock);
    if (c >= s->nchunks) return 0;
    /* at this thread's own priority; two for a chunk of one record larger than an image, while O_DIRECT
     * is accepted (else written gathered, buffered, without the copy) and its start fits in one */
    const wrec_t *r0 = &s->recs[s->first[c]];
    int large = s->nbytes[c] > IMAGE_NBYTES && atomic_load(&s->direct) &&
                HEADER_NBYTES + r0->tokens.len + r0->pad < IMAGE_NBYTES;
    uint8_t *img = s->direct_fd >= 0 && (large || s->nbytes[c] <= IMAGE_NBYTES) ? image_get() : NULL;
    uint8_t *rest = img && large ? image_get() : NULL;
    int err = state ? 0 : ENOMEM;
    if (rest) {
        if (!err) err = seal_write_large(s, c, img, rest, state, idle);
        image_put(rest);
        image_put(img);
        goto done;
    }
    if (img && s->nbytes[c] > IMAGE_NBYTES) { /* no memory for the second: written buffered */
        image_put(img);
        img = NULL;
    }
    prio_t prio = go_idle(idle && !err);
    if (!err && img) {
        seal_image(s, c, img, state);
    } else {
        for (Py_ssize_t j = s->first[c]; !err && j < s->first[c + 1]; j++) {
            wrec_t *r = &s->recs[j];
            uint8_t *h = s->heads + j * HEADER_NBYTES;
            memcpy(h, r->head.buf, HEADER_NBYTES);
            seal_header(h, r, xxh3(r->payload.buf, (size_t)r->payload.len), state);
        }
    }
    come_back(prio);
    if (!err && s->direct_fd >= 0) {
        err = img ? write_image(s, img, s->nbytes[c], s->at[c]) : write_gathered(s, c, zero_page);
    }
    image_put(img);
done:
    pthread_mutex_lock(&s->lock);
    s->state[c] = err ? -err : 1;
    if (err && !s->err) s->err = err;
    if (err) atomic_store(&s->stop, 1); /* the run has failed: no more chunks are taken */
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    return 1;
}

static void *sealer(void *arg) {
    seal_t *s = arg;
    void *state = xxh3_create();
    if (state) {
        while (seal_next(s, state, s->idle)) {
        }
        xxh3_free(state);
    }
    return NULL;
}

/* CPUs this thread may run on (its affinity: a container's or a taskset's limit, not the machine's). */
static int usable_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

PyDoc_STRVAR(write_run_doc,
    "write_run(fd, offset, records, sync, idle, direct_fd=-1) -> bytes written, padding included\n\n"
    "records: [(head, token_bytes, payload)], head being a record's 176 header bytes whose two checksums\n"
    "(payload, then header) are filled in here. Writes them back to back at offset, each padded to 4 KiB,\n"
    "then fdatasync if sync. With direct_fd (the same file opened O_DIRECT), the run's space is allocated\n"
    "first and its chunks are laid out in aligned buffers and written through it, several at once, past\n"
    "the page cache (buffered through fd if it refuses). With idle, the checksums (and layouts) are\n"
    "computed at SCHED_IDLE (the caller has made sure the thread may come back). OSError on a failed or\n"
    "short write.");

static PyObject *write_run(PyObject *self, PyObject *args) {
    int fd, sync, idle, direct_fd = -1;
    long long offset;
    PyObject *o_recs;
    if (!PyArg_ParseTuple(args, "iLOii|i", &fd, &offset, &o_recs, &sync, &idle, &direct_fd)) return NULL;
    if (!xxh3) return PyErr_Format(PyExc_RuntimeError, "tierkv._native unavailable: %s", unavailable);
    if (offset < 0 || offset % ALIGN) return PyErr_Format(PyExc_ValueError, "write_run: unaligned offset");
    PyObject *seq = PySequence_Fast(o_recs, "write_run: records must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    wrec_t *recs = PyMem_Calloc((size_t)n + 1, sizeof(wrec_t));
    uint8_t *heads = PyMem_Malloc((size_t)n * HEADER_NBYTES + 1);
    PyObject *result = NULL;
    if (!recs || !heads) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *it = PySequence_Fast_GET_ITEM(seq, j);
        PyObject *h, *t, *pl;
        if (!PyTuple_Check(it) || !PyArg_ParseTuple(it, "OOO", &h, &t, &pl)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "write_run: each record is (head, tokens, payload)");
            goto done;
        }
        if (get_buffer(h, &recs[j].head, 0, "head")) goto done;
        if (get_buffer(t, &recs[j].tokens, 0, "tokens")) {
            PyBuffer_Release(&recs[j].head);
            goto done;
        }
        if (get_buffer(pl, &recs[j].payload, 0, "payload")) {
            PyBuffer_Release(&recs[j].head);
            PyBuffer_Release(&recs[j].tokens);
            goto done;
        }
        if (recs[j].head.len != HEADER_NBYTES) {
            PyErr_SetString(PyExc_ValueError, "write_run: a head is 176 bytes");
            goto done;
        }
        int version = rd16((const uint8_t *)recs[j].head.buf + 4);
        if (version != 1 && version != 2) {
            PyErr_Format(PyExc_ValueError, "write_run: record version %d (this build writes 1 and 2)", version);
            goto done;
        }
        recs[j].pad = inner_pad(version, recs[j].tokens.len);
    }
    int err = 0;
    int64_t total = 0; /* the run's bytes, padding included */
    Py_BEGIN_ALLOW_THREADS
    /* Chunks of at most WRITE_CHUNK_NBYTES, DIRECT_CHUNK_NBYTES with O_DIRECT (or one larger record).
     * Buffered: sealers (a few threads, and this one when they lag) seal the chunks ahead at idle
     * priority while this thread writes the sealed ones in order at its own priority and starts each one's writeback (sync_file_range). O_DIRECT: the
     * run's space is allocated first (fallocate: the writes then land inside the file, which lets ext4
     * and XFS run them side by side instead of one extending write at a time), and every thread seals
     * and writes whole chunks, past the page cache, whose upkeep can cost more CPU than the copy (4 ms
     * a MiB on some VMs). One fdatasync at the end either way. */
    seal_t sl;
    memset(&sl, 0, sizeof sl);
    sl.recs = recs;
    sl.heads = heads;
    sl.idle = idle;
    sl.fd = fd;
    sl.direct_fd = direct_fd;
    atomic_store(&sl.direct, direct_fd >= 0);
    sl.first = PyMem_RawMalloc(sizeof(Py_ssize_t) * ((size_t)n + 2));
    sl.nbytes = PyMem_RawCalloc((size_t)n + 1, sizeof(int64_t));
    sl.at = PyMem_RawCalloc((size_t)n + 1, sizeof(int64_t));
    sl.state = PyMem_RawCalloc((size_t)n + 1, sizeof(int));
    if (!sl.first || !sl.nbytes || !sl.at || !sl.state) err = ENOMEM;
    int64_t chunk_nbytes = direct_fd >= 0 ? DIRECT_CHUNK_NBYTES : WRITE_CHUNK_NBYTES;
    for (Py_ssize_t j = 0; !err && j < n;) { /* chunk boundaries: records [first[c], first[c + 1]) */
        int64_t chunk = 0;
        int k = 0;
        sl.first[sl.nchunks] = j;
        for (; j < n; j++, k += 5) {
            int64_t rec = aligned(HEADER_NBYTES + recs[j].tokens.len + recs[j].pad + recs[j].payload.len);
            if (k > 0 && (chunk + rec > chunk_nbytes || k + 5 > IOV_CAP)) break;
            chunk += rec;
        }
        sl.at[sl.nchunks] = offset + total;
        sl.nbytes[sl.nchunks++] = chunk;
        total += chunk;
    }
    if (sl.first) sl.first[sl.nchunks] = n;
    int allocated = 0; /* fallocate was tried: a failed run gives what it took back */
    if (!err && direct_fd >= 0 && total > 0) {
        int rc;
        while ((rc = fallocate(direct_fd, 0, offset, total)) != 0 && errno == EINTR) {
        }
        allocated = 1;
        if (rc == 0) wtrace_add(2, fd, offset, total);
        else if (errno != EOPNOTSUPP && errno != ENOSYS) err = errno; /* ENOSPC: the disk is full */
    }
    pthread_mutex_init(&sl.lock, NULL);
    pthread_cond_init(&sl.cond, NULL);
    pthread_t tids[MAX_SEALERS];
    int started = 0;
    int cpus = usable_cpus();
    void *own = err ? NULL : xxh3_create(); /* the writer's, for the chunks it seals itself */
    if (!err && !own) err = ENOMEM;
    /* one chunk fewer than there are: the writer seals the first itself while the sealers start */
    for (int t = 0; !err && t < MAX_SEALERS && t < cpus && t + 1 < sl.nchunks; t++) {
        if (start_thread(&tids[started], sealer, &sl) != 0) break;
        started++;
    }
    for (int c = 0; !err && c < sl.nchunks; c++) {
        int st;
        while ((st = chunk_state(&sl, c)) == 0) { /* not done yet: seal (and write) the next one, or wait */
            if (seal_next(&sl, own, 0)) continue;
            pthread_mutex_lock(&sl.lock); /* for its sealer; or, after a failure, until none will take it */
            while (sl.state[c] == 0 && !(atomic_load(&sl.stop) && c >= sl.next)) pthread_cond_wait(&sl.cond, &sl.lock);
            st = sl.state[c] != 0 ? sl.state[c] : -(sl.err ? sl.err : EIO);
            pthread_mutex_unlock(&sl.lock);
            break;
        }
        if (st < 0) {
            err = -st;
            if (err == ECANCELED) { /* cut short by another chunk's failure (set first): report that one */
                pthread_mutex_lock(&sl.lock);
                if (sl.err) err = sl.err;
                pthread_mutex_unlock(&sl.lock);
            }
            break;
        }
        if (direct_fd >= 0) continue; /* written by whoever sealed it */
        err = write_gathered(&sl, c, zero_page);
        /* a hint, not a sync: its errors (a file system without it, say) are fdatasync's to report. Whole
         * pages only: a page the next chunk still writes must not be under writeback (stable pages). */
        if (!err && sync && c + 1 < sl.nchunks) {
            int64_t page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : ALIGN;
            int64_t from = (sl.at[c] + page - 1) / page * page, to = (sl.at[c] + sl.nbytes[c]) / page * page;
            if (to > from) (void)sync_file_range(fd, from, to - from, SYNC_FILE_RANGE_WRITE);
        }
    }
    atomic_store(&sl.stop, 1); /* a failed write: the sealers take no more chunks */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    if (own) xxh3_free(own);
    pthread_cond_destroy(&sl.cond);
    pthread_mutex_destroy(&sl.lock);
    PyMem_RawFree(sl.first);
    PyMem_RawFree(sl.nbytes);
    PyMem_RawFree(sl.at);
    PyMem_RawFree(sl.state);
    if (!err && sync) {
        if (fdatasync(fd) != 0) err = errno;
        else wtrace_add(1, fd, 0, 0);
    }
    /* A failed run: nothing at or past offset is indexed (the caller retries there, or leaves the
     * segment), so the space it allocated (or that a failed fallocate took in part) is released now,
     * best effort, rather than held until the segment goes: on a full disk that space is what is short. */
    if (err && allocated && fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, total) == 0)
        wtrace_add(3, fd, offset, total);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromLongLong((long long)total);
done:
    for (Py_ssize_t j = 0; recs && j < n; j++) { /* PyBuffer_Release clears .obj: each released once */
        if (recs[j].head.obj) PyBuffer_Release(&recs[j].head);
        if (recs[j].tokens.obj) PyBuffer_Release(&recs[j].tokens);
        if (recs[j].payload.obj) PyBuffer_Release(&recs[j].payload);
    }
    PyMem_Free(recs);
    PyMem_Free(heads);
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------------ streamed stores */
/* A restore writes far more than the caches hold, into memory nobody reads before the next forward: a
 * plain store first reads each line from memory (for ownership), a streamed one does not. */
#if defined(__SSE2__)
/* n bytes to dst, streamed past the cache where dst and n are 16-byte multiples (else memcpy). */
static void put_streamed(uint8_t *dst, const uint8_t *src, size_t n) {
    if ((uintptr_t)dst % 16 || n % 16) {
        memcpy(dst, src, n);
        return;
    }
    for (size_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
}
#define STORE_FENCE() _mm_sfence()
#else
static void put_streamed(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }
#define STORE_FENCE() ((void)0)
#endif

/* ------------------------------------------------------------------ copy_blocks */
/* A memory tier's restore: whole blocks from their slots into the destination's (layer, k/v) slabs, on
 * a few threads with the GIL released (one torch copy per block spent as long dispatching as copying). */
typedef struct {
    const int64_t *rows, *srcs, *pos;
    int64_t nrows, chunk, n;
    int gather, stream;
    atomic_long next;
} copy_t;

static void *copy_worker(void *arg) {
    copy_t *c = arg;
    for (;;) {
        int64_t j = atomic_fetch_add(&c->next, 1);
        if (j >= c->n) {
            if (c->stream) STORE_FENCE(); /* streamed stores are weakly ordered: visible before the join */
            return NULL;
        }
        uint8_t *block = (uint8_t *)(intptr_t)c->srcs[j];
        for (int64_t r = 0; r < c->nrows; r++) {
            uint8_t *slab = (uint8_t *)(intptr_t)c->rows[r] + c->pos[j] * c->chunk;
            uint8_t *dst = c->gather ? block + r * c->chunk : slab;
            const uint8_t *src = c->gather ? slab : block + r * c->chunk;
            if (c->stream) put_streamed(dst, src, (size_t)c->chunk);
            else memcpy(dst, src, (size_t)c->chunk);
        }
    }
}

PyDoc_STRVAR(copy_blocks_doc,
    "copy_blocks(rows, row_nbytes, chunk, blocks, positions, threads, gather) -> None\n\n"
    "rows: int64 addresses of the (layer, k/v) slabs of a KV tensor, each row_nbytes long; blocks: int64\n"
    "addresses of n blocks, each len(rows) x chunk contiguous bytes (slab r of a block at r x chunk);\n"
    "positions: int64, each block's place in the slabs (chunk bytes a position). Blocks into the slabs, or\n"
    "with gather, the slabs' blocks into the blocks.");

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    PyObject *o_rows, *o_srcs, *o_pos;
    long long row_nbytes, chunk;
    int threads, gather;
    if (!PyArg_ParseTuple(args, "OLLOOip", &o_rows, &row_nbytes, &chunk, &o_srcs, &o_pos, &threads, &gather))
        return NULL;
    Py_buffer rows = {0}, srcs = {0}, pos = {0};
    PyObject *result = NULL;
    if (get_buffer(o_rows, &rows, 0, "rows") || get_buffer(o_srcs, &srcs, 0, "srcs") ||
        get_buffer(o_pos, &pos, 0, "positions"))
        goto done;
    int64_t nrows = rows.len / 8, n = srcs.len / 8;
    /* The addresses are the caller's word (tierkv passes live tensors'); the positions are checked here. */
    if (rows.len % 8 || srcs.len % 8 || pos.len != srcs.len || nrows < 1 || chunk <= 0 || row_nbytes < chunk) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks: bad shapes");
        goto done;
    }
    const int64_t *p = pos.buf;
    for (int64_t j = 0; j < n; j++) {
        if (p[j] < 0 || p[j] >= row_nbytes / chunk) {
            PyErr_Format(PyExc_ValueError, "copy_blocks: position %lld outside the slabs", (long long)p[j]);
            goto done;
        }
    }
    /* A run as large as half the last-level cache is streamed into place (a restore of 480 MiB from the
     * host tier: 12.2-12.8 -> 15.7-16.4 GB/s here, against torch copy_'s 14.5-15.3; a save's copies are
     * read next by the disk writer, after the rest of the run has gone through the caches); a smaller one
     * stays in the caches for whoever reads it next. */
    int64_t pieces, run_nbytes;
    int stream = __builtin_mul_overflow(n, nrows, &pieces) || __builtin_mul_overflow(pieces, chunk, &run_nbytes) ||
                 run_nbytes >= STREAM_MIN_NBYTES;
    copy_t c = {rows.buf, srcs.buf, pos.buf, nrows, chunk, n, gather, stream, 0};
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)n;
    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (start_thread(&tids[started], copy_worker, &c) != 0) break;
        started++;
    }
    copy_worker(&c); /* the calling thread copies too */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (rows.obj) PyBuffer_Release(&rows);
    if (srcs.obj) PyBuffer_Release(&srcs);
    if (pos.obj) PyBuffer_Release(&pos);
    return result;
}

/* ------------------------------------------------------------------ copy_paged */
/* One (block, layer) at a time: K and V of a canonical chunk [block_tokens, heads, head_dim] to or from a
 * page, where element (kernel block, token, head, dim) of K or V sits at the strides given (elements). */
typedef struct {
    const int64_t *pages, *ids, *where, *rows; /* rows == NULL: where[] are block addresses */
    int64_t layers, n, page_nbytes, chunk, isz;
    int64_t st[2][5]; /* per K, V: offset, kernel block, token, head, dim */
    int64_t kb, kt, H, D;
    int gather;
    atomic_long next;
} paged_t;

/* K stored head_dim-major (vLLM-CPU): per (kernel block, head) a transpose; typed, the inner loop runs
 * along the tokens, contiguous in the page when s[2] == 1 (strided by heads x head_dim in the chunk). The
 * reference for the vectorised scatters below (k_scatter_*), and the path for every other case. */
#define TRANSPOSED(T)                                                                                   \
    for (int64_t h = 0; h < H; h++) {                                                                   \
        T *pg = (T *)(page + (s[0] + b * s[1] + h * s[3]) * isz);                                       \
        T *cn = (T *)(chunk + (b * c->kt * H + h) * D * isz);                                           \
        if (!c->gather && s[2] == 1 &&                                                                  \
            (isz == 4 ? k_scatter_f32((float *)pg, (const float *)cn, c->kt, H * D, D, s[4])             \
                      : k_scatter_u16((uint16_t *)pg, (const uint16_t *)cn, c->kt, H * D, D, s[4])))     \
            continue;                                                                                   \
        for (int64_t d = 0; d < D; d++) {                                                               \
            T *pd = pg + d * s[4], *qd = cn + d;                                                        \
            if (c->gather)                                                                              \
                for (int64_t t = 0; t < c->kt; t++) qd[t * H * D] = pd[t * s[2]];                       \
            else                                                                                        \
                for (int64_t t = 0; t < c->kt; t++) pd[t * s[2]] = qd[t * H * D];                       \
        }                                                                                               \
    }

/* A load writes far more than the caches hold, into pages nobody reads until the next forward: where the
 * page's rows are 16-byte aligned, float32 K's and V's stores stream past the cache (a plain store first
 * reads each line from memory; 16-bit K's tiles are the exception, below). Measured on this path (SmolLM2's K and V chunks, one thread, out of cache): K 5.3 -> 9.3
 * GB/s, V 12.9 -> 20 GB/s, against memcpy's 12.9. A thread ends its stores with a fence (paged_worker). */
#if defined(__SSE2__)
/* Whether rows from p, row_nbytes apart, take 16-byte streaming stores (every t a multiple of 16 bytes). */
static inline int streamable(const void *p, int64_t row_nbytes) { return (uintptr_t)p % 16 == 0 && row_nbytes % 16 == 0; }

/* K of one (kernel block, head), canonical [kt][H x D] -> page rows [D][row], in TILE x TILE tiles: the
 * body transposes the tile at q (rows HD apart) into p (rows `row` apart). */
#define K_TILES(T, TILE, ...)                                                                           \
    for (int64_t d = 0; d < D; d += TILE)                                                               \
        for (int64_t t = 0; t < kt; t += TILE) {                                                        \
            const T *q = cn + t * HD + d;                                                               \
            T *p = pg + d * row + t;                                                                    \
            __VA_ARGS__                                                                                 \
        }

/* float32: 4 x 4 transposes. 0 when the shape does not suit them (the caller then takes the scalar loop). */
static int k_scatter_f32(float *pg, const float *cn, int64_t kt, int64_t HD, int64_t D, int64_t row) {
    if (kt % 4 || D % 4) return 0;
#define F32_TILE(STORE)                                                                                 \
    __m128 r0 = _mm_loadu_ps(q), r1 = _mm_loadu_ps(q + HD), r2 = _mm_loadu_ps(q + 2 * HD),              \
           r3 = _mm_loadu_ps(q + 3 * HD);                                                               \
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);                                                                  \
    STORE(p, r0), STORE(p + row, r1), STORE(p + 2 * row, r2), STORE(p + 3 * row, r3);
    if (streamable(pg, row * 4)) K_TILES(float, 4, F32_TILE(_mm_stream_ps)) else K_TILES(float, 4, F32_TILE(_mm_storeu_ps))
#undef F32_TILE
    return 1;
}

/* 16-bit K (bfloat16, float16): 8 x 8 transposes of 16-bit lanes (rows paired, then pairs, then quads). */
static int k_scatter_u16(uint16_t *pg, const uint16_t *cn, int64_t kt, int64_t HD, int64_t D, int64_t row) {
    if (kt % 8 || D % 8) return 0;
#define U16_TILE(STORE)                                                                                 \
    __m128i a[8], u[8], v[8];                                                                           \
    for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(q + i * HD));                 \
    for (int i = 0; i < 4; i++) {                                                                       \
        u[i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);                                              \
        u[i + 4] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);                                          \
    }                                                                                                   \
    for (int i = 0; i < 2; i++) { /* v[4i..4i+3]: columns 4i..4i+3 of rows 0-3 (even) and 4-7 (odd) */  \
        v[4 * i] = _mm_unpacklo_epi32(u[4 * i], u[4 * i + 1]);                                          \
        v[4 * i + 1] = _mm_unpacklo_epi32(u[4 * i + 2], u[4 * i + 3]);                                  \
        v[4 * i + 2] = _mm_unpackhi_epi32(u[4 * i], u[4 * i + 1]);                                      \
        v[4 * i + 3] = _mm_unpackhi_epi32(u[4 * i + 2], u[4 * i + 3]);                                  \
    }                                                                                                   \
    for (int i = 0; i < 4; i++) {                                                                       \
        STORE((__m128i *)(p + 2 * i * row), _mm_unpacklo_epi64(v[2 * i], v[2 * i + 1]));                 \
        STORE((__m128i *)(p + (2 * i + 1) * row), _mm_unpackhi_epi64(v[2 * i], v[2 * i + 1]));           \
    }
    /* Plain stores: streamed, the tiles' 8 rows of half-written lines at a time ran at 7.3-7.5 GB/s against
     * 9.84-10.1 plain (bf16, SmolLM2's shapes, host tier into the pages). */
    K_TILES(uint16_t, 8, U16_TILE(_mm_storeu_si128))
#undef U16_TILE
    return 1;
}
#undef K_TILES

#else
static int k_scatter_f32(float *pg, const float *cn, int64_t kt, int64_t HD, int64_t D, int64_t row) { return 0; }
static int k_scatter_u16(uint16_t *pg, const uint16_t *cn, int64_t kt, int64_t HD, int64_t D, int64_t row) { return 0; }
#endif

static void paged_one(const paged_t *c, uint8_t *page, uint8_t *const chunks[2]) {
    const int64_t H = c->H, D = c->D, isz = c->isz;
    for (int kv = 0; kv < 2; kv++) {
        const int64_t *s = c->st[kv];
        uint8_t *chunk = chunks[kv];
        for (int64_t b = 0; b < c->kb; b++) {
            if (s[4] == 1) { /* head_dim contiguous in the page: a run of D elements per (token, head) */
                for (int64_t t = 0; t < c->kt; t++)
                    for (int64_t h = 0; h < H; h++) {
                        uint8_t *p = page + (s[0] + b * s[1] + t * s[2] + h * s[3]) * isz;
                        uint8_t *q = chunk + (((b * c->kt + t) * H + h) * D) * isz;
                        if (c->gather) memcpy(q, p, (size_t)(D * isz));
                        else put_streamed(p, q, (size_t)(D * isz));
                    }
            } else if (isz == 4) {
                TRANSPOSED(uint32_t);
            } else {
                TRANSPOSED(uint16_t);
            }
        }
    }
}

static void *paged_worker(void *arg) {
    paged_t *c = arg;
    for (;;) {
        int64_t item = atomic_fetch_add(&c->next, 1);
        if (item >= c->n * c->layers) {
            STORE_FENCE(); /* streamed stores are weakly ordered: visible before the join says done */
            return NULL;
        }
        int64_t j = item / c->layers, layer = item % c->layers;
        uint8_t *page = (uint8_t *)(intptr_t)c->pages[layer] + c->ids[j] * c->page_nbytes;
        uint8_t *chunks[2];
        for (int kv = 0; kv < 2; kv++)
            chunks[kv] = c->rows /* slabs: rows 2 layer (K) and 2 layer + 1 (V), the block at where[j] */
                             ? (uint8_t *)(intptr_t)c->rows[2 * layer + kv] + c->where[j] * c->chunk
                             /* a slot: its 2 x layers chunks one after another */
                             : (uint8_t *)(intptr_t)c->where[j] + (2 * layer + kv) * c->chunk;
        paged_one(c, page, chunks);
    }
}

PyDoc_STRVAR(copy_paged_doc,
    "copy_paged(pages, page_nbytes, num_pages, strides, kernel_blocks, kernel_tokens, heads, head_dim,\n"
    "           itemsize, ids, mode, where, rows, row_nbytes, threads, gather) -> None\n\n"
    "pages: int64 addresses of each layer's paged cache (num_pages pages of page_nbytes); strides: int64\n"
    "[2, 5], per K and V the element offset and the kernel block, token, head and dim strides in a page;\n"
    "ids: int64 [n], each block's page. Mode 0 (slabs): rows, int64 addresses of a KV tensor's (layer, k/v)\n"
    "slabs (each row_nbytes), and where, int64 [n], the blocks' positions in them; mode 1 (slots): rows\n"
    "empty and where the blocks' addresses (each 2 x layers canonical chunks). Canonical blocks into the\n"
    "pages, or with gather, the pages into the canonical blocks.");

static PyObject *copy_paged(PyObject *self, PyObject *args) {
    PyObject *o_pages, *o_st, *o_ids, *o_where, *o_rows;
    long long page_nbytes, num_pages, kb, kt, H, D, isz, row_nbytes;
    int threads, gather, mode;
    if (!PyArg_ParseTuple(args, "OLLOLLLLLOiOOLip", &o_pages, &page_nbytes, &num_pages, &o_st, &kb, &kt, &H, &D,
                          &isz, &o_ids, &mode, &o_where, &o_rows, &row_nbytes, &threads, &gather))
        return NULL;
    Py_buffer pages = {0}, st = {0}, ids = {0}, where = {0}, rows = {0};
    PyObject *result = NULL;
    if (get_buffer(o_pages, &pages, 0, "pages") || get_buffer(o_st, &st, 0, "strides") ||
        get_buffer(o_ids, &ids, 0, "ids") || get_buffer(o_where, &where, 0, "where") ||
        get_buffer(o_rows, &rows, 0, "rows"))
        goto done;
    int64_t layers = pages.len / 8, n = ids.len / 8;
    /* Sizes below 2^20, a page below 2^40 bytes (strides within it), a cache below 2^62 bytes: no product
     * below, nor a page's address offset, can overflow. */
    const int64_t LIM = 1 << 20;
    if (pages.len % 8 || ids.len % 8 || where.len != ids.len || st.len != 10 * 8 || layers < 1 || kb < 1 ||
        kt < 1 || H < 1 || D < 1 || kb > LIM || kt > LIM || H > LIM || D > LIM || (isz != 2 && isz != 4) ||
        num_pages < 1 || page_nbytes < 1 || page_nbytes > (1ll << 40) || num_pages > (1ll << 62) / page_nbytes ||
        (rows.len && rows.len != 16 * layers) ||
        (mode != 0 && mode != 1) || (mode == 0) != (rows.len != 0)) {
        PyErr_SetString(PyExc_ValueError, "copy_paged: bad shapes");
        goto done;
    }
    int64_t chunk = kb * kt * H * D * isz; /* < 2^43: each factor is below 2^20, the pairs checked next */
    if (kb * kt > LIM || H * D > LIM || chunk > page_nbytes / 2 || (rows.len && row_nbytes < chunk)) {
        PyErr_SetString(PyExc_ValueError, "copy_paged: a block does not fit its page or its slabs");
        goto done;
    }
    paged_t c = {pages.buf, ids.buf, where.buf, rows.len ? rows.buf : NULL, layers, n, page_nbytes, chunk, isz};
    const int64_t *sv = st.buf;
    for (int kv = 0; kv < 2; kv++) { /* the last element a stride reaches must lie inside the page */
        int64_t last = sv[5 * kv];
        const int64_t size[4] = {kb, kt, H, D};
        for (int d = 0; d < 5; d++) {
            c.st[kv][d] = sv[5 * kv + d];
            if (c.st[kv][d] < 0 || c.st[kv][d] > page_nbytes) {
                PyErr_SetString(PyExc_ValueError, "copy_paged: a stride outside the page");
                goto done;
            }
            if (d) last += (size[d - 1] - 1) * c.st[kv][d];
        }
        if (last >= page_nbytes / isz) { /* last < 2^62: strides <= 2^40, sizes < 2^20 */
            PyErr_SetString(PyExc_ValueError, "copy_paged: the strides reach past the page");
            goto done;
        }
    }
    c.kb = kb, c.kt = kt, c.H = H, c.D = D, c.gather = gather;
    const int64_t *ip = ids.buf, *wp = where.buf;
    for (int64_t j = 0; j < n; j++) {
        if (ip[j] < 0 || ip[j] >= num_pages) {
            PyErr_Format(PyExc_ValueError, "copy_paged: page %lld outside the cache", (long long)ip[j]);
            goto done;
        }
        if (c.rows && (wp[j] < 0 || wp[j] >= row_nbytes / chunk)) {
            PyErr_Format(PyExc_ValueError, "copy_paged: position %lld outside the slabs", (long long)wp[j]);
            goto done;
        }
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n * layers) threads = (int)(n * layers);
    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (start_thread(&tids[started], paged_worker, &c) != 0) break;
        started++;
    }
    paged_worker(&c);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (pages.obj) PyBuffer_Release(&pages);
    if (st.obj) PyBuffer_Release(&st);
    if (ids.obj) PyBuffer_Release(&ids);
    if (where.obj) PyBuffer_Release(&where);
    if (rows.obj) PyBuffer_Release(&rows);
    return result;
}

/* ------------------------------------------------------------------ Python: xxh3 (for the tests) */
static PyObject *py_xxh3(PyObject *self, PyObject *arg) {
    if (!xxh3) return PyErr_Format(PyExc_RuntimeError, "tierkv._native unavailable: %s", unavailable);
    Py_buffer b;
    if (get_buffer(arg, &b, 0, "data")) return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = xxh3(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* ------------------------------------------------------------------ Python: faults (for the tests) */
static PyObject *inject_fault(PyObject *self, PyObject *args) {
    unsigned long long dev, ino;
    long long start, end;
    int err, kind = 0;
    if (!PyArg_ParseTuple(args, "KKLLi|i", &dev, &ino, &start, &end, &err, &kind)) return NULL;
    pthread_mutex_lock(&faults_lock);
    int i = atomic_load(&nfaults);
    if (i < (int)(sizeof faults / sizeof *faults)) {
        faults[i] = (fault_t){(dev_t)dev, (ino_t)ino, start, end, err, kind};
        atomic_store(&nfaults, i + 1);
    }
    pthread_mutex_unlock(&faults_lock);
    if (i >= (int)(sizeof faults / sizeof *faults)) return PyErr_Format(PyExc_ValueError, "too many faults");
    Py_RETURN_NONE;
}

static PyObject *clear_faults(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&faults_lock);
    atomic_store(&nfaults, 0);
    pthread_mutex_unlock(&faults_lock);
    Py_RETURN_NONE;
}

static PyObject *hashed_on_arrival(PyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(atomic_load(&hashed_total));
}

static PyObject *fail_images(PyObject *self, PyObject *args) {
    int skip, count;
    if (!PyArg_ParseTuple(args, "ii", &skip, &count)) return NULL;
    atomic_store(&image_fail, 0); /* no call fails while the two are set */
    atomic_store(&image_skip, skip);
    atomic_store(&image_fail, count);
    Py_RETURN_NONE;
}

static PyObject *why_unavailable(PyObject *self, PyObject *unused) {
    if (xxh3) Py_RETURN_NONE;
    return PyUnicode_FromString(unavailable);
}

static PyMethodDef methods[] = {
    {"read_run", read_run, METH_VARARGS, read_run_doc},
    {"write_run", write_run, METH_VARARGS, write_run_doc},
    {"copy_blocks", copy_blocks, METH_VARARGS, copy_blocks_doc},
    {"copy_paged", copy_paged, METH_VARARGS, copy_paged_doc},
    {"set_work_cpus", set_work_cpus, METH_O, "set_work_cpus(cpus): the CPUs every helper thread runs on."},
    {"xxh3_64", py_xxh3, METH_O, "xxh3-64 of a buffer, as libxxhash computes it (tests compare it with xxhash's)."},
    {"inject_fault", inject_fault, METH_VARARGS,
     "inject_fault(dev, ino, start, end, errno, kind=0): reads of that range fail (kind 1: writes; + 2:\n"
     "only through O_DIRECT descriptors)."},
    {"clear_faults", clear_faults, METH_NOARGS, "Remove every injected fault."},
    {"hashed_on_arrival", hashed_on_arrival, METH_NOARGS,
     "Records read_run has hashed as their bytes arrived, in this process (tests)."},
    {"fail_images", fail_images, METH_VARARGS,
     "fail_images(skip, count): write_run's next ``skip`` image allocations succeed, the ``count`` after\n"
     "them find no memory (tests; (0, 0) ends it)."},
    {"can_leave_idle", can_leave_idle, METH_NOARGS, "Whether a thread may go to SCHED_IDLE and come back (probed)."},
    {"trace_writes", trace_writes, METH_O, "trace_writes(on) -> the writes and syncs logged since the last call."},
    {"why_unavailable", why_unavailable, METH_NOARGS, "None if usable, else why not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    load_xxhash();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyModule_AddIntConstant(m, "ABI", ABI);
    PyModule_AddIntConstant(m, "ALIGN", ALIGN);
    PyModule_AddIntConstant(m, "HEADER_NBYTES", HEADER_NBYTES);
    PyModule_AddIntConstant(m, "GROUP_NBYTES", GROUP_NBYTES);
    PyModule_AddIntConstant(m, "XXH3_DISPATCHED", xxh3_dispatched);
    PyModule_AddIntConstant(m, "ST_OK", ST_OK);
    PyModule_AddIntConstant(m, "ST_BAD", ST_BAD);
    PyModule_AddIntConstant(m, "ST_MEDIA", ST_MEDIA);
    PyModule_AddIntConstant(m, "ST_PYTHON", ST_PYTHON);
    PyModule_AddIntConstant(m, "ST_TRANSIENT", ST_TRANSIENT);
    PyObject *all = Py_BuildValue("[sssssssssssss]", "read_run", "write_run", "copy_blocks", "copy_paged", "set_work_cpus", "xxh3_64", "inject_fault",
                                  "clear_faults", "fail_images", "hashed_on_arrival", "trace_writes", "can_leave_idle",
                                  "why_unavailable");
    if (!all || PyModule_AddObject(m, "__all__", all) != 0) {
        Py_XDECREF(all);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
