"""Reading records out of segment files on the Python path (``SegmentDir`` inherits these): whole records
into one reused buffer (``read``, for records that are decoded), or scattered straight into the caller's
views (``readv``, the zero-copy restore), adjacent records coalesced into one ``preadv`` and several in
flight on the folder's reading threads. The native reader (``native_read.py``) does the same without the
GIL; this path is its fallback and its reference in tests.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from tierkv.tiers.disk.files import IOV_MAX, aligned, media_or_raise

__all__ = ["READ_CHUNK_NBYTES", "SegmentReads"]

READ_CHUNK_NBYTES = 8 << 20  # one preadv per chunk; several in flight keep the disk's queue full


class SegmentReads:
    # ``SegmentDir``'s state, used here
    _pool: ThreadPoolExecutor
    _buf: mmap.mmap | None
    _pad: memoryview
    read_lock: threading.Lock

    def _read_fd(
        self, seg_id: int, sequential: bool = True, direct: bool = False
    ) -> contextlib.AbstractContextManager[int | None]:
        raise NotImplementedError

    def read_error(self, exc: OSError, seg_id: int, offset: int) -> None:
        raise NotImplementedError

    def read(
        self, locations: Sequence[tuple[int, int, int]], failed: set[tuple[int, int, int]] | None = None
    ) -> list[memoryview]:
        """Read records ``(seg_id, offset, nbytes)``; returns one view per record, in the given order.

        The views share one reused buffer: they are valid until the next ``read`` (callers hold the
        ``read_lock``). A record that cannot be read comes back as zeros and fails verification; one an
        I/O error hit (EIO: a bad sector) is also added to ``failed``.
        """
        order = sorted(range(len(locations)), key=lambda i: locations[i][:2])
        total = sum(aligned(n) for _, _, n in locations)
        if self._buf is None or len(self._buf) < total:
            if self._buf is not None:
                self._buf.close()
            # Pre-faulted (MAP_POPULATE): a fresh buffer costs a page fault per 4 KiB on first use.
            self._buf = mmap.mmap(
                -1,
                max(total, 64 << 20),
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0),
            )
        buf = memoryview(self._buf)
        starts = [0] * len(locations)
        # Place records in file order, so adjacent records become one contiguous read.
        runs: list[list[int]] = []  # [seg_id, file_offset, buf_offset, nbytes]
        pos = 0
        for i in order:
            seg_id, offset, nbytes = locations[i]
            starts[i] = pos
            run = runs[-1] if runs else None
            if run and run[0] == seg_id and run[1] + run[3] == offset:
                run[3] += aligned(nbytes)
            else:
                runs.append([seg_id, offset, pos, aligned(nbytes)])
            pos += aligned(nbytes)
        chunks = []
        for seg_id, offset, bpos, nbytes in runs:
            for skip in range(0, nbytes, READ_CHUNK_NBYTES):
                chunks.append((seg_id, offset + skip, bpos + skip, min(READ_CHUNK_NBYTES, nbytes - skip)))
        if len(chunks) == 1:
            errors = [self._read_chunk(buf, *chunks[0])]
        else:
            errors = list(self._pool.map(lambda c: self._read_chunk(buf, *c), chunks))
        if any(errors):
            # A chunk holds several records: read each of them alone, so only those the error is in fail
            # (the records before a bad one are still served).
            for i in range(len(locations)):
                seg_id, offset, nbytes = locations[i]
                hit = any(
                    e and c[0] == seg_id and c[1] < offset + nbytes and offset < c[1] + c[3]
                    for c, e in zip(chunks, errors)
                )
                if hit and self._read_chunk(buf, seg_id, offset, starts[i], aligned(nbytes)):
                    if failed is not None:
                        failed.add(locations[i])
        return [buf[starts[i] : starts[i] + locations[i][2]] for i in range(len(locations))]

    def _read_chunk(self, buf: memoryview, seg_id: int, offset: int, bpos: int, nbytes: int) -> bool:
        """Read ``nbytes`` at ``offset`` into ``buf[bpos:]``, zeros past what could be read; True if an I/O
        error (not a short file) stopped it."""
        got = 0
        error = False
        try:
            with self._read_fd(seg_id) as fd:
                while fd is not None and got < nbytes:
                    n = os.preadv(fd, [buf[bpos + got : bpos + nbytes]], offset + got)
                    if n <= 0:
                        break
                    got += n
        except OSError as exc:
            media_or_raise(exc, seg_id)
            self.read_error(exc, seg_id, offset + got)
            error = True
        if got < nbytes:
            buf[bpos + got : bpos + nbytes] = bytes(nbytes - got)
        return error

    def readv(
        self,
        requests: Sequence[tuple[int, int, int, list[memoryview]]],
        after: Callable[[int], bool] | None = None,
        failed: set[tuple[int, int, int]] | None = None,
    ) -> list[bool]:
        """Scatter-read records ``(seg_id, offset, nbytes, [destination views])`` into place, in parallel.

        The zero-copy restore path: a record's bytes go from the page cache straight into the caller's
        tensor. Records adjacent in a file are read by one ``preadv`` (up to ``READ_CHUNK_NBYTES``), the
        page padding between them into a scratch page. ``after(i)``, run on the reading thread once
        record ``i`` is in, verifies it while other reads are in flight. Returns, per record, whether it
        arrived in full and ``after`` accepted it. A record an I/O error hit is not ok and is added to
        ``failed`` as ``(seg_id, offset, nbytes)``.
        """
        groups: list[list[int]] = []
        # Per group: it lies in a run of adjacent records, read with readahead (as the native reader:
        # what a read without readahead brings in stays in single pages, slower to copy out later).
        ahead: list[bool] = []
        for i, (seg_id, offset, _, _) in enumerate(requests):
            adjacent = False
            if groups:
                last = requests[groups[-1][-1]]
                group_nbytes = sum(aligned(requests[j][2]) for j in groups[-1])
                adjacent = last[0] == seg_id and last[1] + aligned(last[2]) == offset
                if (
                    adjacent
                    and group_nbytes < READ_CHUNK_NBYTES
                    and sum(len(requests[j][3]) + 1 for j in groups[-1]) + len(requests[i][3]) < IOV_MAX
                ):
                    groups[-1].append(i)
                    ahead[-1] = True
                    continue
                if adjacent:
                    ahead[-1] = True
            groups.append([i])
            ahead.append(adjacent)
        ok = [False] * len(requests)

        def read_group(group: list[int], sequential: bool = False) -> None:
            seg_id, offset = requests[group[0]][0], requests[group[0]][1]
            views: list[memoryview] = []
            for j in group:
                views += requests[j][3]
                pad = aligned(requests[j][2]) - requests[j][2]
                if pad and j != group[-1]:
                    views.append(self._pad[:pad])
            try:
                if not self._readv_one(seg_id, offset, views, sequential=sequential):
                    if len(group) > 1:  # the file ends early: which record does it end in? Each alone
                        for j in group:
                            read_group([j])
                    return
            except OSError as exc:
                media_or_raise(exc, seg_id)
                if len(group) > 1:  # which record is it in? Each alone: those before it are served
                    for j in group:
                        read_group([j])
                    return
                self.read_error(exc, seg_id, offset)
                if failed is not None:
                    failed.add(requests[group[0]][:3])
                return
            for j in group:
                ok[j] = after(j) if after is not None else True

        if len(groups) == 1:
            read_group(groups[0], ahead[0])
        else:
            # Every group ends before this returns, even after one raised: a read still running once the
            # restore gave up would write into a buffer the next restore takes, or promote a block behind
            # a purge's fence (which waits only for the restore).
            futures = [self._pool.submit(read_group, g, a) for g, a in zip(groups, ahead)]
            wait(futures)
            for future in futures:
                future.result()  # the first error, now that none is running
        return ok

    def _readv_one(self, seg_id: int, offset: int, views: list[memoryview], sequential: bool) -> bool:
        with self._read_fd(seg_id, sequential) as fd:
            return fd is not None and self._preadv_all(fd, offset, views)

    @staticmethod
    def _preadv_all(fd: int, offset: int, views: list[memoryview]) -> bool:
        while views:
            n = os.preadv(fd, views, offset)
            if n <= 0:
                return False
            offset += n
            while views and n >= views[0].nbytes:  # drop what was filled; a short read resumes mid-view
                n -= views[0].nbytes
                views = views[1:]
            if n:
                views = [views[0][n:], *views[1:]]
        return True
