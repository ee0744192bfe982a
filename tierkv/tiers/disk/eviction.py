"""The index's eviction (``Index`` inherits it): blocks out, until the live bytes fit a budget, in an order
that keeps what a lookup can still reach.

Least recently used first, leaves before their prefixes: a block whose next block is stored (a row in
``children``) waits until that one is gone. A lookup stops at the first block missing, so a block left
without its prefix is stored for nothing; and a prompt's blocks share one access time, so by time and key
alone a budget took blocks from anywhere in them (``tierkv gc --budget 100MiB`` left 141 of a 264-block
prompt's blocks, and the prompt then hit none of them). Only when every block left over the budget has a
child that is kept (pinned, or asked to be kept longer) is the plain time order used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierkv.tiers.disk.schema import TIME, Entry, Hole

__all__ = ["EVICTION_ORDER", "Eviction", "headroom"]

Txn = Any  # lmdb.Transaction

EVICTION_ORDER = ("atime", "retained")  # pinned blocks are never evicted


def headroom(budget_nbytes: int) -> int:
    """What the disk writer evicts past its budget once over it (``evict_over``): a 64th of a budget of 1
    GiB or more, at most 256 MiB; nothing below (a small budget is filled exactly)."""
    return min(budget_nbytes // 64, 256 << 20) if budget_nbytes >= 1 << 30 else 0


class Eviction:
    # What ``Index`` provides
    db: dict[str, Any]
    tenants: Any
    total_nbytes: Callable[[Txn], int]
    end_pins: Callable[[Txn, float], None]
    children: Callable[..., list[bytes]]
    remove: Callable[[Txn, bytes, Entry], bool]

    def evict_over(
        self,
        txn: Txn,
        budget: int,
        now: float | None = None,
        max_blocks: int | None = None,
        headroom_nbytes: int = 0,
    ) -> list[Hole]:
        """Evict blocks until the live bytes fit in ``budget`` (at most ``max_blocks`` of them, if given;
        once over it, down to ``headroom_nbytes`` below it: a writer that evicts a little at every batch
        would scan a long prompt to its end every time, where one call takes a stretch of it at once):
        first from tenants above their quota (``TenantRows.evict_over_quota``), then from the store's own
        retention, least recently used first, then those a request asked to keep, the soonest to lapse
        first, leaves before their prefixes (above); never a pinned block (pins fit in their own budget,
        a part of this one)."""
        total = self.total_nbytes(txn)
        holes: list[Hole] = []
        if total > budget and now is not None:
            self.end_pins(txn, now)
        if total > budget:
            budget = max(0, budget - headroom_nbytes)
            holes, total = self.tenants.evict_over_quota(txn, total, budget, max_blocks)
        limit = max_blocks  # (the quota's evictions count)
        for leaves_only in (True, False):
            while total > budget and (limit is None or len(holes) < limit):
                before = len(holes)
                for table in EVICTION_ORDER:
                    # A block a request asked to keep goes only while none of the store's own can: after
                    # each, the store's own again (the one evicted may have left its prefix a leaf there).
                    once = table != EVICTION_ORDER[0]
                    total = self._evict_from(txn, table, total, budget, holes, limit, leaves_only, once)
                    if len(holes) > before and once:
                        break
                if len(holes) == before:
                    break
        return holes

    def _evict_from(
        self,
        txn: Txn,
        table: str,
        total: int,
        budget: int,
        holes: list[Hole],
        limit: int | None,
        leaves_only: bool,
        once: bool = False,
    ) -> int:
        """One pass over a time table from its oldest end, each block evicted appended to ``holes`` (with
        ``once``, only the first leaf and its prefix); returns the live bytes left."""
        cur = txn.cursor(db=self.db[table])
        ok = cur.first()
        start = len(holes)
        while (
            ok
            and total > budget
            and (limit is None or len(holes) < limit)
            and not (once and len(holes) > start)
        ):
            tkey = bytes(cur.key())
            key = tkey[TIME.size :]
            raw = txn.get(key, db=self.db["index"])
            if raw is None or Entry.unpack(raw).time_row(key) != (table, tkey):
                txn.delete(tkey, db=self.db[table])  # a stale row (not in a consistent store): dropped
                ok = cur.set_range(tkey)
                continue
            if leaves_only and self.children(txn, key, limit=1):
                ok = cur.next()  # its next block goes first
                continue
            # Then its prefix, while each is a leaf of this table no younger than this row (the same
            # millisecond will do: a prompt's blocks share one, in the key's order), so that a prompt is
            # taken from its end in one walk, not one scan to its next leaf per block.
            while raw is not None and total > budget and (limit is None or len(holes) < limit):
                e = Entry.unpack(raw)
                parent = txn.get(key, db=self.db["parents"])
                holes.append((*e.location, self.remove(txn, key, e)))
                total -= e.footprint
                raw = None
                if parent is not None and leaves_only:
                    key = bytes(parent)
                    up = txn.get(key, db=self.db["index"])
                    if up is not None:
                        up_table, up_row = Entry.unpack(up).time_row(key)
                        same_age = up_row[: TIME.size] <= tkey[: TIME.size]
                        if up_table == table and same_age and not self.children(txn, key, limit=1):
                            raw = up
            ok = cur.set_range(tkey)  # from the row evicted on (the deletes moved the cursor)
        return total
