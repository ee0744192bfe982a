"""The disk tier's write side (``DiskTier`` inherits it): what a save queues for the writer thread
(``writer.py``) and whether the tier wants a block at all, access times and retention written behind,
purges of records that failed verification, invalidations fenced in one write transaction, and flush.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb

from tierkv.keys import BlockChain, BlockKey, Namespace, NamespaceDigest
from tierkv.layout import KVSpec
from tierkv.metrics import Counters
from tierkv.retention import Retention
from tierkv.tiers.base import BlockWrite
from tierkv.tiers.disk.access_times import AccessTimes
from tierkv.tiers.disk.index import Index, Txn
from tierkv.tiers.disk.schema import Entry, Hole, Policy
from tierkv.tiers.disk.segments import SegmentDir
from tierkv.tiers.disk.writer import FLUSH_TIMEOUT_S, Purge, Put, Record, Writer
from tierkv.units import format_size

log = logging.getLogger("tierkv.disk")

__all__ = ["DiskWrites"]


class DiskWrites:
    # ``DiskTier``'s state, used here
    path: Path
    clock: Callable[[], float]
    counters: Counters
    read_only: bool
    record_version: int
    index: Index
    segments: SegmentDir
    times: AccessTimes
    writer: Writer | None
    _closed: bool
    _said_too_small = False  # a budget below one block said (once a store)

    @property
    def policy(self) -> Policy:
        raise NotImplementedError

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        raise NotImplementedError

    def _accepting(self) -> bool:
        return not self.read_only and not self._closed and self.writer is not None and self.writer.accepting

    writes_back = True  # a block its queue has no room for may wait in the host tier (write_behind.py)

    def needs(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        if self.read_only:
            return [False] * len(idx)
        wanted = [not h for h in self.holds([chain.keys[i] for i in idx])]
        budget = self.policy.budget_nbytes
        if any(wanted) and budget is not None and KVSpec.of(chain.ns).block_nbytes > budget:
            # It could never stay: counted as dropped (flush says so), and said once (a store of the Python
            # API has no start-up check: the server's, startup.py, knows the model only there)
            if not self._said_too_small:
                self._said_too_small = True
                log.warning(
                    "disk tier: its budget (%s) is smaller than one block of %s's KV (%s): nothing of it is kept "
                    "on disk (raise disk_bytes)",
                    format_size(budget),
                    chain.ns.model_id,
                    format_size(KVSpec.of(chain.ns).block_nbytes),
                )
            self.counters.add("disk", "dropped_saves", sum(wanted))
            return [False] * len(idx)
        if any(wanted) and not (self._accepting() or self.writer is not None and self.writer.healthy):
            # Degraded (a full disk) or the writer gone: counted as dropped now, not copied to be dropped.
            # A full queue is not a drop: the write-behind keeps the block dirty in the host tier.
            self.counters.add("disk", "dropped_saves", sum(wanted))
            return [False] * len(idx)
        return wanted

    def has_room(self, nbytes: int) -> bool:
        """Whether the writer's queue takes a record of ``nbytes`` now."""
        return (
            not self.read_only and not self._closed and self.writer is not None and self.writer.room(nbytes)
        )

    def on_room(self, refill: Callable[[], object]) -> None:
        """``refill`` runs on the writer thread after each batch while its queue has room."""
        if self.writer is not None:
            self.writer.on_room = refill

    def write(self, block: BlockWrite) -> bool:
        return bool(self.try_write(block, full_ok=False))

    def try_write(self, block: BlockWrite, full_ok: bool = True) -> bool | None:
        """``write``; with ``full_ok``, None (nothing counted, nothing released) when the queue is full."""
        if self.writer is None or self._closed:
            raise RuntimeError("this DiskTier was opened without a writer")
        item = Put(
            block.ns.digest,
            bytes(block.key),
            functools.partial(block.unsealed, self.record_version),
            block.nbytes,
            block.created_s,
            block.release,
            block.ns.spec_bytes,
            block.live,
            # when it was used (saved, or hit and written back), not when the writer indexes it, up to a
            # batch or a full queue later: a prompt hit meanwhile is the more recent one
            access_s=self.clock(),
            parent=bytes(block.parent),
        )
        return self.writer.put(item, full_ok=full_ok)

    def extend_retention(self, chain: BlockChain, count: int, retention: Retention) -> None:
        """Blocks ``0..count-1`` of ``chain`` were used with ``retention``: their own retention and pin
        are extended, never shortened (written behind like access times; a block still on its way gets
        them once indexed). Pins are checked against the budget by ``check_pin`` first; one that no
        longer fits when written is not taken (counted as ``pins_refused``)."""
        if self.read_only or self._closed or not (retention.ttl_s or retention.pin_s):
            return
        now = self.clock()
        pin_until_s = now + retention.pin_s if retention.pin_s else 0.0
        self.times.touch(chain.keys[:count], now, retention.ttl_s, pin_until_s)

    def served_above(self, chain: BlockChain, idx: Sequence[int]) -> list[int]:
        """A hit in memory refreshes the disk copy's TTL; a block whose disk copy is gone (expired,
        evicted, its save dropped) is wanted again, so a restart does not lose it."""
        if self.read_only or not idx:
            return []
        keys = [chain.keys[i] for i in idx]
        self.touch(keys)
        if not self._accepting():
            return []
        return [i for i, held in zip(idx, self.holds(keys)) if not held]

    def touch(self, keys: Sequence[BlockKey], nbytes: int = 0) -> None:
        """Record hits: refreshes the sliding TTL (written in batches by the writer thread)."""
        self.times.touch(keys, self.clock())
        if nbytes:
            self.counters.add("disk", "bytes_read", nbytes)

    def put(
        self,
        ns_digest: NamespaceDigest,
        key: BlockKey,
        record: bytes | Callable[[], Record],
        nbytes: int,
        created_s: float,
        release: Callable[[], None] | None = None,
        ns_spec: bytes | None = None,
        live: Callable[[], bool] | None = None,
    ) -> bool:
        """Queue one record (its bytes, or a function the writer thread calls to encode it).

        ``release`` runs on the writer thread once the record is written or skipped. Returns False (and
        counts a dropped save) when the queue is full, the tier is degraded or its writer is gone; then
        nothing runs and the caller still owns what ``release`` would have freed. ``ns_spec`` (the
        namespace's JSON) is recorded with the namespace's first block, for stats. Once ``live()`` is
        False the record is dropped, not indexed (checked in the transaction that would index it).
        """
        if self.writer is None or self._closed:
            raise RuntimeError("this DiskTier was opened without a writer")
        if (
            not callable(record)
            and len(record) >= 6
            and (v := int.from_bytes(record[4:6], "little")) > (self.record_version)
        ):  # older builds may share a store that takes version 1
            raise ValueError(f"a record of version {v} for a store that takes version {self.record_version}")
        make: Callable[[], Record] = record if callable(record) else functools.partial(list, (record,))
        return bool(
            self.writer.put(Put(ns_digest, bytes(key), make, nbytes, created_s, release, ns_spec, live))
        )

    def purge(self, key: BlockKey, location: tuple[int, int, int]) -> None:
        """Remove a record that failed verification, if the index still points at what was read."""
        self.counters.add("disk", "corrupt_blocks")
        self._purge(key, location)

    def _purge(self, key: BlockKey, location: tuple[int, int, int]) -> None:
        if self.writer is None or self._closed or not self.writer.purge(Purge(bytes(key), location)):
            self.segments.release(self.index.remove_at([(bytes(key), location)]))

    def invalidate(self, ns: NamespaceDigest, keys: Sequence[BlockKey]) -> list[bool]:
        """Remove these keys' records now, in one write transaction on the caller's thread: a record the
        writer committed before it is removed (LMDB serialises write transactions), and the writer refuses
        any later commit of a save from before the fence (its liveness is checked in that transaction).
        Per key: indexed, or a save of it was queued."""
        if self.read_only or self._closed:
            return [False] * len(keys)
        pending = self.writer.pending(keys) if self.writer is not None else [False] * len(keys)

        def remove(txn: Txn) -> tuple[list[Hole], list[bool]]:
            holes: list[Hole] = []
            held: list[bool] = []
            for key in keys:
                raw = txn.get(key, db=self.index.db["index"])
                held.append(raw is not None)
                if raw is not None:
                    e = Entry.unpack(raw)
                    holes.append((*e.location, self.index.remove(txn, key, e)))
            return holes, held

        holes, held = self.index.write(remove)
        self.segments.release(holes)
        return [h or p for h, p in zip(held, pending)]

    def register_namespace(self, ns: Namespace) -> None:
        """Record a namespace's spec (for stats). Saves do this themselves, in the transaction that indexes
        a namespace's first block; the row goes with its last block, so hostile salts cannot grow it."""
        spec = ns.spec_bytes
        with self.index.read() as txn:
            if txn.get(ns.digest, db=self.index.db["namespaces"]) == spec:
                return  # no write transaction (and no wait for LMDB's write lock) when nothing changes
        self.index.write(lambda txn: self.index.put_namespace(txn, ns.digest, spec))

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued record is durable (or dropped) and access times are written; never for
        ever (False after ``timeout_s``)."""
        if self.writer is not None:
            return self.writer.flush(timeout_s)
        try:
            self.times.flush()
        except (OSError, lmdb.Error) as exc:
            log.warning("disk tier flush: access times not written: %s", exc)
            return False
        return True
