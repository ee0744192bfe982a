"""How the native reader reads what the page cache lacks, where nobody said: O_DIRECT or buffered, whichever
this disk served faster, measured by the restores themselves.

Neither wins everywhere. A local NVMe drive wants O_DIRECT at depth (buffered reads cost the CPU the page
cache's upkeep, several GB/s of it). This machine's virtual disk serves buffered readahead faster: a 48 MiB
prefix cold read 1.66 GB/s buffered against 1.17 with O_DIRECT, and raw O_DIRECT stays near 1 GB/s at any
request size and queue depth (2026-12-07). So each restore's mode is chosen once (``direct()``), and a run
it read alone (no other restore of this process in flight: saves and other processes are not seen) with at least ``MIN_SAMPLE_NBYTES`` from the disk, and at least half
of its bytes, is a sample of that mode's speed (``begin``/``end``). Once both modes have ``MIN_SAMPLES``,
the one whose recent samples have the higher median reads (O_DIRECT unless buffered is ``MARGIN`` faster:
the page cache stays free for the host tier's memory); the other still reads one restore in
``EXPLORE_EVERY``, so that a changed disk is noticed.

The samples are kept in the cache directory (``FILE``, 0600, replaced whole: written to a file of its own
name, then renamed), at close and whenever ``KEPT`` new ones were taken, so that a restarted server's
first restore, the one a restart is judged by, already reads the faster way, even after a SIGKILL. Several
processes on one directory each write theirs: the last one's stand, which is all this advisory file needs.
A file that cannot be read or parsed is ignored; nothing here ever fails a restore, an open or a close.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import statistics
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from tierkv.tiers.disk.files import has_cachestat
from tierkv.units import env_flag

log = logging.getLogger("tierkv.disk")

__all__ = [
    "EXPLORE_EVERY",
    "FILE",
    "MARGIN",
    "MIN_SAMPLE_NBYTES",
    "MIN_SAMPLES",
    "ReadModes",
    "configured_mode",
]

FILE = "read_speeds.json"
MIN_SAMPLE_NBYTES = 8 << 20  # a run with less from the disk says more about its fixed costs than the disk
MIN_SAMPLES = 3  # of each mode before the medians choose (this disk's speed swings 30% run to run)
KEPT = 8  # samples kept per mode: recent ones, so that the choice follows the disk
EXPLORE_EVERY = 32  # restores: the mode not chosen reads one restore in this many
MARGIN = 1.25  # buffered must be this much faster to be chosen
MAX_FILE_NBYTES = 64 << 10  # a bigger file is not ours: ignored
STALE_TMP_S = 60.0  # a temporary file this old was left by a process that died writing it


def configured_mode(direct_reads: bool | None) -> tuple[bool | None, str]:
    """The read mode set (``direct_reads``, else ``TIERKV_DIRECT_READS``), or None: measured; and a note for
    the data path line saying who set it, or why the default reads buffered."""
    if direct_reads is not None:
        return direct_reads, f"set: direct_reads={direct_reads}"
    if (value := os.environ.get("TIERKV_DIRECT_READS")) is not None:
        return env_flag("TIERKV_DIRECT_READS", True), f"set: TIERKV_DIRECT_READS={value}"
    if not has_cachestat():
        # Without cachestat, residency would be asked of mincore, group by group (files.has_cachestat): the
        # default stays buffered there, as it was before O_DIRECT reads were the default.
        return False, "no cachestat(2) in this kernel; TIERKV_DIRECT_READS=1 for O_DIRECT"
    return None, ""


class ReadModes:
    """The mode of the next restore (``direct()``), and what runs measured (``begin`` and ``end``).
    ``fixed``: the mode the user asked for (``direct_reads`` or ``TIERKV_DIRECT_READS``); then nothing is
    measured or kept."""

    def __init__(self, path: Path | None, fixed: bool | None) -> None:
        self.path, self.fixed = path, fixed
        self._lock = threading.Lock()
        self._speeds: dict[bool, deque[float]] = {True: deque(maxlen=KEPT), False: deque(maxlen=KEPT)}
        self._restores = 0  # restores since open: every EXPLORE_EVERY-th reads the other way
        self._unsaved = 0  # samples taken since the file was last written
        self._inflight = 0
        self._overlap = 0  # bumped when a run starts beside another: both are then not samples
        if fixed is None and path is not None:
            try:
                self._load(path)
            except Exception as exc:  # whatever is in that file, the store opens
                log.debug("read speeds in %s ignored: %s", path, exc)

    def direct(self) -> bool:
        """Whether the next restore reads what the page cache lacks with O_DIRECT."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            best = self._best()
            if best is None:  # both measured first, O_DIRECT first
                return len(self._speeds[True]) <= len(self._speeds[False])
            self._restores += 1
            return best if self._restores % EXPLORE_EVERY else not best

    def _best(self) -> bool | None:
        """Whether O_DIRECT is faster by the samples (None: not both measured yet). Under the lock."""
        direct, buffered = self._speeds[True], self._speeds[False]
        if len(direct) < MIN_SAMPLES or len(buffered) < MIN_SAMPLES:
            return None
        return statistics.median(buffered) <= MARGIN * statistics.median(direct)

    def gauges(self, o_direct_possible: bool) -> dict[str, int]:
        """For stats and /metrics: ``cold_reads_direct``, the mode restores read in now (1 O_DIRECT, 0
        buffered, -1 still measuring; the other mode's occasional restore aside), and the medians the
        measured choice stands on (0: none, or nothing measured). ``o_direct_possible``: False where reads
        are buffered whatever this says (the Python reader, a file system that refuses O_DIRECT)."""
        unmeasured = {"cold_read_direct_Bps": 0, "cold_read_buffered_Bps": 0}
        if not o_direct_possible or self.fixed is not None:
            return {"cold_reads_direct": int(o_direct_possible and bool(self.fixed)), **unmeasured}
        with self._lock:
            best = self._best()
        m = self.medians()
        return {
            "cold_reads_direct": -1 if best is None else int(best),
            "cold_read_direct_Bps": round(m["direct"] or 0),
            "cold_read_buffered_Bps": round(m["buffered"] or 0),
        }

    def begin(self) -> int | None:
        """A run starts: its token for ``end`` (None: it is not a sample, another run is in flight)."""
        if self.fixed is not None:
            return None
        with self._lock:
            self._inflight += 1
            if self._inflight > 1:  # the disk is shared: neither run says what it serves alone
                self._overlap += 1
                return None
            return self._overlap

    def end(
        self, token: int | None, direct: bool, disk_nbytes: int, total_nbytes: int, seconds: float
    ) -> None:
        """The run ``begin`` gave ``token`` ended, read in mode ``direct``: ``disk_nbytes`` of its
        ``total_nbytes`` from the disk (not the page cache), in ``seconds``. A sample if it ran alone, read
        at least ``MIN_SAMPLE_NBYTES`` and half of its bytes from the disk."""
        if self.fixed is not None:
            return
        with self._lock:
            self._inflight -= 1
            alone = token is not None and token == self._overlap
        if alone:
            self.observe(direct, disk_nbytes, total_nbytes, seconds)

    def observe(self, direct: bool, disk_nbytes: int, total_nbytes: int, seconds: float) -> None:
        """A sample of mode ``direct``, if it is one (``end``)."""
        if self.fixed is not None or seconds <= 0 or disk_nbytes < MIN_SAMPLE_NBYTES:
            return
        if 2 * disk_nbytes < total_nbytes:  # mostly copied from the page cache: not the disk's speed
            return
        with self._lock:
            self._speeds[direct].append(disk_nbytes / seconds)
            self._unsaved += 1
            due = self._unsaved >= KEPT
        if due:  # kept now and then, not only at close: a killed server keeps what it measured
            self.save()

    def medians(self) -> dict[str, float | None]:
        """Bytes per second of each mode's recent samples (None: none yet)."""
        with self._lock:
            return {
                name: statistics.median(self._speeds[d]) if self._speeds[d] else None
                for name, d in (("direct", True), ("buffered", False))
            }

    def describe(self) -> str:
        """For the data path line: which mode, and why."""
        if self.fixed is not None:
            return "O_DIRECT where uncached" if self.fixed else "buffered with readahead"
        with self._lock:
            best = self._best()
            counts = len(self._speeds[True]), len(self._speeds[False])
        m = self.medians()
        if best is None or m["direct"] is None or m["buffered"] is None:
            return (
                "O_DIRECT or buffered where uncached, whichever this disk serves faster (measuring: "
                f"O_DIRECT {counts[0]}, buffered {counts[1]} of {MIN_SAMPLES} cold restores each)"
            )
        return (
            f"O_DIRECT or buffered where uncached, whichever this disk serves faster: "
            f"{'O_DIRECT' if best else 'buffered'} ({m['direct'] / 1e9:.2f} GB/s O_DIRECT over {counts[0]} "
            f"cold restores, {m['buffered'] / 1e9:.2f} buffered over {counts[1]})"
        )

    def save(self) -> None:
        """The samples into the cache directory, if any were taken since the last time. Never raises: a
        read-only or full directory leaves the next process to measure again."""
        if self.fixed is not None or self.path is None:
            return
        with self._lock:
            if not self._unsaved:
                return
            body = {"direct": list(self._speeds[True]), "buffered": list(self._speeds[False])}
            self._unsaved = 0
        tmp = None
        try:
            # mkstemp: 0600 like the store's other files, and a name no other process (or container with
            # the same pid) is writing
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(body))
            os.replace(tmp, self.path)  # whole or not at all: a reader never sees half a file
            tmp = None
        except OSError as exc:
            log.debug("read speeds not kept in %s: %s", self.path, exc)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _load(self, path: Path) -> None:
        self._remove_stale(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # none yet, or not ours to read: measured afresh
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return  # a FIFO or a device would block or never end
            data = f.read(MAX_FILE_NBYTES + 1)
        if len(data) > MAX_FILE_NBYTES:
            return
        body = json.loads(data)
        if not isinstance(body, dict):
            return
        for name, direct in (("direct", True), ("buffered", False)):
            values = body.get(name)
            if not isinstance(values, list):
                continue
            for v in values[-KEPT:]:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    with contextlib.suppress(OverflowError):
                        v = float(v)
                        if math.isfinite(v) and v > 0:
                            self._speeds[direct].append(v)

    @staticmethod
    def _remove_stale(path: Path) -> None:
        """Temporary files of processes that died writing (a live writer's is seconds old at most)."""
        now = time.time()
        for tmp in path.parent.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
