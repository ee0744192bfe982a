"""The index's rows of retention and pins (``Index`` inherits them): extending a block's retention and
pin inside a write transaction (within the pin budget and its tenant's pin quota), the ``pinned`` totals,
ending pins, and which stored blocks extend a block (``children``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tierkv.tiers.disk.schema import PINNED, RETENTION_FORMAT_VERSION, TIME, TOTALS, Entry, Policy, time_of
from tierkv.tiers.disk.tenant_rows import TenantRows

__all__ = ["RetentionRows"]

Txn = Any  # lmdb.Transaction


class RetentionRows:
    # What ``Index`` provides
    db: dict[str, Any]
    policy: Policy
    tenants: TenantRows
    format_version: Callable[[Txn], int]
    replace: Callable[[Txn, bytes, Entry, Entry], None]

    def touch(self, txn: Txn, key: bytes, t: float, retain_s: float = 0.0, pin_until_s: float = 0.0) -> str:
        """Move an entry's last access to ``t`` (never back), and extend its retention and pin to those
        given (never shorten them). An expired entry stays expired. A pin that would take the pinned
        bytes past the pin budget is not taken (the rest is). Returns "absent", "expired", "pin_refused"
        or "ok"."""
        raw = txn.get(key, db=self.db["index"])
        if raw is None:
            return "absent"
        e = Entry.unpack(raw)
        if self.policy.expired(e, max(t, e.last_access_s)):
            return "expired"
        ttl_s = self.policy.ttl_s
        if ttl_s is None or retain_s < ttl_s:  # shorter than the store keeps it anyway: nothing asked
            retain_s = 0.0
        status = "ok"
        if (retain_s or pin_until_s) and self.format_version(txn) < RETENTION_FORMAT_VERSION:
            # A format-1 store (older builds may share it, and could not read such an entry): only the
            # access time, until an operator upgrades it (``upgrade``).
            retain_s = pin_until_s = 0.0
            status = "format_1"
        new = dataclasses.replace(
            e, last_access_s=max(t, e.last_access_s), retain_s=max(retain_s, e.retain_s)
        )
        if pin_until_s > e.pin_until_s:
            add = 0 if e.pin_until_s else e.footprint
            # A pin that adds no bytes is extended, unless pins hold more than the limit (a budget
            # lowered since): then they end as they were asked, and none is extended. The same holds
            # for the block's tenant and its pin quota.
            fits = self.pinned_nbytes(txn) + add <= self.policy.pin_limit_nbytes
            quota = self.tenants.pin_quota(txn, e.ns_digest) if fits else None
            if quota is not None:
                fits = self.tenants.pinned_nbytes(txn, quota[0]) + add <= quota[1]
            if fits:
                new.pin_until_s = pin_until_s
            else:
                status = "pin_refused"
        if new != e:
            self.replace(txn, key, e, new)
        return status

    def children(self, txn: Txn, key: bytes, limit: int = 2) -> list[bytes]:
        """Keys of stored blocks whose parent is ``key`` (at most ``limit``)."""
        out: list[bytes] = []
        cur = txn.cursor(db=self.db["children"])
        ok = cur.set_range(key)
        while ok and len(out) < limit:
            row = bytes(cur.key())
            if row[: len(key)] != key:
                break
            child = row[len(key) :]
            if txn.get(child, db=self.db["index"]) is not None:  # (a format-1 process may have left it)
                out.append(child)
            ok = cur.next()
        return out

    def end_pins(self, txn: Txn, now: float) -> None:
        """Pins that ended before ``now`` release their blocks to the other classes (a sweep does this
        too; eviction and new pins must not wait for one)."""
        cur = txn.cursor(db=self.db["pinned"])
        while cur.first():
            tkey = bytes(cur.key())
            if time_of(tkey) >= now:
                return
            key = tkey[TIME.size :]
            raw = txn.get(key, db=self.db["index"])
            if raw is None:
                txn.delete(tkey, db=self.db["pinned"])  # stale row
                continue
            e = Entry.unpack(raw)
            self.replace(txn, key, e, dataclasses.replace(e, pin_until_s=0.0))

    def live_pinned_nbytes(self, txn: Txn, now: float) -> int:
        """Bytes of pins that have not ended by ``now`` (in a read transaction: ended ones still count
        in the totals until ``end_pins`` or a sweep)."""
        ended = 0
        for tkey, _ in txn.cursor(db=self.db["pinned"]):
            if time_of(bytes(tkey)) >= now:
                break
            raw = txn.get(bytes(tkey[TIME.size :]), db=self.db["index"])
            ended += Entry.unpack(raw).footprint if raw is not None else 0
        return max(0, self.pinned_nbytes(txn) - ended)

    def pinned_nbytes(self, txn: Txn) -> int:
        return self.pinned(txn)[1]

    def pinned(self, txn: Txn) -> tuple[int, int]:
        """(blocks, footprint bytes) pinned now (pins past their end count until a sweep ends them)."""
        raw = txn.get(PINNED, db=self.db["meta"])
        return TOTALS.unpack(raw) if raw else (0, 0)

    def _add_pinned(self, txn: Txn, blocks: int, nbytes: int) -> None:
        b, n = self.pinned(txn)
        txn.put(PINNED, TOTALS.pack(max(0, b + blocks), max(0, n + nbytes)), db=self.db["meta"])
