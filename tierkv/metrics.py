"""Thread-safe counters per tier, read as a plain dict by ``TieredStore.stats()`` and ``/metrics``."""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["COUNTER_NAMES", "Counters", "EXPORTED_COUNTERS", "EXPORTED_GAUGES"]

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
    "read_blocking_nbytes",  # ... bytes read buffered from the disk (the buffered mode, or no O_DIRECT)
    "sweeps",
    "sweep_errors",
    "punch_unsupported",
    "totals_errors",
    "stale_readers",
    "recomputed_blocks",  # cached, but computed: reading was judged slower (planner.py); in miss_blocks too
    "checked_blocks",  # the sampled self-check: restored blocks also computed cold and compared
    "check_mismatch_blocks",  # ... that differed (invalidated in every tier)
    "pins_refused",  # pins past the pin budget when written (another process pinned first): not taken
    "mac_failures",  # remote records no deployment secret signed (forged or foreign): deleted, never served
)


# What both engines call the store's counters and gauges on /metrics (``tierkv serve`` and the vLLM
# connector: one dashboard reads both). counter or gauge -> (Prometheus name, help); a counter's series
# gets Prometheus' ``_total``. Each is labelled by tier.
EXPORTED_COUNTERS = {
    "bytes_read": ("tierkv_tier_read_bytes", "Bytes read from the tier"),
    "bytes_written": ("tierkv_tier_written_bytes", "Bytes written to the tier"),
    "evictions": ("tierkv_tier_evictions", "Blocks evicted to hold the tier's budget"),
    "expirations": ("tierkv_tier_expirations", "Blocks found or swept expired"),
    "corrupt_blocks": (
        "tierkv_tier_corrupt_blocks",
        "Blocks that failed verification (purged, never served)",
    ),
    "dropped_saves": (
        "tierkv_tier_dropped_saves",
        "Saves dropped (no tier could hold them, or tier degraded)",
    ),
    "writeback_lost_blocks": (
        "tierkv_tier_writeback_lost_blocks",
        "Blocks that waited for the tier in the host tier (write-back) and left it before they were written",
    ),
    "write_errors": ("tierkv_tier_write_errors", "Write batches that failed (e.g. a full disk)"),
    "pins_refused": (
        "tierkv_tier_pins_refused",
        "Pins not taken when written: the pin budget was full (another process pinned first)",
    ),
    "read_errors": ("tierkv_tier_read_errors", "Records whose read failed (EIO): purged, recomputed"),
}
EXPORTED_GAUGES = {
    "used_nbytes": ("tierkv_tier_used_bytes", "Bytes held by the tier"),
    "capacity_nbytes": ("tierkv_tier_capacity_bytes", "The tier's budget (0: none)"),
    "write_queue_nbytes": ("tierkv_tier_write_queue_bytes", "Bytes queued for the tier's writer"),
    "writeback_blocks": (
        "tierkv_tier_writeback_blocks",
        "Blocks waiting dirty in the host tier for room in the tier's write queue",
    ),
    "cold_reads_direct": (
        "tierkv_tier_cold_reads_direct",
        "How the tier reads what the page cache lacks: 1 O_DIRECT, 0 buffered, -1 still measuring "
        "which is faster",
    ),
    "cold_read_direct_Bps": (
        "tierkv_tier_cold_read_direct_bytes_per_second",
        "Median speed of the recent cold restores read with O_DIRECT, as the cache directory keeps them "
        "for the measured read mode (0: none, or a mode set)",
    ),
    "cold_read_buffered_Bps": (
        "tierkv_tier_cold_read_buffered_bytes_per_second",
        "Median speed of the recent cold restores read buffered, as the cache directory keeps them "
        "for the measured read mode (0: none, or a mode set)",
    ),
}


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
