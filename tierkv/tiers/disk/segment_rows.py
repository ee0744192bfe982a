"""The index's rows of segment files (``Index`` inherits them): each segment's live bytes and records, its
writer's pid and whether it is sealed, kept exact with every insert and removal; allocating a new segment's
id. A sealed segment whose last record goes loses its row: its file is then unlinked by the caller."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tierkv.tiers.disk.schema import SEG_ID, SEGMENT

__all__ = ["SegmentRows"]

Txn = Any  # lmdb.Transaction


class SegmentRows:
    # What ``Index`` provides
    db: dict[str, Any]
    write: Callable[[Callable[[Txn], Any]], Any]

    def _add_segment(self, txn: Txn, seg_id: int, records: int, nbytes: int) -> bool:
        k = SEG_ID.pack(seg_id)
        raw = txn.get(k, db=self.db["segments"])
        live_nbytes, live_records, pid, sealed = SEGMENT.unpack(raw) if raw else (0, 0, 0, 1)
        live_nbytes, live_records = max(0, live_nbytes + nbytes), max(0, live_records + records)
        if live_records == 0 and sealed:
            txn.delete(k, db=self.db["segments"])
            return True
        txn.put(k, SEGMENT.pack(live_nbytes, live_records, pid, sealed), db=self.db["segments"])
        return False

    def add_segment_row(self, txn: Txn, seg_id: int) -> None:
        txn.put(SEG_ID.pack(seg_id), SEGMENT.pack(0, 0, os.getpid(), 0), db=self.db["segments"])

    def seal_segment(self, txn: Txn, seg_id: int) -> bool:
        """Seal a segment's row; True if it is empty (its row is gone: unlink the file)."""
        k = SEG_ID.pack(seg_id)
        raw = txn.get(k, db=self.db["segments"])
        if raw is None:
            return False
        live_nbytes, live_records, pid, _ = SEGMENT.unpack(raw)
        if live_records == 0:
            txn.delete(k, db=self.db["segments"])
            return True
        txn.put(k, SEGMENT.pack(live_nbytes, live_records, pid, 1), db=self.db["segments"])
        return False

    def allocate_segment(self) -> int:
        def allocate(txn: Txn) -> int:
            raw = txn.get(b"next_segment", db=self.db["meta"])
            seg_id = int(raw) if raw else 1
            txn.put(b"next_segment", str(seg_id + 1).encode(), db=self.db["meta"])
            return seg_id

        return self.write(allocate)

    def segment_rows(self, txn: Txn) -> dict[int, tuple[int, int, int, int]]:
        return {SEG_ID.unpack(bytes(k))[0]: SEGMENT.unpack(v) for k, v in txn.cursor(db=self.db["segments"])}
