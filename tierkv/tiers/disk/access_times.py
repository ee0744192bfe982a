"""Access times of the disk tier's blocks: hits refresh each block's sliding TTL, coalesced in memory and
written by the writer thread in one transaction at most once a second."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tierkv.tiers.disk.index import Index, Txn

__all__ = ["AccessTimes"]


class AccessTimes:
    """Hits refresh the sliding TTL; coalesced in memory, written in one transaction at most once a second."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self._touched: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        with self._lock:
            for key in keys:
                self._touched[bytes(key)] = now

    def last(self, key: bytes) -> float:
        with self._lock:
            return self._touched.get(key, 0.0)

    def flush(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return

        def write(txn: Txn) -> None:
            for key, t in touched.items():
                self.index.touch(txn, key, t)

        try:
            self.index.write(write)
        except BaseException:
            with self._lock:  # keep them for the next try
                for key, t in touched.items():
                    self._touched[key] = max(t, self._touched.get(key, 0.0))
            raise
