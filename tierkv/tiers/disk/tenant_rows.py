"""Tenants in the disk tier's index: exact usage per tenant, each tenant's blocks in time order, its
quotas, and eviction that takes first from tenants above their quota.

    tenants      tenant id (16) -> (blocks, nbytes, pinned blocks, pinned nbytes)   (exact: updated in
                 the transactions that change the entries)
    tenant_time  tenant id || class (1) || the entry's time row -> ""   (class 0: its ``atime`` row,
                 1: its ``retained`` row; a pinned block has none, as it is never evicted)
    meta         ``tenants``: the quotas (``tenancy.quotas_to_json``), as the server last set them;
                 ``tenant_rows``: set once the rows of blocks stored before this build were filled

A block's tenant is read off its namespace's salt (``tenancy.tenant_id``): every process of this build
keeps the rows, whatever it was told. Blocks of no tenant (a server without API keys) have none.
A process of an older build on the same directory keeps none of this: a row whose entry is gone or has
moved is mended when eviction meets it; a block it stored has no row (it is evicted by the store-wide
order only); the totals it moves are recomputed by ``reconcile`` (each budget sweep, with quotas).
"""

from __future__ import annotations

import json
import logging
import struct
from typing import TYPE_CHECKING, Any

from tierkv.tenancy import TENANT_ID_NBYTES, Quota, quotas_from_json, quotas_to_json, tenant_id
from tierkv.tiers.disk.schema import TIME, TOTALS, Entry, Hole

if TYPE_CHECKING:
    from tierkv.tiers.disk.index import Index, Txn

__all__ = ["TENANT_TABLES", "TenantRows", "TenantUsage"]

log = logging.getLogger("tierkv.disk")

TENANT_TABLES = ("tenants", "tenant_time")
TENANT_TOTALS = struct.Struct("<QQQQ")  # blocks, nbytes, pinned blocks, pinned nbytes
CLASS = {"atime": b"\0", "retained": b"\1"}  # eviction takes every tenant's class 0 before any class 1
QUOTAS = b"tenants"  # meta key
FILLED = b"tenant_rows"  # meta key
HEAD = TENANT_ID_NBYTES + 1  # tenant id || class
FILL_BATCH = 4096  # entries per transaction of ``fill``
MAX_CACHED_NAMESPACES = 1 << 16  # namespace -> tenant answers kept per process

TenantUsage = tuple[int, int, int, int]  # blocks, nbytes, pinned blocks, pinned nbytes


