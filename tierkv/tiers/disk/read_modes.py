"""How the native reader reads what the page cache lacks, where nobody said: O_DIRECT or buffered, whichever
this disk served faster, measured by the restores themselves.

Neither wins everywhere. A local NVMe drive wants O_DIRECT at depth (buffered reads cost the CPU the page
cache's upkeep, several GB/s of it). This machine's virtual disk serves buffered readahead faster: a 48 MiB
prefix cold read 1.66 GB/s buffered against 1.17 with O_DIRECT, and raw O_DIRECT stays near 1 GB/s at any
request size and queue depth (2026-12-07). So each cold run of at least ``MIN_SAMPLE_NBYTES`` from the disk
is a sample of its mode's speed; the mode whose recent samples have the higher median reads next (O_DIRECT
unless buffered is ``MARGIN`` faster: the page cache stays free for the host tier's memory), the other
still gets one run in ``EXPLORE_EVERY`` so that a changed disk is noticed.

The samples are kept in the cache directory (``FILE``, replaced whole at close), so that a restarted
server's first restore, the one a restart is judged by, already reads the faster way. Several processes on
one directory each write theirs at close: the last one's stand, which is all this advisory file needs. A
file that cannot be read or parsed is ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
from collections import deque
from pathlib import Path

log = logging.getLogger("tierkv.disk")

__all__ = ["EXPLORE_EVERY", "FILE", "MARGIN", "MIN_SAMPLE_NBYTES", "MIN_SAMPLES", "ReadModes"]

FILE = "read_speeds.json"
MIN_SAMPLE_NBYTES = 8 << 20  # a run with less from the disk says more about its fixed costs than the disk
MIN_SAMPLES = 3  # of each mode before the medians choose (this disk's speed swings 30% run to run)
KEPT = 8  # samples kept per mode: recent ones, so that the choice follows the disk
EXPLORE_EVERY = 32  # samples: the mode not chosen reads one run in this many
MARGIN = 1.1  # buffered must be this much faster to be chosen


class ReadModes:
    """The mode of the next run (``direct()``), and what runs measured (``observe``). ``fixed``: the mode
    the user asked for (``direct_reads`` or ``TIERKV_DIRECT_READS``); then nothing is measured or kept."""

    def __init__(self, path: Path | None, fixed: bool | None) -> None:
        self.path, self.fixed = path, fixed
        self._lock = threading.Lock()
        self._speeds: dict[bool, deque[float]] = {True: deque(maxlen=KEPT), False: deque(maxlen=KEPT)}
        self._count = 0  # samples taken in this process
        self._changed = False
        if fixed is None and path is not None:
            self._load(path)

    @property
    def measured(self) -> bool:
        return self.fixed is None

    def direct(self) -> bool:
        """Whether the next run reads what the page cache lacks with O_DIRECT."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            best = self._best()
            if best is None:  # both measured first, O_DIRECT first
                return len(self._speeds[True]) <= len(self._speeds[False])
            if self._count % EXPLORE_EVERY == EXPLORE_EVERY - 1:
                return not best
            return best

    def _best(self) -> bool | None:
        """Whether O_DIRECT is the faster mode by the samples (None: not both measured yet); under the lock."""
        direct, buffered = self._speeds[True], self._speeds[False]
        if len(direct) < MIN_SAMPLES or len(buffered) < MIN_SAMPLES:
            return None
        return statistics.median(buffered) <= MARGIN * statistics.median(direct)

    def observe(self, direct: bool, disk_nbytes: int, total_nbytes: int, seconds: float) -> None:
        """A run read in mode ``direct``: ``disk_nbytes`` of its ``total_nbytes`` from the disk, in
        ``seconds``. Only mostly cold runs of ``MIN_SAMPLE_NBYTES`` or more count."""
        if self.fixed is not None or seconds <= 0 or disk_nbytes < MIN_SAMPLE_NBYTES:
            return
        if 2 * disk_nbytes < total_nbytes:  # mostly copied from the page cache: not the disk's speed
            return
        with self._lock:
            self._speeds[direct].append(disk_nbytes / seconds)
            self._count += 1
            self._changed = True

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
        m = self.medians()
        with self._lock:
            best = self._best()
        if best is None or m["direct"] is None or m["buffered"] is None:
            return "O_DIRECT or buffered where uncached, whichever this disk serves faster (measuring)"
        now = "O_DIRECT" if best else "buffered"
        return (
            f"O_DIRECT or buffered where uncached, whichever this disk serves faster: {now} "
            f"({m['direct'] / 1e9:.2f} GB/s O_DIRECT, {m['buffered'] / 1e9:.2f} buffered)"
        )

    def save(self) -> None:
        """The samples into the cache directory, if any were taken here (at close)."""
        if self.fixed is not None or self.path is None:
            return
        with self._lock:
            if not self._changed:
                return
            body = {"direct": list(self._speeds[True]), "buffered": list(self._speeds[False])}
            self._changed = False
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)  # whole or not at all: a reader never sees half a file
        except OSError as exc:  # a read-only or full directory: the next process measures again
            log.debug("read speeds not kept in %s: %s", self.path, exc)
            tmp.unlink(missing_ok=True)

    def _load(self, path: Path) -> None:
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # none yet, or unreadable: measured afresh
        if not isinstance(body, dict):
            return
        for name, direct in (("direct", True), ("buffered", False)):
            values = body.get(name)
            if not isinstance(values, list):
                continue
            good = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            self._speeds[direct].extend(v for v in good if math.isfinite(v) and v > 0)
