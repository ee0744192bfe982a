/* tierkv._native: the disk tier's record runs, read and written without the GIL (one C file per part:
 * module.c, common.c, read.c, write.c, copy.c; this header shared by them).
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
#ifndef TIERKV_NATIVE_H
#define TIERKV_NATIVE_H
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

#define ABI 14 /* tierkv/native.py refuses a build of another version (a stale in-place build) */
#define ALIGN 4096
#define IOV_CAP 1024              /* Linux's IOV_MAX */
#ifndef GROUP_NBYTES
#define GROUP_NBYTES (1u << 20)   /* one read request: adjacent records coalesced up to this */
#endif
#define MAX_THREADS 64
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
static inline int64_t aligned(int64_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* A file system refusing O_DIRECT: EINVAL (Linux's own), EOPNOTSUPP (some FUSE and network ones). */
static inline int refuses_direct(int err) { return err == EINVAL || err == EOPNOTSUPP; }

/* Drop the first `n` bytes of an iovec list in place; returns the new start index. */
static inline int iov_advance(struct iovec *iov, int k, int at, size_t n) {
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

/* ------------------------------------------------------------------ common.c */
/* xxh3 from the system's libxxhash (load_xxhash, at import): NULL where it is missing */
typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh3_digest_fn)(const void *);
typedef int (*xxh3_free_fn)(void *);
extern xxh3_fn xxh3;
extern xxh3_create_fn xxh3_create;
extern xxh3_reset_fn xxh3_reset;
extern xxh3_update_fn xxh3_update;
extern xxh3_digest_fn xxh3_digest;
extern xxh3_free_fn xxh3_free;
extern int xxh3_dispatched;
extern char unavailable[256];
int load_xxhash(void);

extern cpu_set_t work_cpus;
extern atomic_int have_work_cpus;
int start_thread(pthread_t *tid, void *(*fn)(void *), void *arg);
int usable_cpus(void);
int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what);
int injected(int fd, int64_t off, int64_t len, int writes);

/* Aligned buffers kept between calls (a fresh one pays a page fault per 4 KiB): up to `keep` of them. */
#define POOL_MAX 20
typedef struct {
    pthread_mutex_t lock;
    int keep, nfree;
    void *free[POOL_MAX];
} pool_t;
#define POOL_INIT(k) {PTHREAD_MUTEX_INITIALIZER, (k), 0, {0}}
void *pool_take(pool_t *pool);          /* a kept buffer, or NULL */
void pool_give(pool_t *pool, void *p);  /* kept, or freed where `keep` are already */

/* ------------------------------------------------------------------ the module's functions */
PyObject *set_work_cpus(PyObject *self, PyObject *arg);
PyObject *py_xxh3(PyObject *self, PyObject *arg);
PyObject *inject_fault(PyObject *self, PyObject *args);
PyObject *clear_faults(PyObject *self, PyObject *unused);
PyObject *why_unavailable(PyObject *self, PyObject *unused);
extern const char read_run_doc[], write_run_doc[], copy_blocks_doc[], copy_paged_doc[];
PyObject *read_run(PyObject *self, PyObject *args);        /* read.c */
PyObject *hashed_on_arrival(PyObject *self, PyObject *unused);
extern const char cached_nbytes_doc[];
PyObject *cached_nbytes(PyObject *self, PyObject *args);
PyObject *streamed_reads(PyObject *self, PyObject *unused);
PyObject *write_run(PyObject *self, PyObject *args);       /* write.c */
PyObject *trace_writes(PyObject *self, PyObject *arg);
PyObject *can_leave_idle(PyObject *self, PyObject *unused);
PyObject *fail_images(PyObject *self, PyObject *args);
PyObject *copy_blocks(PyObject *self, PyObject *args);     /* copy.c */
PyObject *copy_paged(PyObject *self, PyObject *args);

#endif
