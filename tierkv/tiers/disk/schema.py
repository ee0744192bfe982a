"""The disk tier's index schema: the LMDB tables, their row formats, and the values they hold.

LMDB environment ``<dir>/index`` (named databases):

    index       key -> Entry (namespace, segment, offset, nbytes, created_s, last_access_s[, retain_s,
                pin_until_s]: the last two only when either is set, so that the rest stay readable by
                format-1 builds)
    atime       last_access_ms(8, big-endian) || key -> ""   (blocks of the store's own retention: LRU
                                                             eviction first, sliding-TTL sweeps)
    retained    (last_access + retain_s)_ms || key -> ""     (blocks a request asked to keep longer:
                                                             evicted after every ``atime`` block)
    pinned      pin_until_ms || key -> ""                    (pinned: never evicted, never idle-expired)
    ctime       created_ms || key -> ""                      (max-age sweeps)
    parents     key -> parent key                            (for blocks saved since format 2)
    children    parent key || key -> ""                      (which stored prefixes extend a block:
                                                             a deletion by prompt keeps shared ones)
    segments    seg_id(4) -> SegmentRow (live bytes and records, creator pid, sealed)
    totals      namespace digest -> (blocks, nbytes)         (exact, updated in the same transactions)
    namespaces  namespace digest -> spec JSON                (while the namespace has blocks)
    meta        format version, segment counter, the store's TTL / max-age / budget policy, and
                ``pinned``: (blocks, nbytes) pinned (exact, updated in the same transactions)
    tenants, tenant_time   usage and time rows per tenant (``tenant_rows.py``)

Each entry has one row in exactly one of ``atime``, ``retained`` and ``pinned`` (``Entry.time_row``).

Format versions: a new store is format 3. Format 2 added retention, pins and the ``parents`` and
``children`` tables; format 3 adds records of version 2 (``codec.py``: the payload 64-byte aligned in the
record, for a faster copy out of the page cache), which builds before it cannot read. A store written by
an older build (format 1 or 2) is read and written as is, so that those builds can go on sharing it: its
records stay version 1, and a format-1 store takes no retention or pin (64-byte entries; the new tables
ignored by that build). An operator's ``tierkv gc --upgrade`` (older builds stopped first) fills
``parents`` and ``children`` from the records' own headers and marks it 3, which older builds refuse. An entry is packed in format 1 unless it holds a retention or a pin. Rows of the new
tables that a format-1 process left stale are ignored: a ``children`` row counts only while its child is
indexed.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

from tierkv.tiers.disk.segments import aligned

__all__ = [
    "DBS",
    "ENTRY",
    "ENTRY_V1",
    "ALIGNED_RECORDS_FORMAT_VERSION",
    "BASE_FORMAT_VERSION",
    "PINNED",
    "READ_FORMAT_VERSIONS",
    "RETENTION_FORMAT_VERSION",
    "DryCount",
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

STORE_FORMAT_VERSION = 3  # a new store's (and an upgraded one's)
READ_FORMAT_VERSIONS = (1, 2, 3)  # 1 and 2 are read and written as is until upgraded (see above)
RETENTION_FORMAT_VERSION = 2  # from here on: retention, pins, parents
ALIGNED_RECORDS_FORMAT_VERSION = 3  # from here on: records of version 2 are written
DBS = (
    "index",
    "atime",
    "retained",
    "pinned",
    "ctime",
    "parents",
    "children",
    "segments",
    "totals",
    "namespaces",
    "meta",
    "tenants",
    "tenant_time",
)
ENTRY_V1 = struct.Struct("<32sIQIdd")  # ns digest, seg_id, offset, nbytes, created_s, last_access_s
ENTRY = struct.Struct("<32sIQIdddd")  # version 2, with a retention or a pin: ..., retain_s, pin_until_s
BASE_FORMAT_VERSION = 1  # what a store without any retention or pin is marked
PINNED = b"pinned"  # meta key: TOTALS of the pinned blocks
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
    retain_s: float = 0.0  # kept at least this long after its last access (0: the store's TTL only)
    pin_until_s: float = 0.0  # pinned until then (0: not pinned)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        if len(raw) == ENTRY_V1.size:  # written by format version 1
            return cls(*ENTRY_V1.unpack(raw))
        return cls(*ENTRY.unpack(raw))

    @classmethod
    def unpack_many(cls, raws: Sequence[bytes | None]) -> list[Entry | None]:
        """``unpack`` of each (None stays None), in one call: a restore's probe unpacks every block's."""
        v1, v1_nbytes, v2 = ENTRY_V1.unpack, ENTRY_V1.size, ENTRY.unpack
        return [
            None if raw is None else cls(*(v1(raw) if len(raw) == v1_nbytes else v2(raw))) for raw in raws
        ]

    @property
    def needs_v2(self) -> bool:
        """Whether it holds what only format 2 can say (a retention or a pin)."""
        return bool(self.retain_s or self.pin_until_s)

    def pack(self) -> bytes:
        base = (self.ns_digest, self.seg_id, self.offset, self.nbytes, self.created_s, self.last_access_s)
        if not self.needs_v2:
            return ENTRY_V1.pack(*base)
        return ENTRY.pack(*base, self.retain_s, self.pin_until_s)

    def time_row(self, key: bytes) -> tuple[str, bytes]:
        """The entry's row in the table of its class: pinned, retained by a request, or the store's."""
        if self.pin_until_s:
            return "pinned", time_key(self.pin_until_s, key)
        if self.retain_s:
            return "retained", time_key(self.last_access_s + self.retain_s, key)
        return "atime", time_key(self.last_access_s, key)

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
    max_age_s: float | None = None  # absolute, from creation: caps every retention and pin too
    pin_budget_nbytes: int | None = None  # None: a quarter of the budget (no pins without a budget)

    @property
    def pin_limit_nbytes(self) -> int:
        """The bytes pins may hold: never more than the budget (else it could not be met)."""
        if self.pin_budget_nbytes is not None:
            limit = self.pin_budget_nbytes
            return min(limit, self.budget_nbytes) if self.budget_nbytes is not None else limit
        return self.budget_nbytes // 4 if self.budget_nbytes else 0

    def expired(self, e: Entry, now: float) -> bool:
        return self.expired_at(e.created_s, e.last_access_s, now, e.retain_s, e.pin_until_s)

    def expired_at(
        self,
        created_s: float,
        last_access_s: float,
        now: float,
        retain_s: float = 0.0,
        pin_until_s: float = 0.0,
    ) -> bool:
        """A request's retention extends the store's TTL (never shortens it); a pin holds until it ends;
        the max age holds for every block."""
        if self.max_age_s is not None and now - created_s > self.max_age_s:
            return True
        if pin_until_s > now:
            return False
        return self.ttl_s is not None and now - last_access_s > max(self.ttl_s, retain_s)


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


@dataclasses.dataclass
class DryCount:
    """What a dry run's steps (purge, expiry, budget) counted so far: it removes nothing, so each step
    sees the whole index, and a block two steps would remove counts once."""

    keys: set[bytes] = dataclasses.field(default_factory=set)
    nbytes: int = 0

    def add(self, key: bytes, e: Entry) -> bool:
        """Count ``key`` unless an earlier step did; whether it was new."""
        if key in self.keys:
            return False
        self.keys.add(key)
        self.nbytes += e.footprint
        return True


def time_key(t: float, key: bytes) -> bytes:
    return TIME.pack(max(0, int(t * 1000))) + key


def time_of(tkey: bytes) -> float:
    return TIME.unpack(tkey[: TIME.size])[0] / 1000.0
