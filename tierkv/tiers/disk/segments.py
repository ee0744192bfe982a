"""Append-only segment files that hold the disk tier's block records.

Why not keep payloads inside LMDB: py-lmdb's ``get`` faults a cold value in one 4 KiB page at a time
(its ``preload``), about 300 MB/s here against 1.7 GB/s for large sequential reads of the same disk. So
LMDB is the index (key -> segment, offset, length, times) and the payloads live here, 4 KiB aligned, read
with large ``preadv`` calls on several threads, adjacent records coalesced into one read.

Space comes back without compaction: a deleted record's pages are released with
``fallocate(PUNCH_HOLE)``, so the disk footprint is the live bytes; a segment with no live record left is
unlinked.

This module is the folder of segments: paths, descriptors, holes; the Python path's reads are
``segment_reads.py``'s, the native reader's ``native_read.py``'s, appending ``segment_writer.py``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierkv.cpus import spread_here
from tierkv.metrics import Counters
from tierkv.tiers.disk.files import ALIGN, DIRECT_REFUSED, TransientReadError, accepts_direct_io, aligned
from tierkv.tiers.disk.read_modes import ReadModes
from tierkv.tiers.disk.segment_reads import READ_CHUNK_NBYTES, SegmentReads

__all__ = [
    "ALIGN",
    "MAX_READ_FDS",
    "READ_CHUNK_NBYTES",
    "SegmentDir",
    "TransientReadError",
    "aligned",
    "fsync_dir",
    "punch_hole",
]

log = logging.getLogger("tierkv.disk")

MAX_READ_FDS = 256  # cached read descriptors (up to three per segment); least recently used closed past it
_TEMP = ".new-"  # a segment being created: <id>.seg.new-<pid>-<tid>, renamed once locked


_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Release the pages of a dead record; False where the file system cannot (then ``gc --compact``)."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, os.strerror(err))


class SegmentDir(SegmentReads):
    """The folder of segment files: paths, cached read descriptors, coalesced parallel reads."""

    def __init__(
        self,
        path: Path,
        read_threads: int = 4,
        counters: Counters | None = None,
        direct_reads: bool = False,
        direct_writes: bool = False,
        read_modes: ReadModes | None = None,
    ) -> None:
        self.path = path
        # The native reader may read records the page cache lacks with O_DIRECT (else buffered, with
        # readahead); ``read_modes`` says whether each run does (always, where the user said so).
        self.direct_reads = direct_reads
        self.read_modes = read_modes or ReadModes(None, fixed=direct_reads)
        # The native writer writes records with O_DIRECT (SegmentWriter), where the file system allows it.
        self.direct_writes = direct_writes
        self.counters = counters or Counters()
        self._punch_warned = False
        self._read_errors_logged: set[int | None] = set()  # errnos already logged: once each, no storm
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fds: OrderedDict[int, int] = OrderedDict()  # slot -> fd, least recently used first
        self._fds_lock = threading.Lock()
        self._in_use: dict[int, int] = {}  # fd -> reads using it now
        self._retired: set[int] = set()  # out of the cache, closed when their last read ends
        self._pool = ThreadPoolExecutor(
            max_workers=read_threads, thread_name_prefix="tierkv-read", initializer=spread_here
        )
        self._buf: mmap.mmap | None = None  # reused: fresh large buffers cost a page fault per 4 KiB
        self.read_lock = threading.Lock()  # held by callers of ``read`` while they use its views
        # Until the file system refuses an O_DIRECT open; probed now when asked for, so the start-up line
        # says which reads it will really do.
        self._direct_ok = not (direct_reads or direct_writes) or accepts_direct_io(path) is not False
        self._pad = memoryview(bytearray(ALIGN))  # sink for the padding between records (content unused)

    @property
    def direct_ok(self) -> bool:
        """False once this file system refused O_DIRECT (probed at start, or at an open since)."""
        return self._direct_ok

    @property
    def reads_direct(self) -> bool:
        """Whether the native reader may read what the page cache lacks with O_DIRECT now: asked for (or
        left to measurement, ``read_modes``), and not refused by the file system (then its buffered mode,
        a cold run streamed through a file of its own)."""
        return self.direct_reads and self._direct_ok

    def file(self, seg_id: int) -> Path:
        return self.path / f"{seg_id:010d}.seg"

    def list_ids(self) -> list[int]:
        return sorted(int(p.stem) for p in self.path.glob("*.seg") if p.stem.isdigit())

    def is_active(self, seg_id: int) -> bool:
        """Whether a live writer (in any process, any PID namespace) holds the segment: it may still grow."""
        try:
            fd = os.open(self.file(seg_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also drops the lock this test took
        return False

    def remove_stale_temp_files(self, min_age_s: float = 600.0) -> int:
        """Segments whose creator died before naming them (unlocked temp files): never indexed. Only files
        older than ``min_age_s``: a live writer holds its temp file for microseconds, between its creation
        and its flock, and must not lose it then."""
        n = 0
        for p in self.path.glob(f"*.seg{_TEMP}*"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - p.stat().st_mtime < min_age_s:
                    continue
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(p)
                    n += 1
                except BlockingIOError:
                    pass
                finally:
                    os.close(fd)
        return n

    def forget_removed(self) -> int:
        """Drop cached descriptors of segments another process unlinked (each pins the file's space)."""
        with self._fds_lock:
            gone = [slot for slot, fd in self._fds.items() if os.fstat(fd).st_nlink == 0]
            for slot in gone:
                self._retire(self._fds.pop(slot))
        return len(gone)

    @contextlib.contextmanager
    def held_fds(self, seg_ids: Sequence[int]) -> Iterator[dict[int, tuple[int, int, int]]]:
        """For the native reader: each segment's (readahead, no-readahead, O_DIRECT or -1) descriptors, held
        for the ``with`` block; segments that are gone are left out (their records are misses)."""
        with contextlib.ExitStack() as stack:
            out: dict[int, tuple[int, int, int]] = {}
            for seg_id in seg_ids:
                seq = stack.enter_context(self._read_fd(seg_id))
                rnd = stack.enter_context(self._read_fd(seg_id, sequential=False))
                if seq is None or rnd is None:
                    continue
                dfd = stack.enter_context(self._read_fd(seg_id, direct=True)) if self.reads_direct else None
                out[seg_id] = (seq, rnd, -1 if dfd is None else dfd)
            yield out

    def _open_direct(self, seg_id: int) -> int | None:
        try:
            return os.open(self.file(seg_id), os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno not in DIRECT_REFUSED:
                raise
            self._direct_ok = False  # this file system refuses O_DIRECT (tmpfs): buffered reads only
            return None

    @contextlib.contextmanager
    def _read_fd(self, seg_id: int, sequential: bool = True, direct: bool = False) -> Iterator[int | None]:
        """A cached read descriptor, held for the ``with`` block; three per file (readahead is a
        per-descriptor setting; the native reader's O_DIRECT one). None if the segment is gone (the caller sees a miss).

        A run of adjacent records is read with readahead (it streams on past each request); a lone record
        without (readahead would read its neighbours, which belong to other prefixes, halving bandwidth).
        The cache is bounded (``MAX_READ_FDS``, least recently used out): weeks of segments rolling must
        not exhaust descriptors. A descriptor leaving the cache is closed once no read uses it, so its
        number is never reused under a read in flight.
        """
        slot = seg_id * 3 + (2 if direct else sequential)
        with self._fds_lock:
            fd = self._fds.get(slot)
            if fd is not None:
                self._fds.move_to_end(slot)
            else:
                try:
                    if direct:
                        fd = self._open_direct(seg_id)
                    else:
                        fd = os.open(self.file(seg_id), os.O_RDONLY | os.O_CLOEXEC)
                        try:
                            os.posix_fadvise(
                                fd, 0, 0, os.POSIX_FADV_SEQUENTIAL if sequential else os.POSIX_FADV_RANDOM
                            )
                        except BaseException:
                            os.close(fd)
                            raise
                except FileNotFoundError:
                    fd = None
                if fd is not None:
                    self._fds[slot] = fd
                    while len(self._fds) > MAX_READ_FDS:
                        self._retire(self._fds.popitem(last=False)[1])
            if fd is not None:
                self._in_use[fd] = self._in_use.get(fd, 0) + 1
        try:
            yield fd
        finally:
            if fd is not None:
                with self._fds_lock:
                    self._in_use[fd] -= 1
                    if not self._in_use[fd]:
                        del self._in_use[fd]
                        if fd in self._retired:
                            self._retired.discard(fd)
                            os.close(fd)

    def _retire(self, fd: int) -> None:
        """Close ``fd`` (out of the cache) now, or when its last read ends. Caller holds ``_fds_lock``."""
        if self._in_use.get(fd):
            self._retired.add(fd)
        else:
            os.close(fd)

    def forget(self, seg_id: int) -> None:
        with self._fds_lock:
            for kind in (0, 1, 2):  # random, sequential, O_DIRECT
                fd = self._fds.pop(seg_id * 3 + kind, None)
                if fd is not None:
                    self._retire(fd)

    def open_fds(self) -> int:
        with self._fds_lock:
            return len(self._fds) + len(self._retired)

    def read_error(self, exc: OSError, seg_id: int, offset: int) -> None:
        """An I/O error reading a segment: the caller makes the record a miss and purges it. Logged once per
        kind (errno): a failing disk must not flood the log with a line per block."""
        with self._fds_lock:
            if exc.errno in self._read_errors_logged:
                return
            self._read_errors_logged.add(exc.errno)
        log.warning(
            "disk tier read error in segment %d at offset %d (%s): the block is a miss, purged and "
            "recomputed; further read errors of this kind are counted (read_errors), not logged",
            seg_id,
            offset,
            str(exc),  # not the exception: its traceback holds views of the read buffer
        )

    def punch(self, holes: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
        """Release ``(seg_id, offset, nbytes)`` ranges; returns how many are released (punched, or in a
        file already gone: another process unlinked it, its space went with it) and the bytes punched."""
        done = released = 0
        for seg_id, offset, nbytes in holes:
            try:
                fd = os.open(self.file(seg_id), os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                done += 1  # given back by whoever unlinked it, and counted there
                continue
            try:
                if punch_hole(fd, offset, aligned(nbytes)):
                    done, released = done + 1, released + aligned(nbytes)
            finally:
                os.close(fd)
        return done, released

    def release(self, holes: Sequence[tuple[int, int, int, bool]]) -> int:
        """After the commit that freed them: punch dead records ``(seg_id, offset, nbytes, emptied)``, unlink
        segments that emptied. Returns the bytes given back to the file system: the holes punched, and what
        the segments it unlinked still held (all of their records where holes cannot be punched).

        Emptied segments are punched too: another process may hold the file open, which would keep an
        unlinked file's pages allocated."""
        if not holes:
            return 0
        done, released = self.punch([(s, o, n) for s, o, n, _ in holes])
        if done < len(holes):
            self.counters.add("disk", "punch_unsupported", len(holes) - done)
            if not self._punch_warned:
                self._punch_warned = True
                log.warning(
                    "the file system under %s cannot punch holes: freed records keep their disk space "
                    "until their segment empties, so the byte budget is not held on disk; run "
                    "`tierkv gc --compact` or use ext4/xfs/btrfs",
                    self.path,
                )
        emptied = {s for s, _, _, empty in holes if empty}
        for seg_id in emptied:
            released += self.unlink(seg_id)
        return released

    def unlink(self, seg_id: int) -> int:
        """Remove a segment file; returns the bytes it held (allocated) when unlinked, 0 if it was gone."""
        self.forget(seg_id)
        path = self.file(seg_id)
        try:
            held = os.stat(path).st_blocks * 512
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return held

    def disk_nbytes(self) -> tuple[int, int]:
        """(allocated bytes, apparent bytes) of all segment files."""
        allocated = apparent = 0
        for p in self.path.glob("*.seg"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            allocated += st.st_blocks * 512
            apparent += st.st_size
        return allocated, apparent

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._fds_lock:  # one a read still uses (a native read on its caller's thread) closes after it
            for fd in self._fds.values():
                self._retire(fd)
            self._fds.clear()
        if self._buf is not None:
            self._buf.close()
            self._buf = None
