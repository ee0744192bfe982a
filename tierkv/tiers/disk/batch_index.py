"""What of a write batch the disk tier stores: a first look before the append (what is not stored yet), and
the indexing transaction after its sync, which decides again (another process may have stored the same
prefix meanwhile, or a purge come) and indexes, replaces, or leaves each appended record unused."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.keys import NamespaceDigest, root_key
from tierkv.tiers.disk.access_times import Touch
from tierkv.tiers.disk.batch_order import by_chain
from tierkv.tiers.disk.eviction import headroom
from tierkv.tiers.disk.index import Index, Txn
from tierkv.tiers.disk.schema import Entry, Hole
from tierkv.tiers.disk.segments import aligned
from tierkv.tiers.disk.write_items import Put

__all__ = ["evicts", "fresh_records", "index_batch"]


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


def evicts(index: Index, fresh: list[Put], budget: int) -> bool:
    """Whether indexing ``fresh`` takes the store past ``budget`` (a read of the index's totals)."""
    with index.read() as txn:
        total = index.total_nbytes(txn)
    return total + sum(aligned(p.record_nbytes) for p in fresh) > budget


def index_batch(
    index: Index,
    txn: Txn,
    fresh: list[Put],
    offsets: list[int],
    seg_id: int,
    now: float,
    touched: Sequence[Touch | None] = (),
) -> tuple[list[Hole], list[Hole], int]:
    """In ``txn``: index the appended records (at ``offsets`` of segment ``seg_id``) still worth it, over the
    budget evict (this batch's blocks that no lookup from the disk reaches first, ``_evict_unreachable``).
    Returns the holes to punch after the commit (records replaced or evicted), the appended records left
    unused, and how many were evicted. ``touched``: per record, its hits not written yet (``AccessTimes``):
    a block's access time is when it was queued or hit since, whichever is later."""
    policy = index.policy
    budget = policy.budget_nbytes
    holes: list[Hole] = []
    unused: list[Hole] = []  # appended, but another writer stored the key first
    # Room for records that must not evict, taken in this transaction: another process's writes since any
    # earlier look count.
    room = None if budget is None else budget - index.total_nbytes(txn)
    idx = index.db["index"]
    indexed: dict[bytes, Put] = {}  # in this transaction, in order
    for j, (p, off) in enumerate(zip(fresh, offsets)):
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
        if room is not None:
            if not p.evict and aligned(p.record_nbytes) > room:
                unused.append((seg_id, off, p.record_nbytes, False))
                continue
            room -= aligned(p.record_nbytes)
        indexed[p.key] = p
        if p.ns_spec is not None:
            index.put_namespace(txn, p.ns_digest, p.ns_spec)
        access_s = now if p.access_s is None else min(p.access_s, now)
        if j < len(touched) and (hit := touched[j]) is not None:
            access_s = min(max(access_s, hit.t), now)
        if policy.ttl_s is not None and now - access_s > policy.ttl_s:
            access_s = now  # queued longer than the TTL (a stalled disk): not indexed already expired
        index.insert(
            txn, p.key, Entry(p.ns_digest, seg_id, off, p.record_nbytes, p.created_s, access_s), p.parent
        )
    if budget is None:
        return holes, unused, 0
    evicted = _evict_unreachable(index, txn, list(indexed.values()), budget)
    evicted += index.evict_over(txn, budget, now, headroom_nbytes=headroom(budget))
    return holes + evicted, unused, len(evicted)


def _evict_unreachable(index: Index, txn: Txn, batch: list[Put], budget: int) -> list[Hole]:
    """Over ``budget``, this batch's blocks whose prefix is not all on disk go first, each chain from its
    end.

    A save larger than what the budget leaves comes in several batches: the first one's eviction takes its
    own last blocks (leaves first, ``eviction.py``), and the next batch's prefix on disk then ends before
    it. Indexed like any other, such a block is reached only while its prefix is in a memory tier or an
    engine's own cache; to the budget's next eviction, by the oldest leaf, it was younger than the prefix,
    whose end went instead, until none of the prompt hit. Where there is room they stay (a restore from
    ``start_block``, or a prefix held in the host tier, still reaches them)."""
    total = index.total_nbytes(txn)
    if total <= budget or not batch:
        return []
    idx, parents = index.db["index"], index.db["parents"]
    in_batch = {p.key: p.parent for p in batch}
    roots = {root_key(NamespaceDigest(d)) for d in {p.ns_digest for p in batch}}
    reachable: dict[bytes, bool] = dict.fromkeys(roots, True)

    def reaches(key: bytes) -> bool:
        """Whether every block from ``key`` up to its chain's root is stored (each asked once a batch)."""
        path: list[bytes] = []
        got: bool | None = None
        while got is None:
            if key in reachable:
                got = reachable[key]
                break
            path.append(key)
            if key in in_batch:
                up = in_batch[key]
            elif txn.get(key, db=idx) is None:
                got = False
                break
            else:
                raw = txn.get(key, db=parents)
                up = bytes(raw) if raw is not None else None
            if up is None:  # no parent recorded (an older format's block): taken as reached
                got = True
                break
            key = up
        for k in path:
            reachable[k] = got
        return got

    depths: dict[bytes, int] = {}

    def depth(key: bytes) -> int:  # how far into the batch's own blocks: a chain's end is the deepest
        path: list[bytes] = []
        while key in in_batch and key not in depths:
            path.append(key)
            key = in_batch[key] or b""
        n = depths.get(key, -1)
        for k in reversed(path):
            n += 1
            depths[k] = n
        return depths[path[0]] if path else n

    unreachable = sorted((p.key for p in batch if not reaches(p.key)), key=depth, reverse=True)
    holes: list[Hole] = []
    for key in unreachable:
        if total <= budget:
            break
        raw = txn.get(key, db=idx)
        if raw is None:
            continue
        e = Entry.unpack(raw)
        holes.append((*e.location, index.remove(txn, key, e)))
        total -= e.footprint
    return holes
