"""What of a write batch the disk tier stores: a first look before the append (what is not stored yet), and
the indexing transaction after its sync, which decides again (another process may have stored the same
prefix meanwhile, or a purge come) and indexes, replaces, or leaves each appended record unused."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tierkv.tiers.disk.batch_order import by_chain
from tierkv.tiers.disk.eviction import headroom
from tierkv.tiers.disk.index import Index, Txn
from tierkv.tiers.disk.schema import Entry, Hole
from tierkv.tiers.disk.segments import aligned
from tierkv.tiers.disk.write_items import Put

__all__ = ["CUT_MEMORY_KEYS", "CUT_MEMORY_S", "CutKeys", "Indexed", "fresh_records", "index_batch"]

# How long, and how many, of the blocks its budget cut from a save the writer remembers: the rest of that
# save comes in the batches that follow (seconds behind, even with a long queue).
CUT_MEMORY_S = 60.0
CUT_MEMORY_KEYS = 1 << 14


class CutKeys:
    """Blocks the writer's budget just cut from a save: evicted from their own batch, or not indexed since
    their prefix was cut. A save larger than what the budget leaves arrives in several batches; the first
    one's eviction takes its last blocks (leaves first, ``eviction.py``), and without this the next batch,
    whose prefix on disk now ends before it, was indexed for nothing: no lookup reaches it, and the
    budget's next eviction, oldest leaves first, then took the reachable prefix's end instead (a prompt
    larger than the budget kept none of its blocks reachable). Written by the writer thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._at: dict[bytes, float] = {}  # key -> when cut, oldest first

    def __contains__(self, key: object) -> bool:
        t = self._at.get(key) if isinstance(key, bytes) else None
        return t is not None and self.clock() - t <= CUT_MEMORY_S

    def add(self, keys: list[bytes]) -> None:
        now = self.clock()
        for key in keys:
            self._at.pop(key, None)  # to the young end
            self._at[key] = now
        while self._at:
            key, t = next(iter(self._at.items()))
            if now - t <= CUT_MEMORY_S and len(self._at) <= CUT_MEMORY_KEYS:
                break
            del self._at[key]


@dataclasses.dataclass
class Indexed:
    """What a batch's indexing did: the holes to punch after its commit (records replaced or evicted), the
    appended records left unused, how many blocks the budget took (evicted, or cut on arrival), and the
    keys this batch's budget cut (``CutKeys``)."""

    holes: list[Hole]
    unused: list[Hole]
    evicted: int
    cut: list[bytes]


def fresh_records(index: Index, puts: list[Put], now: float) -> list[Put]:
    """The puts to append, their records made, each prompt's together: live, not stored (or expired), one
    per key, each fitting the budget. A first look outside the write transaction: it only saves encoding
    and appending what is already stored; ``index_batch`` decides again."""
    policy = index.policy
    fresh: list[Put] = []
    seen: set[bytes] = set()
    with index.read() as txn:
        for p in puts:
            if p.key in seen or not p.is_live():  # dead first: a live save of its key may follow
                continue
            seen.add(p.key)
            raw = txn.get(p.key, db=index.db["index"])
            if raw is None or policy.expired(Entry.unpack(raw), now):
                fresh.append(p)
    fresh = by_chain(fresh)  # each prompt's blocks of the batch together
    for p in fresh:
        p.record = p.make_record()
    budget = policy.budget_nbytes
    if budget is not None:
        fresh = [p for p in fresh if aligned(p.record_nbytes) <= budget]
    return fresh


def index_batch(
    index: Index,
    txn: Txn,
    fresh: list[Put],
    offsets: list[int],
    seg_id: int,
    now: float,
    cut_before: CutKeys | frozenset[bytes] = frozenset(),
) -> Indexed:
    """In ``txn``: index the appended records (at ``offsets`` of segment ``seg_id``) still worth it, over the
    budget evict. A block whose prefix the budget cut from an earlier batch (``cut_before``) or this one is
    not indexed: no lookup would reach it. ``index.write`` may run this twice: it changes nothing outside
    ``txn``, and the caller records ``cut`` once committed."""
    policy = index.policy
    budget = policy.budget_nbytes
    holes: list[Hole] = []
    unused: list[Hole] = []  # appended, but another writer stored the key first
    # Room for records that must not evict, taken in this transaction: another process's writes since any
    # earlier look count.
    room = None if budget is None else budget - index.total_nbytes(txn)
    idx = index.db["index"]
    indexed: set[bytes] = set()  # in this transaction
    cut: set[bytes] = set()  # in this transaction
    for p, off in zip(fresh, offsets):
        if not p.is_live():
            # Purged or invalidated since the first look. Checked in the transaction: one that purges after
            # this commit sees the record (LMDB serialises write transactions), and every later one here
            # sees the purge.
            unused.append((seg_id, off, p.record_nbytes, False))
            continue
        raw = txn.get(p.key, db=idx)
        if raw is not None:
            old = Entry.unpack(raw)
            if not policy.expired(old, now):
                unused.append((seg_id, off, p.record_nbytes, False))
                continue
            holes.append((*old.location, index.remove(txn, p.key, old)))  # replaced, atomically
            if room is not None:
                room += old.footprint
        if p.after is not None and p.after not in indexed and txn.get(p.after, db=idx) is None:
            unused.append((seg_id, off, p.record_nbytes, False))  # its prefix did not fit
            continue
        if (
            p.parent is not None
            and p.parent not in indexed
            and (p.parent in cut or p.parent in cut_before)
            and txn.get(p.parent, db=idx) is None
        ):
            unused.append((seg_id, off, p.record_nbytes, False))  # its prefix was cut for the budget
            cut.add(p.key)
            continue
        if room is not None:
            if not p.evict and aligned(p.record_nbytes) > room:
                unused.append((seg_id, off, p.record_nbytes, False))
                continue
            room -= aligned(p.record_nbytes)
        indexed.add(p.key)
        if p.ns_spec is not None:
            index.put_namespace(txn, p.ns_digest, p.ns_spec)
        access_s = now if p.access_s is None else min(p.access_s, now)
        index.insert(
            txn, p.key, Entry(p.ns_digest, seg_id, off, p.record_nbytes, p.created_s, access_s), p.parent
        )
    if budget is None:
        return Indexed(holes, unused, len(cut), list(cut))
    evicted = index.evict_over(txn, budget, now, headroom_nbytes=headroom(budget))
    skipped = len(cut)  # the budget took them on arrival: counted as evicted
    if evicted:  # this batch's own blocks it took: what follows them in the save is cut too
        cut.update(k for k in indexed if txn.get(k, db=idx) is None)
    return Indexed(holes + evicted, unused, len(evicted) + skipped, list(cut))
