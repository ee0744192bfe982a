"""Thread-safe counters per tier, read as a plain dict by ``TieredStore.stats()`` and ``/metrics``."""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["COUNTER_NAMES", "Counters"]

COUNTER_NAMES = (
    "hit_blocks",
    "hit_tokens",
    "miss_blocks",
    "bytes_read",
    "bytes_written",
    "blocks_written",
    "evictions",
    "expirations",
    "corrupt_blocks",
    "dropped_saves",
    "writeback_lost_blocks",  # dirty in the host tier (waiting for the disk), evicted before it was written
    "write_errors",
    "read_errors",  # records the medium could not return (EIO): purged
    "transient_read_errors",  # reads that failed not for the record's sake (EMFILE, ENOMEM): a miss only
    "read_cached_nbytes",  # the native reader: bytes the page cache held (read buffered, straight into place)
    "read_direct_nbytes",  # ... bytes read from the disk with O_DIRECT
    "read_blocking_nbytes",  # ... bytes read buffered and blocking (no O_DIRECT on this file system)
    "sweeps",
    "sweep_errors",
    "punch_unsupported",
    "totals_errors",
    "stale_readers",
    "recomputed_blocks",  # cached, but computed: reading was judged slower (planner.py); in miss_blocks too
    "checked_blocks",  # the sampled self-check: restored blocks also computed cold and compared
    "check_mismatch_blocks",  # ... that differed (invalidated in every tier)
)


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTER_NAMES, 0))

    def add(self, tier: str, name: str, value: int = 1) -> None:
        with self._lock:
            self._values[tier][name] += value

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {tier: dict(vals) for tier, vals in self._values.items()}
