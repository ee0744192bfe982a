"""Appending to a segment file: the one this process's disk writer owns, flock-held while it lives.

Records are written back to back, each padded to a page (``ALIGN``), with gathered writes, and made
durable (fdatasync) before the caller indexes them. The native writer writes them with O_DIRECT, through a
second descriptor of the same file, where the file system allows it (``SegmentDir.direct_writes``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Sequence

from tierkv import native
from tierkv.codec import Unsealed, seal
from tierkv.priority import native_idle
from tierkv.tiers.disk.files import DIRECT_REFUSED, IOV_MAX
from tierkv.tiers.disk.segments import _TEMP, ALIGN, SegmentDir, aligned, fsync_dir

__all__ = ["SegmentWriter"]

log = logging.getLogger("tierkv.disk")

_ZEROS = memoryview(bytes(ALIGN))  # page padding between records


class SegmentWriter:
    """Appends records to one segment file; owned by the disk tier's writer thread.

    The file is created under a temporary name, locked (flock, held until ``close``) and only then given
    its name, so every segment file another process can see is locked for as long as its writer lives:
    ``SegmentDir.is_active`` tells a live writer's segment from a dead one's without trusting pids.
    """

    def __init__(self, segments: SegmentDir, seg_id: int, sync: bool) -> None:
        self.seg_id = seg_id
        self.sync = sync
        final = segments.file(seg_id)
        temp = final.with_name(f"{final.name}{_TEMP}{os.getpid()}-{threading.get_native_id()}")
        self.fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A file of this id can exist only if a power cut lost the index commit that allocated the id:
            # nothing indexed can point into it, so replacing it is safe.
            os.rename(temp, final)
            if sync:  # the new name must survive a power cut before any record in it is indexed
                fsync_dir(segments.path)
        except BaseException:
            os.close(self.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        self.end = 0
        # Runs reserved below this were in flight when a write or sync of this file failed: failed too.
        self.failed_below = 0
        # The O_DIRECT descriptor (no lock of its own: the flock above is on the file's first open).
        # Only where a page is ALIGN: records are padded to ALIGN, and a larger page could hold the end of
        # one record and the start of the next, cached by a reader before the O_DIRECT write of the next.
        self.direct_fd: int | None = None
        if segments.direct_writes and segments.direct_ok and native.enabled() and mmap.PAGESIZE == ALIGN:
            try:
                self.direct_fd = os.open(final, os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as exc:  # written buffered, as without O_DIRECT
                if exc.errno in DIRECT_REFUSED:
                    segments.direct_writes = False  # this file system refuses O_DIRECT (tmpfs)
                log.warning("segment %d: no O_DIRECT descriptor (%s): written buffered", seg_id, exc)

    def append(self, records: Sequence[Sequence[bytes | memoryview] | Unsealed]) -> list[int]:
        """Write records (each a list of buffers, or a record still to be sealed) back to back, each padded
        to a page, and make them durable; return their offsets (``reserve`` then ``write``)."""
        start, offsets = self.reserve(records)
        self.write(start, self.end - start, records)
        self.sync_data()
        return offsets

    def reserve(self, records: Sequence[Sequence[bytes | memoryview] | Unsealed]) -> tuple[int, list[int]]:
        """The file's next bytes for ``records``, taken now (the next reservation follows them, even if
        their write fails): where they start, and each one's offset; they end at ``self.end``."""
        start = pos = self.end
        offsets = []
        for rec in records:
            offsets.append(pos)
            pos += aligned(_nbytes(rec))
        self.end = pos
        return start, offsets

    def write(
        self, start: int, reserved_nbytes: int, records: Sequence[Sequence[bytes | memoryview] | Unsealed]
    ) -> None:
        """Write ``records`` back to back at ``start``, into the ``reserved_nbytes`` reserved for them, each
        padded to a page, with gathered writes (no joining copy); ``sync_data`` makes them durable. May run
        on another thread than the reservations, beside another run's write. Records that would take other
        than the reserved bytes are refused before any write (the bytes past them may be the next run's),
        with a ``ValueError``: a bug, not the disk (an ``OSError``).

        Records to be sealed go to the native writer where it runs: checksums, writes and the sync with the
        GIL released, at SCHED_IDLE where this thread may come back from it."""
        nbytes = reserved_nbytes
        if native.enabled() and all(isinstance(r, Unsealed) for r in records):
            batch = [(r.head, r.token_bytes, r.payload) for r in records]  # type: ignore[union-attr]
            direct_fd = -1 if self.direct_fd is None else self.direct_fd
            # its writeback started chunk by chunk where syncs are asked for (2), the sync left to sync_data;
            # a footprint other than the one reserved is refused before any write (the bytes past it may be
            # the next run's)
            written = native.module().write_run(
                self.fd, start, batch, 2 if self.sync else 0, int(native_idle()), direct_fd, nbytes
            )
            if written != nbytes:
                raise OSError(errno.EIO, f"native writer wrote {written} bytes, expected {nbytes}")
            return
        parts: list[memoryview] = []
        for rec in records:
            views = [memoryview(b).cast("B") for b in (seal(rec) if isinstance(rec, Unsealed) else rec)]
            size = sum(v.nbytes for v in views)
            parts += views
            if aligned(size) > size:
                parts.append(_ZEROS[: aligned(size) - size])
        if (footprint := sum(v.nbytes for v in parts)) != nbytes:  # as the native writer's refusal
            raise ValueError(f"write: the records take {footprint} bytes, {nbytes} were reserved")
        at = start
        while parts:
            n = os.pwritev(self.fd, parts[:IOV_MAX], at)  # at most IOV_MAX buffers per call
            if n <= 0:
                raise OSError(errno.EIO, "short write to segment")
            at += n
            while parts and n >= parts[0].nbytes:  # a short write resumes mid-buffer
                n -= parts[0].nbytes
                parts = parts[1:]
            if n:
                parts[0] = parts[0][n:]

    def sync_data(self) -> None:
        """Make what was written durable (with ``sync``). The caller orders the syncs of its runs: a failed
        writeback is reported to one sync of the file, whichever comes first, so a sync may report an
        error of a run written beside its own (``Writer._index_appended`` fails every run in flight then)."""
        if self.sync:
            os.fdatasync(self.fd)

    def close(self) -> None:
        try:
            if self.direct_fd is not None:
                os.close(self.direct_fd)
                self.direct_fd = None
        finally:
            os.close(self.fd)  # releases the flock: the segment is now inactive for every process


def _nbytes(record: Sequence[bytes | memoryview] | Unsealed) -> int:
    """A record's bytes before its page padding."""
    if isinstance(record, Unsealed):
        return record.nbytes
    return sum(memoryview(b).nbytes for b in record)
