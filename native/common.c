/* The native module's shared parts: the helper threads' CPUs, xxh3 from libxxhash, injected faults
 * (tests), buffers from Python. */
#include "native.h"

/* ------------------------------------------------------------------ the threads' CPUs */
/* An engine may pin each of its threads to one core (vLLM-CPU does), and a thread inherits its creator's
 * pin: the helper threads of a call made on the model's thread would all share that one core. With a set
 * given (set_work_cpus: every CPU the process's threads may use), each helper thread gets it instead. */
cpu_set_t work_cpus;
atomic_int have_work_cpus;

int start_thread(pthread_t *tid, void *(*fn)(void *), void *arg) {
    int err = pthread_create(tid, NULL, fn, arg);
    if (err == 0 && atomic_load(&have_work_cpus)) pthread_setaffinity_np(*tid, sizeof work_cpus, &work_cpus);
    return err;
}

PyObject *set_work_cpus(PyObject *self, PyObject *arg) {
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
xxh3_fn xxh3;
xxh3_create_fn xxh3_create;
xxh3_reset_fn xxh3_reset;
xxh3_update_fn xxh3_update;
xxh3_digest_fn xxh3_digest;
xxh3_free_fn xxh3_free;
int xxh3_dispatched; /* the library's runtime-dispatched entry points (AVX2, AVX-512) are in use */
char unavailable[256];

int load_xxhash(void) {
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

/* ------------------------------------------------------------------ kept buffers */
void *pool_take(pool_t *pool) {
    void *p = NULL;
    pthread_mutex_lock(&pool->lock);
    if (pool->nfree) p = pool->free[--pool->nfree];
    pthread_mutex_unlock(&pool->lock);
    return p;
}

void pool_give(pool_t *pool, void *p) {
    if (!p) return;
    pthread_mutex_lock(&pool->lock);
    if (pool->nfree < pool->keep && pool->nfree < POOL_MAX) {
        pool->free[pool->nfree++] = p;
        p = NULL;
    }
    pthread_mutex_unlock(&pool->lock);
    free(p);
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

int injected(int fd, int64_t off, int64_t len, int writes) {
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

/* CPUs this thread may run on (its affinity: a container's or a taskset's limit, not the machine's). */
int usable_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: a contiguous%s buffer is needed", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ Python: xxh3 (for the tests) */
PyObject *py_xxh3(PyObject *self, PyObject *arg) {
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
PyObject *inject_fault(PyObject *self, PyObject *args) {
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

PyObject *clear_faults(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&faults_lock);
    atomic_store(&nfaults, 0);
    pthread_mutex_unlock(&faults_lock);
    Py_RETURN_NONE;
}

PyObject *why_unavailable(PyObject *self, PyObject *unused) {
    if (xxh3) Py_RETURN_NONE;
    return PyUnicode_FromString(unavailable);
}