class TenantRows:
    def __init__(self, index: Index) -> None:
        self.index = index
        self._of: dict[bytes, bytes | None] = {}  # namespace digest -> tenant id (a namespace never changes)
        self._quotas: tuple[bytes | None, dict[bytes, Quota]] = (None, {})  # (stored JSON, parsed): one
        # object, so that threads never pair one's JSON with another's parse

    def of(self, txn: Txn, ns: bytes) -> bytes | None:
        """The tenant of a namespace (None: none, or its spec is not stored)."""
        try:
            return self._of[ns]
        except KeyError:
            pass
        raw = txn.get(ns, db=self.index.db["namespaces"])
        if raw is None:
            return None
        salt = json.loads(bytes(raw)).get("tenant_salt", "")
        tid = tenant_id(salt) if isinstance(salt, str) else None
        if len(self._of) >= MAX_CACHED_NAMESPACES:  # clients choose cache_salts: bounded, re-read after
            self._of.clear()
        self._of[ns] = tid
        return tid

    # ---------------------------------------------------------------- row updates (inside Index.write)

    def insert(self, txn: Txn, key: bytes, e: Entry) -> None:
        tid = self.of(txn, e.ns_digest)
        if tid is None:
            return
        row = _row(tid, key, e)
        if row is not None:
            txn.put(row, b"", db=self.index.db["tenant_time"])
        pinned = 1 if e.pin_until_s else 0
        self._add(txn, tid, (1, e.footprint, pinned, pinned * e.footprint))

    def remove(self, txn: Txn, key: bytes, e: Entry) -> None:
        """(Before the entry's namespace may lose its spec with its last block.)"""
        tid = self.of(txn, e.ns_digest)
        if tid is None:
            return
        row = _row(tid, key, e)
        if row is not None:
            txn.delete(row, db=self.index.db["tenant_time"])
        pinned = 1 if e.pin_until_s else 0
        self._add(txn, tid, (-1, -e.footprint, -pinned, -pinned * e.footprint))

    def replace(self, txn: Txn, key: bytes, old: Entry, new: Entry) -> None:
        tid = self.of(txn, old.ns_digest)
        if tid is None:
            return
        db = self.index.db["tenant_time"]
        row = _row(tid, key, old)
        if row is not None:
            txn.delete(row, db=db)
        row = _row(tid, key, new)
        if row is not None:
            txn.put(row, b"", db=db)
        if bool(new.pin_until_s) != bool(old.pin_until_s):
            sign = 1 if new.pin_until_s else -1
            self._add(txn, tid, (0, 0, sign, sign * new.footprint))

    def _add(self, txn: Txn, tid: bytes, delta: TenantUsage) -> None:
        db = self.index.db["tenants"]
        raw = txn.get(tid, db=db)
        now = TENANT_TOTALS.unpack(raw) if raw else (0, 0, 0, 0)
        new = tuple(max(0, a + b) for a, b in zip(now, delta))
        if new[0] == 0:
            txn.delete(tid, db=db)
        else:
            txn.put(tid, TENANT_TOTALS.pack(*new), db=db)

    # ---------------------------------------------------------------- quotas

    def quotas(self, txn: Txn) -> dict[bytes, Quota]:
        got = txn.get(QUOTAS, db=self.index.db["meta"])
        raw = bytes(got) if got is not None else None
        cached = self._quotas
        if raw == cached[0]:
            return cached[1]
        try:
            parsed = quotas_from_json(raw)
        except Exception as exc:  # damaged, or a later build's: no quotas (plain LRU), logged
            log.error("disk tier: the stored tenant quotas do not parse (%s): none applied", exc)
            parsed = {}
        self._quotas = (raw, parsed)
        return parsed

    def set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        """Store the quotas (the server's keys file): every process on the directory evicts by them."""
        raw = quotas_to_json(quotas)

        def put(txn: Txn) -> None:
            if txn.get(QUOTAS, db=self.index.db["meta"]) != raw:
                txn.put(QUOTAS, raw, db=self.index.db["meta"])

        self.index.write(put)

    def usage(self, txn: Txn) -> dict[bytes, TenantUsage]:
        return {bytes(k): TENANT_TOTALS.unpack(v) for k, v in txn.cursor(db=self.index.db["tenants"])}

    def pinned_nbytes(self, txn: Txn, tid: bytes) -> int:
        raw = txn.get(tid, db=self.index.db["tenants"])
        return TENANT_TOTALS.unpack(raw)[3] if raw else 0

    def pin_quota(self, txn: Txn, ns: bytes) -> tuple[bytes, int] | None:
        """(tenant, its pin quota) for a block of namespace ``ns``, if its tenant has one."""
        tid = self.of(txn, ns)
        q = self.quotas(txn).get(tid) if tid is not None else None
        if tid is None or q is None or q.pin_nbytes is None:
            return None
        return tid, q.pin_nbytes

    def evict_over_quota(
        self, txn: Txn, total: int, budget: int, limit: int | None = None
    ) -> tuple[list[Hole], int]:
        """Evict while the live bytes exceed ``budget``, from tenants above their disk quota only (a
        tenant without one is above it with any block): across them, every tenant's blocks of the
        store's own retention before any kept by a request, the oldest first, leaves before their
        prefixes (as the budget's own eviction, ``eviction.py``: a prompt from its end, so that what stays
        is a prefix a lookup reaches); never a pinned block. Nothing when no tenant has a disk quota. At
        most ``limit`` blocks. Returns the holes and the live bytes left."""
        quotas = self.quotas(txn)
        if total <= budget or not any(q.disk_nbytes is not None for q in quotas.values()):
            return [], total
        used = {tid: u[1] for tid, u in self.usage(txn).items()}
        over = {tid for tid, n in used.items() if n > _disk_quota(quotas.get(tid))}
        db = self.index.db["tenant_time"]
        leaves = _Leaves(self.index, txn, txn.cursor(db=db))
        holes: list[Hole] = []
        steps = 0  # evictions and mended rows: a batch's transaction stays bounded either way
        while total > budget and over and (limit is None or steps < limit):
            steps += 1
            firsts = {tid: leaves.first(tid) for tid in over}
            # Every tenant's leaves before any block with a continuation stored (that order only where no
            # tenant over its quota has a leaf: their continuations are pinned, say).
            rows = [r for r in firsts.values() if r is not None] or [
                r for r in (leaves.first(tid, leaf=False) for tid in over) if r is not None
            ]
            if not rows:  # nothing evictable left (all pinned)
                break
            oldest = min(rows, key=lambda r: r[TENANT_ID_NBYTES:])
            tid, key = oldest[:TENANT_ID_NBYTES], oldest[HEAD + TIME.size :]
            raw = txn.get(key, db=self.index.db["index"])
            e = Entry.unpack(raw) if raw is not None else None
            if e is None or _row(tid, key, e) != oldest:  # stale (an older build's write): the right one
                txn.delete(oldest, db=db)
                right = _row(tid, key, e) if e is not None and self.of(txn, e.ns_digest) == tid else None
                if right is not None:
                    txn.put(right, b"", db=db)
                    leaves.back_to(right)
                continue
            # Then its prefix, while each is a leaf of the tenant's same class no younger than this row (a
            # prompt's blocks share one time): the prompt is taken from its end in one walk.
            while e is not None:
                parent = txn.get(key, db=self.index.db["parents"])
                holes.append((*e.location, self.index.remove(txn, key, e)))
                total -= e.footprint
                used[tid] -= e.footprint
                if used[tid] <= _disk_quota(quotas.get(tid)):
                    over.discard(tid)
                if parent is None:
                    break
                key = bytes(parent)
                e = self._evictable_prefix(txn, tid, key, oldest)
                if e is None or tid not in over or total <= budget or (limit is not None and steps >= limit):
                    leaves.left(key)  # a leaf now, maybe before where its tenant's scan stands
                    break
                steps += 1
        return holes, total

    def _evictable_prefix(self, txn: Txn, tid: bytes, key: bytes, below: bytes) -> Entry | None:
        """``key``'s entry if it is next in the walk from the row ``below``: the tenant's, of the same class,
        no younger, with its own row in place, and now a leaf."""
        raw = txn.get(key, db=self.index.db["index"])
        if raw is None:
            return None
        e = Entry.unpack(raw)
        row = _row(tid, key, e)
        if (
            row is None  # pinned
            or row[:HEAD] != below[:HEAD]
            or row[HEAD : HEAD + TIME.size] > below[HEAD : HEAD + TIME.size]
            or self.of(txn, e.ns_digest) != tid
            or txn.get(row, db=self.index.db["tenant_time"]) is None
            or self.index.children(txn, key, limit=1)
        ):
            return None
        return e

    # ---------------------------------------------------------------- repair

    def reconcile(self) -> int:
        """Recompute every tenant's totals from what every build keeps exact (the namespaces' totals, the
        pinned rows) and fix those that drifted (an older build writing beside this one). Computed in a
        read snapshot; what differed there is added to the totals in one short write (correct updates
        since the snapshot moved both alike). Returns how many tenants were fixed. O(namespaces + pins)."""
        db = self.index.db
        with self.index.read() as txn:
            want: dict[bytes, list[int]] = {}
            for ns, v in txn.cursor(db=db["totals"]):
                tid = self.of(txn, bytes(ns))
                if tid is not None:
                    blocks, nbytes = TOTALS.unpack(v)
                    row = want.setdefault(tid, [0, 0, 0, 0])
                    row[0] += blocks
                    row[1] += nbytes
            for tkey, _ in txn.cursor(db=db["pinned"]):
                key = bytes(tkey[TIME.size :])
                raw = txn.get(key, db=db["index"])
                e = Entry.unpack(raw) if raw is not None else None
                if e is None or e.time_row(key) != ("pinned", bytes(tkey)):  # a stale row
                    continue
                tid = self.of(txn, e.ns_digest)
                if tid is not None:
                    row = want.setdefault(tid, [0, 0, 0, 0])
                    row[2] += 1
                    row[3] += e.footprint
            have = self.usage(txn)
        drift = {}
        for tid in have.keys() | want.keys():
            w, h = want.get(tid, [0, 0, 0, 0]), have.get(tid, (0, 0, 0, 0))
            if tuple(w) != tuple(h):
                drift[tid] = tuple(a - b for a, b in zip(w, h))
        if drift:

            def fix(txn: Txn) -> None:
                for tid, delta in drift.items():
                    self._add(txn, tid, delta)  # type: ignore[arg-type]

            self.index.write(fix)
        return len(drift)

    def fill(self) -> None:
        """Rows for the blocks of tenants stored before this build kept them, then exact totals (once per
        store; a writer calls it at open). In batches of short transactions: rows other writers put
        meanwhile are kept (a row is only added where it is missing), and the totals are recomputed at
        the end (``reconcile``)."""
        db = self.index.db
        with self.index.read() as txn:
            if txn.get(FILLED, db=db["meta"]) is not None:
                return
        last: bytes | None = None
        added = 0

        def batch(txn: Txn) -> tuple[bytes | None, int]:
            cur = txn.cursor(db=db["index"])
            ok = cur.set_range(last + b"\0") if last is not None else cur.first()
            n, at = 0, None
            for _ in range(FILL_BATCH):
                if not ok:
                    return None, n
                at = bytes(cur.key())
                e = Entry.unpack(cur.value())
                tid = self.of(txn, e.ns_digest)
                row = _row(tid, at, e) if tid is not None else None
                if row is not None and txn.get(row, db=db["tenant_time"]) is None:
                    txn.put(row, b"", db=db["tenant_time"])
                    n += 1
                ok = cur.next()
            return at, n

        while True:
            last, n = self.index.write(batch)
            added += n
            if last is None:
                break

        fixed = self.reconcile()
        self.index.write(lambda txn: txn.put(FILLED, b"1", db=db["meta"]))
        if added or fixed:
            log.info("disk tier: tenant rows filled for %d blocks, totals of %d tenants fixed", added, fixed)


