/* write_run: a run of records sealed and appended to a segment file without the GIL. */
#include "native.h"

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

PyObject *trace_writes(PyObject *self, PyObject *arg) {
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

PyObject *can_leave_idle(PyObject *self, PyObject *unused) {
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
/* two per sealing thread (a large record's), of two runs at once (the disk writer appends the next batch
 * while the one before it drains): kept only once that many were in use */
#define IMAGE_KEEP (2 * 2 * (MAX_SEALERS + 1))
_Static_assert(IMAGE_KEEP <= POOL_MAX, "the pool keeps them all");
static pool_t images = POOL_INIT(IMAGE_KEEP);

/* Tests only (fail_images): the next image_skip calls succeed, then image_fail calls get no image. */
static atomic_int image_skip, image_fail;

static void *image_get(void) {
    if (atomic_load(&image_fail) > 0) {
        if (atomic_fetch_sub(&image_skip, 1) <= 0 && atomic_fetch_sub(&image_fail, 1) > 0) return NULL;
    }
    void *p = pool_take(&images);
    if (!p) {
        if (posix_memalign(&p, ALIGN, IMAGE_NBYTES) != 0) return NULL;
        memset(p, 0, IMAGE_NBYTES); /* its pages faulted in here, not at idle priority */
    }
    return p;
}

static void image_put(void *p) { pool_give(&images, p); }

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
const char write_run_doc[] =
    "write_run(fd, offset, records, sync, idle, direct_fd=-1, expect_nbytes=-1) -> bytes written, padding\n"
    "included\n\n"
    "records: [(head, token_bytes, payload)], head being a record's 176 header bytes whose two checksums\n"
    "(payload, then header) are filled in here. Writes them back to back at offset, each padded to 4 KiB,\n"
    "then fdatasync if sync is 1 (2: the chunks' writeback started, the fdatasync left to the caller, who\n"
    "orders one run's sync before the next's). With direct_fd (the same file opened O_DIRECT), the run's\n"
    "space is allocated first and its chunks are laid out in aligned buffers and written through it,\n"
    "several at once, past the page cache (buffered through fd if it refuses). With idle, the checksums\n"
    "(and layouts) are computed at SCHED_IDLE (the caller has made sure the thread may come back).\n"
    "expect_nbytes: the run's footprint as the caller reserved it; another is refused before any write\n"
    "(ValueError), since the bytes past it may be another run's. OSError on a failed or short write.";

PyObject *write_run(PyObject *self, PyObject *args) {
    int fd, sync, idle, direct_fd = -1;
    long long offset, expect_nbytes = -1;
    PyObject *o_recs;
    if (!PyArg_ParseTuple(args, "iLOii|iL", &fd, &offset, &o_recs, &sync, &idle, &direct_fd, &expect_nbytes))
        return NULL;
    if (sync < 0 || sync > 2) return PyErr_Format(PyExc_ValueError, "write_run: sync is 0, 1 or 2");
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
    if (expect_nbytes >= 0) { /* the footprint, as the chunks below add it up */
        int64_t footprint = 0;
        for (Py_ssize_t j = 0; j < n; j++)
            footprint += aligned(HEADER_NBYTES + recs[j].tokens.len + recs[j].pad + recs[j].payload.len);
        if (footprint != expect_nbytes) {
            PyErr_Format(PyExc_ValueError, "write_run: the records take %lld bytes, %lld were reserved",
                         (long long)footprint, expect_nbytes);
            goto done;
        }
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
     * a MiB on some VMs). One fdatasync at the end either way (sync 1), or the caller's (sync 2). */
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
    if (!err && sync == 1) {
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

PyObject *fail_images(PyObject *self, PyObject *args) {
    int skip, count;
    if (!PyArg_ParseTuple(args, "ii", &skip, &count)) return NULL;
    atomic_store(&image_fail, 0); /* no call fails while the two are set */
    atomic_store(&image_skip, skip);
    atomic_store(&image_fail, count);
    Py_RETURN_NONE;
}
