"""The disk tier's index schema: the LMDB tables, their row formats, and the values they hold.

LMDB environment ``<dir>/index`` (named databases):

    index       key -> Entry (namespace, segment, offset, nbytes, created_s, last_access_s)
    atime       last_access_ms(8, big-endian) || key -> ""   (LRU eviction and sliding-TTL sweeps)
    ctime       created_ms || key -> ""                      (max-age sweeps)
    segments    seg_id(4) -> SegmentRow (live bytes and records, creator pid, sealed)
    totals      namespace digest -> (blocks, nbytes)         (exact, updated in the same transactions)
    namespaces  namespace digest -> spec JSON                (while the namespace has blocks)
    meta        format version, segment counter, the store's TTL / max-age / budget policy
"""

from __future__ import annotations

import dataclasses
import struct

from tierkv.tiers.disk.segments import aligned

__all__ = [
    "DBS",
    "ENTRY",
    "Entry",
    "Hole",
    "Policy",
    "SEGMENT",
    "SEG_ID",
    "STORE_FORMAT_VERSION",
    "SweepReport",
    "TIME",
    "TOTALS",
    "time_key",
    "time_of",
]

STORE_FORMAT_VERSION = 1
DBS = ("index", "atime", "ctime", "segments", "totals", "namespaces", "meta")
ENTRY = struct.Struct("<32sIQIdd")  # ns digest, seg_id, offset, nbytes, created_s, last_access_s
SEGMENT = struct.Struct("<QIIB")  # live_nbytes, live_records, creator pid, sealed
TOTALS = struct.Struct("<QQ")  # blocks, nbytes (footprint: page-aligned record bytes)
TIME = struct.Struct(">Q")  # milliseconds, big-endian so LMDB's byte order is time order
SEG_ID = struct.Struct(">I")

Hole = tuple[int, int, int, bool]  # seg_id, offset, nbytes, whether its segment emptied (unlink it)


@dataclasses.dataclass(slots=True)
class Entry:
    ns_digest: bytes
    seg_id: int
    offset: int
    nbytes: int
    created_s: float
    last_access_s: float

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        return cls(*ENTRY.unpack(raw))

    def pack(self) -> bytes:
        return ENTRY.pack(
            self.ns_digest, self.seg_id, self.offset, self.nbytes, self.created_s, self.last_access_s
        )

    @property
    def footprint(self) -> int:
        return aligned(self.nbytes)

    @property
    def location(self) -> tuple[int, int, int]:
        return (self.seg_id, self.offset, self.nbytes)


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the store keeps: persisted in ``meta`` so ``tierkv gc`` sweeps by the server's rules."""

    budget_nbytes: int | None = None  # None: unbounded
    ttl_s: float | None = None  # sliding, from last access
    max_age_s: float | None = None  # absolute, from creation

    def expired(self, e: Entry, now: float) -> bool:
        return self.expired_at(e.created_s, e.last_access_s, now)

    def expired_at(self, created_s: float, last_access_s: float, now: float) -> bool:
        if self.ttl_s is not None and now - last_access_s > self.ttl_s:
            return True
        return self.max_age_s is not None and now - created_s > self.max_age_s


@dataclasses.dataclass(frozen=True)
class SweepReport:
    expired: int = 0
    evicted: int = 0
    purged: int = 0
    corrupt: int = 0
    checked: int = 0
    freed_nbytes: int = 0
    segments_removed: int = 0

    def __add__(self, other: SweepReport) -> SweepReport:
        return SweepReport(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def time_key(t: float, key: bytes) -> bytes:
    return TIME.pack(max(0, int(t * 1000))) + key


def time_of(tkey: bytes) -> float:
    return TIME.unpack(tkey[: TIME.size])[0] / 1000.0
