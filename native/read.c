/* read_run: a run of raw records read into a restore's destination slabs and verified without the GIL. */
#include "native.h"

/* A read lands, and is hashed, in pieces this size: each piece's checksum reads it from the cache it was
 * just copied into (L2 holds it), not from memory. Warm 480 MiB, 2 threads: 8.7-9.4 GB/s against 7.9-8.5
 * with a 768 KiB record hashed after its whole read (2026-12-06). */
#ifndef HASH_PIECE_NBYTES
#define HASH_PIECE_NBYTES (256 << 10)
#endif
_Static_assert(HASH_PIECE_NBYTES > 0, "the read loops advance by a piece");

/* ------------------------------------------------------------------ bounce buffers */
/* Aligned O_DIRECT buffers, kept between calls: a fresh one pays a page fault per 4 KiB. */
static pool_t bounces = POOL_INIT(16);

static void *bounce_get(void) {
    void *p = pool_take(&bounces);
    if (!p && posix_memalign(&p, ALIGN, GROUP_NBYTES + ALIGN) != 0) p = NULL;
    return p;
}

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
    int64_t nshares;      /* the groups cut into this many contiguous shares, a thread taking one at a time */
    int64_t *sfirst;      /* share t: groups [sfirst[t], sfirst[t + 1]) */
    uint8_t *grun;        /* per group: it starts a run of adjacent records (else it continues the one before) */
    int stream;           /* from the disk, buffered: each thread reads its share through a file of its own */
    /* per record: its payload's xxh3, taken as its bytes arrived (``hashed``), else verify hashes it */
    uint64_t *checks;
    uint8_t *hashed;
    /* outputs */
    uint8_t *status;
    int *errnos;
    atomic_llong nbytes_cached, nbytes_direct, nbytes_blocking;
} run_t;
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
/* How many of the pages of [off, off + len) the page cache holds, and how many the range spans; -1 where
 * cachestat(2) is missing. */
static int64_t cached_pages(int fd, int64_t off, int64_t len, int64_t *span) {
    static long page;
    if (!page) page = sysconf(_SC_PAGESIZE);
    *span = (off + len + page - 1) / page - off / page;
    if (atomic_load(&no_cachestat)) return -1;
    struct { uint64_t off, len; } range = {(uint64_t)off, (uint64_t)len};
    struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } cs;
    if (syscall(__NR_cachestat, fd, &range, &cs, 0) == 0)
        return cs.nr_cache < (uint64_t)*span ? (int64_t)cs.nr_cache : *span;
    if (errno == ENOSYS || errno == EPERM) atomic_store(&no_cachestat, 1);
    return -1;
}

static int cached_whole(int fd, int64_t off, int64_t len) {
    int64_t span, got = cached_pages(fd, off, len, &span);
    return got < 0 ? -1 : got >= span;
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

/* A reading thread's own open file description of a segment: readahead keeps its state per open file,
 * and threads taking turns at one file's read the others' requests as random ones, read as is into
 * single pages (which a warm read later copies out slower). Through a file of its own, each thread's
 * share of adjacent groups is one sequential stream. */
typedef struct {
    int src, fd; /* the segment's descriptor, and this thread's own (or -1: the shared one is used) */
} own_t;

/* groups read through a thread's own file, and the own files opened (tests: streamed_reads) */
static atomic_llong streamed_total, stream_files_total;

/* A file description of its own for the open segment ``src`` (its own readahead state), or -1 where
 * /proc is missing. */
static int open_own(int src) {
    char path[40];
    snprintf(path, sizeof path, "/proc/self/fd/%d", src);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL); /* as the shared one (segments.py) */
    return fd;
}

static int own_file(own_t *o, int src) {
    if (o->src == src) return o->fd >= 0 ? o->fd : src;
    if (o->fd >= 0) close(o->fd);
    o->src = src;
    o->fd = open_own(src); /* where /proc is missing: the shared file */
    if (o->fd >= 0) atomic_fetch_add(&stream_files_total, 1);
    return o->fd >= 0 ? o->fd : src;
}

/* Read one group into place, with readahead if ``ahead``. Returns 0, a positive errno (the read failed),
 * or -1 (short: the file ends before the records do). */
