/* copy_blocks and copy_paged: blocks between memory tiers, KV slabs and an engine's pages. */
#include "native.h"

#define STREAM_MIN_NBYTES (16ll << 20) /* copy_blocks: runs this large stream past the caches */

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

const char copy_blocks_doc[] =
    "copy_blocks(rows, row_nbytes, chunk, blocks, positions, threads, gather) -> None\n\n"
    "rows: int64 addresses of the (layer, k/v) slabs of a KV tensor, each row_nbytes long; blocks: int64\n"
    "addresses of n blocks, each len(rows) x chunk contiguous bytes (slab r of a block at r x chunk);\n"
    "positions: int64, each block's place in the slabs (chunk bytes a position). Blocks into the slabs, or\n"
    "with gather, the slabs' blocks into the blocks.";

PyObject *copy_blocks(PyObject *self, PyObject *args) {
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

const char copy_paged_doc[] =
    "copy_paged(pages, page_nbytes, num_pages, strides, kernel_blocks, kernel_tokens, heads, head_dim,\n"
    "           itemsize, ids, mode, where, rows, row_nbytes, threads, gather) -> None\n\n"
    "pages: int64 addresses of each layer's paged cache (num_pages pages of page_nbytes); strides: int64\n"
    "[2, 5], per K and V the element offset and the kernel block, token, head and dim strides in a page;\n"
    "ids: int64 [n], each block's page. Mode 0 (slabs): rows, int64 addresses of a KV tensor's (layer, k/v)\n"
    "slabs (each row_nbytes), and where, int64 [n], the blocks' positions in them; mode 1 (slots): rows\n"
    "empty and where the blocks' addresses (each 2 x layers canonical chunks). Canonical blocks into the\n"
    "pages, or with gather, the pages into the canonical blocks.";

PyObject *copy_paged(PyObject *self, PyObject *args) {
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
