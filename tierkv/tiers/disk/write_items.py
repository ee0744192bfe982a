"""What the disk tier's writer queue holds (``writer.py``): records to append and index, purges, and the
barriers ``flush`` waits for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierkv.codec import Unsealed

if TYPE_CHECKING:
    from tierkv.tiers.disk.appender import Job
    from tierkv.tiers.disk.segment_writer import SegmentWriter

__all__ = ["Appending", "Barrier", "Item", "Purge", "Put", "Record"]

# A record: buffers (bytes or memoryviews) written back to back (codec.encode_parts), or one whose checksums
# the segment writer computes (codec.Unsealed: natively, off the GIL, where the native module runs).
Record = list[bytes | memoryview] | Unsealed


@dataclasses.dataclass(slots=True)
class Put:
    ns_digest: bytes
    key: bytes
    make_record: Callable[[], Record]  # called on the writer thread
    nbytes: int  # estimate, for the queue's bound
    created_s: float
    release: Callable[[], None] | None  # called once the record is written or skipped
    ns_spec: bytes | None = None  # the namespace's JSON, stored with its first block
    live: Callable[[], bool] | None = None  # False once purged or invalidated: then dropped, not indexed
    record: Record = dataclasses.field(default_factory=list)
    access_s: float | None = None  # its last access (when queued; an import's keeps the source's LRU order)
    evict: bool = True  # False: skipped, not indexed, if it would push the store past its budget (import)
    # With evict False: indexed only if this key (the block's parent) is indexed or indexed in the same
    # transaction, so that a budget cut never keeps a continuation without its prefix. None: no condition.
    after: bytes | None = None
    parent: bytes | None = None  # the key of the block before it (indexed: which prefixes extend which)

    @property
    def record_nbytes(self) -> int:
        if isinstance(self.record, Unsealed):
            return self.record.nbytes
        return sum(memoryview(b).nbytes for b in self.record)

    def is_live(self) -> bool:
        return self.live is None or self.live()


@dataclasses.dataclass(slots=True)
class Purge:
    key: bytes
    location: tuple[int, int, int]  # purge only if the index still points here (not a concurrent rewrite)
    nbytes: int = 0


@dataclasses.dataclass(slots=True)
class Barrier:
    """Queued by ``flush``: done once everything before it is."""

    nbytes: int = 0


Item = Put | Purge | Barrier


@dataclasses.dataclass(slots=True)
class Appending:
    """The writer's batch whose records are being appended: indexed once its write is done."""

    puts: list[Put]  # the whole batch (settled once indexed)
    fresh: list[Put]  # those appended
    seg: SegmentWriter
    start: int
    nbytes: int  # reserved from start
    offsets: list[int]
    job: Job