static int read_group(run_t *r, int64_t first, int64_t count, int ahead, void **bounce, uint8_t *pad,
                      void *state, own_t *own) {
    const req_t *q0 = &r->reqs[first], *ql = &r->reqs[first + count - 1];
    int64_t off = q0->offset, total = ql->offset + ql->nbytes - off;
    /* Readahead only within a run of adjacent records: a lone record's neighbours belong to other
     * prefixes, and reading them would halve the bandwidth. Not by the group's size alone: a record of
     * 1 MiB or more is a group of its own, and what a read without readahead brings into the page cache
     * is kept in single pages, which a warm read later copies out 1.6x slower than readahead's large
     * folios (measured: 5.8-6.9 against 9.6-11.5 GB/s, 2026-12-05). */
    int fd = (int)(ahead ? q0->fd : q0->rfd);
    if (ahead && r->stream) {
        fd = own_file(own, fd);
        if (fd != (int)q0->fd) atomic_fetch_add(&streamed_total, 1);
    }
    struct iovec iov[IOV_CAP];
    int k = build_iov(r, first, count, iov, pad), at = 0;
    int64_t done = 0;
    hcur_t cur = {first, first + count, -1};
    memset(r->hashed + first, 0, (size_t)count);
    int err = injected(fd, off, total, 0);
    if (err) return err;
    /* What the page cache holds: straight into place, one copy. Through the descriptor without readahead:
     * a page that readahead left marked, read through the other, starts readahead of the next window,
     * whose pages the next group then finds cached, and so on. Every later run was then read buffered,
     * the page cache growing by each (measured: after one buffered load, three O_DIRECT loads of 96 MiB
     * read 0 bytes with O_DIRECT and left 288 MiB more in the page cache, 2026-12-07). */
    int64_t cached = r->direct_ok && q0->dfd >= 0 ? resident_prefix(fd, off, total) : 0;
    while (done < cached) {
        int64_t want = cached - done < HASH_PIECE_NBYTES ? cached - done : HASH_PIECE_NBYTES;
        int64_t got = preadv_upto((int)q0->rfd, iov, k, &at, off + done, want);
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
    own_t own = {-1, -1};
    for (;;) {
        /* share t: groups [sfirst[t], sfirst[t + 1]); a thread that failed to start leaves its share to
         * the others */
        long t = atomic_fetch_add(&r->next, 1);
        if (t >= r->nshares) break;
        long g0 = (long)r->sfirst[t], g1 = (long)r->sfirst[t + 1];
        for (long g = g0; g < g1; g++) {
            int64_t first = r->gfirst[g], count = r->gcount[g];
            if (!state || !pad) {
                settle(r, first, count, ENOMEM, NULL);
                continue;
            }
            int err = read_group(r, first, count, r->gahead[g], &bounce, pad, state, &own);
            if (count > 1 && (err < 0 || (err > 0 && is_media(err)))) {
                /* A bad sector or the file's end: which record is it in? Each alone: the others are served. */
                for (int64_t j = first; j < first + count; j++)
                    settle(r, j, 1, read_group(r, j, 1, 0, &bounce, pad, state, &own), state);
                continue;
            }
            settle(r, first, count, err, state);
        }
    }
    if (own.fd >= 0) close(own.fd);
    pool_give(&bounces, bounce);
    if (state) xxh3_free(state);
    free(pad);
    return NULL;
}

const char read_run_doc[] =
    "read_run(reqs, rows, chunk, row_nbytes, prefix, token_nbytes, ns_digest, keys, tokens, dtype, shape,\n"
    "         threads, direct) -> (status: bytes, errnos: list, (cached, direct, blocking) bytes)\n\n"
    "reqs: int64 [n, 6] (fd, fd without readahead, O_DIRECT fd or -1, offset, record nbytes, block position);\n"
    "a segment; rows: int64 addresses of the destination's (layer, k/v) slabs, each row_nbytes long;\n"
    "prefix: writable, n x (176 + token_nbytes) bytes, receives each record's header and token ids.";

PyObject *read_run(PyObject *self, PyObject *args) {
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
    r.sfirst = PyMem_Calloc((size_t)n + 2, sizeof(int64_t));
    r.grun = PyMem_Calloc((size_t)n + 1, 1);
    if (!r.gfirst || !r.gcount || !r.gahead || !r.status || !r.errnos || !r.checks || !r.hashed || !r.sfirst ||
        !r.grun) {
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
            r.grun[r.ngroups] = !adjacent;
        } else {
            r.grun[0] = 1;
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
    /* From the disk, buffered (the run's first or last record not in the page cache): each run of adjacent
     * records one share, read by one thread through a file of its own (own_file), so that its readahead
     * sees one sequential stream; separate runs and lone records in parallel. If no file of its own can be
     * opened, the groups one at a time, as from the page cache. A 48 MiB prefix cold on this VM's virtio
     * disk, 16 alternations (2026-12-07): 1.34 GB/s median against 1.19 with the run cut into a share per
     * thread (8 streams); raw, in C: one stream of 772 KiB reads 1.36, two 1.01, eight 0.91. A warm run
     * takes its groups one at a time: a thread the model preempts leaves the rest to the other. */
    r.nshares = r.ngroups;
    for (int64_t g = 0; g <= r.ngroups; g++) r.sfirst[g] = g;
    if (!direct && r.ngroups > 1 && threads > 1 &&
        (cached_whole((int)rq[0].fd, rq[0].offset, rq[0].nbytes) == 0 ||
         cached_whole((int)rq[n - 1].fd, rq[n - 1].offset, rq[n - 1].nbytes) == 0)) {
        int probe = open_own((int)rq[0].fd);
        if (probe >= 0) {
            close(probe);
            r.stream = 1;
            r.nshares = 0; /* one share per run of adjacent records */
            for (int64_t g = 0; g < r.ngroups; g++)
                if (r.grun[g]) r.sfirst[r.nshares++] = g;
            r.sfirst[r.nshares] = r.ngroups;
            if (threads > r.nshares) threads = (int)r.nshares;
        }
    }
    /* Buffered, what the page cache held before the run (a run of adjacent records at a time): its
     * reads count as cached, the rest as from the disk (its own readahead fills the cache as it goes). */
    int64_t held = 0;
    if (!direct) {
        for (int64_t g = 0, g0 = 0; g < r.ngroups; g++) {
            if (g + 1 < r.ngroups && !r.grun[g + 1]) continue;
            const req_t *a = &rq[r.gfirst[g0]], *b = &rq[r.gfirst[g] + r.gcount[g] - 1];
            int64_t span, pages = cached_pages((int)a->fd, a->offset, b->offset + b->nbytes - a->offset, &span);
            if (pages > 0) held += (int64_t)((__int128)(b->offset + b->nbytes - a->offset) * pages / span);
            g0 = g + 1;
        }
    }
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (start_thread(&tids[started], worker, &r) != 0) break;
        started++;
    }
    if (r.ngroups) worker(&r); /* the calling thread reads too */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    if (!direct) { /* the blocking reads' bytes the page cache held: cached, not from the disk */
        long long blocking = atomic_load(&r.nbytes_blocking), moved = held < blocking ? held : blocking;
        atomic_store(&r.nbytes_blocking, blocking - moved);
        atomic_fetch_add(&r.nbytes_cached, moved);
    }
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
    PyMem_Free(r.sfirst);
    PyMem_Free(r.grun);
    if (reqs.obj) PyBuffer_Release(&reqs);
    if (rows.obj) PyBuffer_Release(&rows);
    if (prefix.obj) PyBuffer_Release(&prefix);
    if (ns.obj) PyBuffer_Release(&ns);
    if (keys.obj) PyBuffer_Release(&keys);
    if (tokens.obj) PyBuffer_Release(&tokens);
    return result;
}

PyObject *hashed_on_arrival(PyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(atomic_load(&hashed_total));
}

PyObject *streamed_reads(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(LL)", (long long)atomic_load(&streamed_total), (long long)atomic_load(&stream_files_total));
}

const char cached_nbytes_doc[] =
    "cached_nbytes(fd, offset, nbytes) -> int: how many bytes of the range the page cache holds (by\n"
    "cachestat(2), in whole pages, prorated), or -1 where that cannot be told.";

PyObject *cached_nbytes(PyObject *self, PyObject *args) {
    int fd;
    long long off, len;
    if (!PyArg_ParseTuple(args, "iLL", &fd, &off, &len)) return NULL;
    if (fd < 0 || off < 0 || len <= 0 || off > INT64_MAX - len - (1 << 20)) { /* room for a page's rounding */
        PyErr_SetString(PyExc_ValueError, "cached_nbytes: a range of a file, please");
        return NULL;
    }
    int64_t span, pages;
    Py_BEGIN_ALLOW_THREADS
    pages = cached_pages(fd, off, len, &span);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(pages < 0 ? -1 : (long long)((__int128)len * pages / span));
}