def _disk_quota(q: Quota | None) -> int:
    return q.disk_nbytes if q is not None and q.disk_nbytes is not None else 0


def _row(tid: bytes, key: bytes, e: Entry) -> bytes | None:
    table, row = e.time_row(key)
    cls = CLASS.get(table)
    return None if cls is None else tid + cls + row


class _Leaves:
    """Each tenant's first row whose block has no continuation stored, in one transaction of eviction. A
    tenant's scan resumes where its last one stopped: a row it passed has a continuation stored, and stays
    so until that goes, which the walk up a prefix reports (``left``). Without that, each eviction scanned
    a long, old shared prefix again: 3,000 blocks and 200 continuations took 3 s in one transaction."""

    def __init__(self, index: Index, txn: Txn, cur: Any) -> None:
        self.index, self.txn, self.cur = index, txn, cur
        self.at: dict[bytes, bytes] = {}  # tenant -> the row its scan resumes from

    def first(self, tid: bytes, leaf: bool = True) -> bytes | None:
        """The tenant's first leaf row (with ``leaf`` False, its first row), or None."""
        if not leaf:
            return _first(self.cur, tid)
        if not self.cur.set_range(self.at.get(tid, tid)):
            return None
        for row in self.cur.iternext(values=False):
            row = bytes(row)
            if row[:TENANT_ID_NBYTES] != tid:
                break
            if not self.index.children(self.txn, row[HEAD + TIME.size :], limit=1):
                self.at[tid] = row
                return row
        self.at[tid] = tid + b"\xff"  # none: past the tenant's rows, until a leaf comes back
        return None

    def left(self, key: bytes) -> None:
        """``key``'s block may have just become a leaf (its last continuation went)."""
        raw = self.txn.get(key, db=self.index.db["index"])
        if raw is None or self.index.children(self.txn, key, limit=1):
            return
        e = Entry.unpack(raw)
        tid = self.index.tenants.of(self.txn, e.ns_digest)
        row = _row(tid, key, e) if tid is not None else None
        if row is not None:
            self.back_to(row)

    def back_to(self, row: bytes) -> None:
        tid = row[:TENANT_ID_NBYTES]
        if tid in self.at and row < self.at[tid]:
            self.at[tid] = row


def _first(cur: object, tid: bytes) -> bytes | None:
    """The tenant's first row (class 0 before 1, then time order)."""
    if not cur.set_range(tid):  # type: ignore[attr-defined]
        return None
    row = bytes(cur.key())  # type: ignore[attr-defined]
    return row if row[:TENANT_ID_NBYTES] == tid else None
