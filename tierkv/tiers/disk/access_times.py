"""Access times of the disk tier's blocks, and the retention and pins requests ask for them: hits refresh
each block's sliding TTL, coalesced in memory and written by the writer thread in one transaction at most
once a second.

A retention or a pin may name a block that is not indexed yet (its save is still in the staging ring or
the writer's queue): it waits here (``WAIT_S`` at most) and the writer hands it back for the flush that
follows the transaction indexing the block (``requeue``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from tierkv.metrics import Counters
from tierkv.tiers.disk.index import Index, Txn

__all__ = ["AccessTimes", "Touch", "WAIT_S", "WAIT_MAX_KEYS"]

log = logging.getLogger("tierkv.disk")

WAIT_S = 120.0  # a retention for a block never indexed (its save dropped) is forgotten after this
WAIT_MAX_KEYS = 1 << 16  # and the oldest go first past this many


@dataclasses.dataclass(slots=True)
class Touch:
    t: float  # last access
    retain_s: float = 0.0
    pin_until_s: float = 0.0

    def merge(self, other: Touch) -> None:
        self.t = max(self.t, other.t)
        self.retain_s = max(self.retain_s, other.retain_s)
        self.pin_until_s = max(self.pin_until_s, other.pin_until_s)

    @property
    def asks(self) -> bool:
        """Whether it asks for more than an access time."""
        return bool(self.retain_s or self.pin_until_s)


class AccessTimes:
    """Hits refresh the sliding TTL; coalesced in memory, written in one transaction at most once a second."""

    def __init__(self, index: Index, counters: Counters | None = None) -> None:
        self.index = index
        self.counters = counters or Counters()
        self._touched: dict[bytes, Touch] = {}
        # Per key: whether the writer has a save of it queued or being written (set by the writer): a hit
        # on such a block is kept for when it is indexed, as a retention is, not dropped as absent.
        self.writing: Callable[[Sequence[bytes]], list[bool]] | None = None
        self._waiting: dict[bytes, tuple[Touch, float]] = {}  # key -> (what it asks, since: monotonic)
        # Hits (a time only) on blocks the writer has on the way, kept apart: a burst of them must never
        # push a waiting pin or retention out of its bound.
        self._hits_waiting: dict[bytes, tuple[Touch, float]] = {}
        self._lock = threading.Lock()

    def touch(
        self, keys: Sequence[bytes], now: float, retain_s: float = 0.0, pin_until_s: float = 0.0
    ) -> None:
        with self._lock:
            if not retain_s and not pin_until_s:  # a hit's: a time only (a restore touches a whole prompt)
                touched = self._touched
                for key in keys:
                    old = touched.get(key)
                    if old is None:
                        touched[bytes(key)] = Touch(now)
                    elif old.t < now:
                        old.t = now
                return
            for key in keys:
                k = bytes(key)
                new = Touch(now, retain_s, pin_until_s)
                old = self._touched.get(k)
                if old is None:
                    self._touched[k] = new
                else:
                    old.merge(new)

    def last(self, key: bytes) -> Touch | None:
        """What is pending for ``key``: not written yet, or waiting for it to be indexed."""
        return self.last_many([key])[0]

    def last_many(self, keys: Sequence[bytes]) -> list[Touch | None]:
        """``last`` of each key, under one acquisition of the lock (a restore asks for a whole prompt)."""
        with self._lock:
            got = [(self._touched.get(k), self._waiting.get(k), self._hits_waiting.get(k)) for k in keys]
        out: list[Touch | None] = []
        for pending, waiting, hit in got:
            if waiting is None and hit is None:
                out.append(pending)
                continue
            both = Touch(0.0)
            for part in (pending, waiting and waiting[0], hit and hit[0]):
                if part:
                    both.merge(part)
            out.append(both)
        return out

    def pending_pins(self) -> list[bytes]:
        """Keys with a pin asked for and not applied yet (their bytes count against the pin budget)."""
        with self._lock:
            return [k for k, v in self._touched.items() if v.pin_until_s] + [
                k for k, (v, _) in self._waiting.items() if v.pin_until_s and k not in self._touched
            ]

    def requeue(self, keys: Sequence[bytes]) -> None:
        """The writer just indexed (or found stored) ``keys``: what waits for them is written next flush."""
        with self._lock:
            for key in keys:
                for table in (self._waiting, self._hits_waiting):
                    waiting = table.pop(key, None)
                    if waiting is None:
                        continue
                    old = self._touched.get(key)
                    if old is None:
                        self._touched[key] = waiting[0]
                    else:
                        old.merge(waiting[0])

    def flush(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return
        # Asked before the commit: a save the writer indexes and settles meanwhile is no longer on the way
        # after it, and its hit would be dropped (``_wait`` then finds it indexed and requeues it).
        keys = list(touched)
        on_way = {k for k, w in zip(keys, self.writing(keys)) if w} if self.writing is not None else set()

        def write(txn: Txn) -> dict[bytes, str]:
            if any(v.pin_until_s for v in touched.values()):  # pins that ended make room for these
                self.index.end_pins(txn, max(v.t for v in touched.values()))
            return {
                key: self.index.touch(txn, key, v.t, v.retain_s, v.pin_until_s) for key, v in touched.items()
            }

        try:
            status = self.index.write(write)
        except BaseException:
            with self._lock:  # keep them for the next try
                for key, v in touched.items():
                    old = self._touched.get(key)
                    if old is None:
                        self._touched[key] = v
                    else:
                        old.merge(v)
            raise
        refused = sum(s == "pin_refused" for s in status.values())
        if refused:
            self.counters.add("disk", "pins_refused", refused)
            log.warning("disk tier: %d pins not taken: the pin budget is full", refused)
        absent = [
            (k, touched[k]) for k, s in status.items() if s == "absent" and (touched[k].asks or k in on_way)
        ]
        if absent:
            self._wait(absent)

    def _wait(self, items: list[tuple[bytes, Touch]]) -> None:
        now = time.monotonic()
        with self._lock:
            for key, v in items:
                table = self._waiting if v.asks or key in self._waiting else self._hits_waiting
                old = table.get(key)
                if old is not None:
                    old[0].merge(v)  # keeps its place and its age
                else:
                    table[key] = (v, now)
            for table in (self._waiting, self._hits_waiting):
                while table:
                    key, (_, since) = next(iter(table.items()))
                    if now - since <= WAIT_S and len(table) <= WAIT_MAX_KEYS:
                        break
                    del table[key]
        # A flush off the writer thread (a sweep's) may have found them absent just before the writer
        # indexed them and looked here: those indexed by now are written next flush instead.
        with self.index.read() as txn:
            present = [k for k, _ in items if txn.get(k, db=self.index.db["index"]) is not None]
        if present:
            self.requeue(present)
