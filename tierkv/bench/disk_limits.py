"""The disk's own limits, measured without tierkv: raw sequential reads and writes of several patterns
(O_DIRECT at several request sizes and queue depths, fio's when installed, the restore's own buffered
pattern), and scattered record-sized reads. The tiers and TTFT benchmarks divide by the best of them."""

from __future__ import annotations

import mmap
import os
import random
import shutil
import statistics
import time
from pathlib import Path

from tierkv.bench.machine import drop_page_cache, summary

__all__ = [
    "QUEUE_DEPTHS",
    "READ_THREADS",
    "REQUEST_SIZES",
    "buffered_cold",
    "buffered_warm",
    "best_pattern",
    "naive_lmdb",
    "pattern_name",
    "raw_read",
    "raw_reads",
    "raw_rows",
    "raw_write",
    "raw_writes",
    "sequential_read_limit",
]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


REQUEST_SIZES = (1 << 20, 8 << 20)  # per request: small requests undersell a disk with a long latency
QUEUE_DEPTHS = (1, 4, 32)  # requests in flight (one thread each): one stream undersells an NVMe disk
READ_THREADS = 4  # the disk tier's reading threads (DiskTier's default): the restore's own pattern


def _odirect_stream(
    path: Path, nbytes: int, depth: int, src: mmap.mmap | None, request_nbytes: int = 1 << 20
) -> float:
    """Bytes per second of O_DIRECT requests of ``request_nbytes`` over ``path``'s first ``nbytes``,
    sequential, ``depth`` in flight (thread k does requests k, k+depth, ...). Writes ``src`` (a buffer of
    ``request_nbytes``) when given (then fsync), else reads."""
    from concurrent.futures import ThreadPoolExecutor

    n = nbytes // request_nbytes
    flags = (os.O_WRONLY | os.O_CREAT) if src is not None else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o600)

    def stream(k: int) -> None:
        own = src or mmap.mmap(-1, request_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        for i in range(k, n, depth):
            if src is not None:
                os.pwritev(fd, [own], i * request_nbytes)
            else:
                os.preadv(fd, [own], i * request_nbytes)
        if src is None:
            own.close()

    try:
        with ThreadPoolExecutor(depth) as pool:
            t0 = time.perf_counter()
            list(pool.map(stream, range(depth)))
            if src is not None:
                os.fsync(fd)
            return n * request_nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def _odirect_distinct(path: Path, nbytes: int, request_nbytes: int = 1 << 20) -> float:
    """Bytes per second of O_DIRECT sequential writes of ``nbytes`` into a new file in ``request_nbytes``
    requests, one at a time, each from its own part of one buffer of ``nbytes`` (as a store writes: no two
    requests from the same memory), then fsync. The other raw writes reuse one buffer per thread, which
    this VM's virtual disk rewards: 256 MiB in 2 MiB writes ran at 2.14 GB/s from one buffer against
    1.47-1.50 from 128 distinct ones, whether their bytes differed or not (2026-12-05): its host maps a
    guest page it has just seen faster."""
    n = nbytes // request_nbytes
    src = mmap.mmap(-1, n * request_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    piece = os.urandom(request_nbytes)
    for i in range(n):
        src[i * request_nbytes : (i + 1) * request_nbytes] = piece
    view = memoryview(src)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            os.pwrite(fd, view[i * request_nbytes : (i + 1) * request_nbytes], i * request_nbytes)
        os.fsync(fd)
        return n * request_nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        view.release()
        src.close()


def _fio(path: Path, nbytes: int, write: bool, request_nbytes: int) -> float | None:
    """fio's O_DIRECT sequential requests at queue depth 32 (libaio), as a cross-check: None without fio."""
    import json
    import shutil as sh
    import subprocess

    if sh.which("fio") is None:
        return None
    if write:
        path.unlink(missing_ok=True)  # into a new file, as raw_writes' own
    rw = "write" if write else "read"
    r = subprocess.run(
        ["fio", "--name=limit", f"--filename={path}", f"--rw={rw}", f"--bs={request_nbytes}", "--direct=1",
         "--ioengine=libaio", "--iodepth=32", f"--size={nbytes}", "--output-format=json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if r.returncode != 0:
        return None
    job = json.loads(r.stdout)["jobs"][0][rw]
    return float(job["bw_bytes"]) or None


def buffered_cold(paths: list[Path], threads: int) -> float:
    """The restore's own pattern without tierkv: whole files in 8 MiB buffered reads, ``threads`` in
    flight, after the page cache was dropped. A virtual disk can serve this faster than any O_DIRECT
    pattern (its host's cache or read-ahead), so it counts towards the limit: a restore must not be
    measured against less."""
    from concurrent.futures import ThreadPoolExecutor

    chunk = 8 << 20
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    for fd in fds:  # as the disk tier's reading descriptors: a larger read-ahead window
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    reads = [(fd, off) for fd, p in zip(fds, paths) for off in range(0, p.stat().st_size, chunk)]

    def stream(k: int) -> int:
        buf = mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        got = sum(os.preadv(fd, [buf], off) for fd, off in reads[k::threads])
        buf.close()
        return got

    try:
        drop_page_cache(paths)
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            nbytes = sum(pool.map(stream, range(threads)))
            return nbytes / (time.perf_counter() - t0)
    finally:
        for fd in fds:
            os.close(fd)


def buffered_warm(
    paths: list[Path], threads: int, runs: int, chunk: int = 8 << 20, checksum: bool = False
) -> list[float]:
    """What the page cache gives ``read`` at best: whole files, already cached, in ``chunk`` reads on
    ``threads`` threads, each into its own place in one buffer as large as the files (faulted in before
    the timer; a buffer reused would stay in the CPU's cache, which a restore's destination does not). A
    warm restore also reads straight into place (a record at a time, scattered over the layers' slabs)
    and checks a checksum beside it: it cannot beat this by much; memcpy is the ceiling of a copy that
    needs no kernel. ``checksum``: each read's bytes hashed (xxh3, the records' checksum, natively and
    without the GIL) right after the read, as a restore verifies each record: a verified read's ceiling."""
    from concurrent.futures import ThreadPoolExecutor

    from tierkv import native

    hash_of = native.module().xxh3_64 if checksum else None
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    reads, at = [], 0
    for fd, p in zip(fds, paths):
        for off in range(0, p.stat().st_size, chunk):
            reads.append((fd, off, at))
            at += chunk
    buf = mmap.mmap(-1, max(at, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    view = memoryview(buf)

    def stream(k: int) -> int:
        total = 0
        for fd, off, dst in reads[k::threads]:
            got = os.preadv(fd, [view[dst : dst + chunk]], off)
            if hash_of is not None:
                hash_of(view[dst : dst + got])
            total += got
        return total

    try:
        rates = []
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(stream, range(threads)))  # into the page cache, the buffer and the threads
            for _ in range(runs):
                t0 = time.perf_counter()
                nbytes = sum(pool.map(stream, range(threads)))
                rates.append(nbytes / (time.perf_counter() - t0))
        return rates
    finally:
        view.release()
        buf.close()
        for fd in fds:
            os.close(fd)


def naive_lmdb(dirpath: Path, blocks: list[bytes], runs: int) -> list[float]:
    """Payloads as LMDB values read cold in random key order (the design the disk tier left), bytes per
    second per run."""
    import lmdb

    env = lmdb.open(str(dirpath), map_size=4 * sum(map(len, blocks)) + (1 << 30))
    keys = [i.to_bytes(8, "big") for i in range(len(blocks))]
    with env.begin(write=True) as txn:
        for k, b in zip(keys, blocks):
            txn.put(k, b)
    env.sync(True)
    env.close()
    results = []
    for _ in range(runs):
        drop_page_cache([dirpath / "data.mdb"])  # with the map closed: mapped pages are not dropped
        env = lmdb.open(str(dirpath))
        order = keys[:]
        random.shuffle(order)
        t0 = time.perf_counter()
        total = 0
        with env.begin(buffers=True) as txn:
            for k in order:
                total += len(txn.get(k) or b"")
        results.append(total / (time.perf_counter() - t0))
        env.close()
    shutil.rmtree(dirpath)
    return results


def raw_writes(path: Path, nbytes: int, runs: int) -> dict[str, list[float]]:
    """O_DIRECT sequential writes of each of ``REQUEST_SIZES`` at each of ``QUEUE_DEPTHS``, fio's when
    installed, each into a new file: a store appends new data, and overwriting blocks a file already has
    skips the allocation every append pays (on a virtual disk: 4.9 GB/s against 2.2 for the same writes
    into a new file). Leaves ``path`` written for ``raw_reads``."""
    srcs = {size: mmap.mmap(-1, size) for size in REQUEST_SIZES}
    for m in srcs.values():
        m.write(os.urandom(len(m)))
    out: dict[str, list[float]] = {}
    for _ in range(runs):
        for size in REQUEST_SIZES:
            for d in QUEUE_DEPTHS:
                path.unlink(missing_ok=True)
                out.setdefault(f"write_{size >> 20}m_qd{d}", []).append(
                    _odirect_stream(path, nbytes, d, srcs[size], size)
                )
        out.setdefault("write_distinct_1m_qd1", []).append(_odirect_distinct(path, nbytes))
    for size in REQUEST_SIZES:
        if (bw := _fio(path, nbytes, True, size)) is not None:
            out.setdefault(f"fio_write_{size >> 20}m_qd32", []).append(bw)
    for m in srcs.values():
        m.close()
    return out


def best_pattern(raw: dict[str, list[float]], rw: str) -> tuple[int, int]:
    """The (request bytes, queue depth) of the raw sequential ``rw`` ("read" or "write") pattern with the
    best median in ``raw`` (``raw_writes``' and ``raw_reads``' keys)."""
    best = max(
        ((size, d) for size in REQUEST_SIZES for d in QUEUE_DEPTHS if f"{rw}_{size >> 20}m_qd{d}" in raw),
        key=lambda sd: statistics.median(raw[f"{rw}_{sd[0] >> 20}m_qd{sd[1]}"]),
    )
    return best


def pattern_name(pattern: tuple[int, int]) -> str:
    return f"{pattern[0] >> 20} MiB, QD {pattern[1]}"


def raw_write(path: Path, nbytes: int, pattern: tuple[int, int] = (1 << 20, 1)) -> float:
    """One O_DIRECT sequential write of ``nbytes`` into a new file in ``pattern``'s requests (bytes, queue
    depth), then fsync: beside each durable save (this disk's write speed drifts between minutes more than
    between neighbours)."""
    request_nbytes, depth = pattern
    src = mmap.mmap(-1, request_nbytes)
    src.write(os.urandom(len(src)))
    try:
        path.unlink(missing_ok=True)
        return _odirect_stream(path, nbytes, depth, src, request_nbytes)
    finally:
        src.close()
        path.unlink(missing_ok=True)


def raw_read(path: Path, nbytes: int, pattern: tuple[int, int]) -> float:
    """One cold O_DIRECT sequential read of ``path``'s first ``nbytes`` in ``pattern``'s requests: beside
    each first restore, as ``raw_write`` beside each save."""
    drop_page_cache([path])
    return _odirect_stream(path, nbytes, pattern[1], None, pattern[0])


def raw_reads(path: Path, nbytes: int, runs: int, record_nbytes: int, out: dict[str, list[float]]) -> None:
    """The disk's read limits, without tierkv, appended to ``out``: O_DIRECT sequential reads of each of
    ``REQUEST_SIZES`` at each of ``QUEUE_DEPTHS``, the restore's pattern buffered and cold (and one
    buffered stream), fio's when
    installed; and scattered record-sized O_DIRECT reads (not a limit: what blocks spread over the disk
    would cost)."""
    rng = random.Random(0)
    buf = mmap.mmap(-1, record_nbytes)
    for _ in range(runs):
        for size in REQUEST_SIZES:
            for d in QUEUE_DEPTHS:
                drop_page_cache([path])
                out.setdefault(f"read_{size >> 20}m_qd{d}", []).append(
                    _odirect_stream(path, nbytes, d, None, size)
                )
        out.setdefault("buffered_cold", []).append(buffered_cold([path], READ_THREADS))
        # One stream: the kernel's read-ahead sees one sequential reader (this virtual disk served it at
        # 2.2 GB/s where 4 threads' interleaved 8 MiB reads got 1.2-1.5, 2026-12-05)
        out.setdefault("buffered_cold_1", []).append(buffered_cold([path], 1))
        drop_page_cache([path])
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        count = nbytes // record_nbytes
        t0 = time.perf_counter()
        for _ in range(count):
            os.preadv(fd, [buf], rng.randrange(count) * record_nbytes)
        out.setdefault("odirect_scattered", []).append(count * record_nbytes / (time.perf_counter() - t0))
        os.close(fd)
    for size in REQUEST_SIZES:
        drop_page_cache([path])
        if (bw := _fio(path, nbytes, False, size)) is not None:
            out.setdefault(f"fio_read_{size >> 20}m_qd32", []).append(bw)
    buf.close()


def raw_rows(raw: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for rw in ("read", "write"):
        for size in REQUEST_SIZES:
            for d in QUEUE_DEPTHS:
                if f"{rw}_{size >> 20}m_qd{d}" in raw:
                    rows[f"raw O_DIRECT sequential {rw}, {size >> 20} MiB, QD {d}"] = summary(
                        raw[f"{rw}_{size >> 20}m_qd{d}"]
                    )
        if rw == "write" and "write_distinct_1m_qd1" in raw:
            rows["raw O_DIRECT sequential write, 1 MiB, QD 1, each request from memory of its own"] = summary(
                raw["write_distinct_1m_qd1"]
            )
        for size in REQUEST_SIZES:
            if f"fio_{rw}_{size >> 20}m_qd32" in raw:
                rows[f"fio O_DIRECT sequential {rw}, {size >> 20} MiB, QD 32 (libaio)"] = summary(
                    raw[f"fio_{rw}_{size >> 20}m_qd32"]
                )
    rows[f"raw buffered cold sequential read, 8 MiB, {READ_THREADS} threads"] = summary(raw["buffered_cold"])
    if "buffered_cold_1" in raw:
        rows["raw buffered cold sequential read, 8 MiB, 1 thread"] = summary(raw["buffered_cold_1"])
    rows["raw O_DIRECT scattered block-sized reads"] = summary(raw["odirect_scattered"])
    return rows


def sequential_read_limit(path: Path, nbytes: int, runs: int) -> float:
    """The disk's read limit over ``path`` (written, at least ``nbytes``): the best median of every raw
    sequential read pattern of ``raw_reads``."""
    raw: dict[str, list[float]] = {}
    raw_reads(path, nbytes, runs, 1 << 20, raw)
    return max(v["median"] for k, v in raw_rows(raw).items() if "sequential read" in k)
