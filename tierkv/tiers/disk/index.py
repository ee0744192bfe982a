"""The disk tier's LMDB index: its environment, tables, format version and policy, transactions, and the
row updates that keep totals and segment counts exact. (The owners lock and what may be repaired, by
whom, are ``opening.py``'s; retention and pin rows are ``retention_rows.py``'s, segments'
``segment_rows.py``'s, tenants' ``tenant_rows.py``'s.)

Several processes share one index. Every decision that depends on it (is this key new or expired, is
this still the record that was read, is this range dead) is taken inside the write transaction that
acts on it, through ``write(fn)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from tierkv.errors import NamespaceConflictError, StoreFormatError, StoreOpenError
from tierkv.keys import BlockKey, Namespace, NamespaceDigest
from tierkv.metrics import Counters
from tierkv.priority import normal_priority
from tierkv.tiers.disk.eviction import EVICTION_ORDER, Eviction
from tierkv.tiers.disk.opening import open_store, read_only_media
from tierkv.tiers.disk.retention_rows import RetentionRows
from tierkv.tiers.disk.schema import (
    BASE_FORMAT_VERSION,
    DBS,
    READ_FORMAT_VERSIONS,
    STORE_FORMAT_VERSION,
    TOTALS,
    Entry,
    Hole,
    Policy,
    time_key,
)
from tierkv.tiers.disk.segment_rows import SegmentRows
from tierkv.tiers.disk.tenant_rows import TenantRows
from tierkv.tiers.disk.txn import TxnGate

__all__ = ["EVICTION_ORDER", "Index", "MAP_GROW_ATTEMPTS", "Txn"]

log = logging.getLogger("tierkv.disk")

MAP_GROW_ATTEMPTS = 8  # doublings of the map within one write before giving up
T = TypeVar("T")
Txn = Any  # lmdb.Transaction (py-lmdb ships no type information)


class Index(RetentionRows, SegmentRows, Eviction):
    def __init__(
        self,
        path: Path,
        *,
        map_nbytes: int,
        writer: bool,
        sync: bool,
        policy: Policy | None,
        counters: Counters,
    ) -> None:
        self.path = path
        self.sync = sync
        self.counters = counters
        self.gate = TxnGate()
        self.db: dict[str, Any] = {}
        self.tenants = TenantRows(self)
        # A reader of a store on read-only media (the store's directory or its index's) opens the index
        # read-only: LMDB takes no locks there, so open_store holds the owners lock exclusive meanwhile (no
        # other process has the store open). Everyone else read-write, a reader too (``tierkv gc`` sweeps
        # without a writer). Decided once, here.
        self.on_read_only_media = not writer and (read_only_media(path) or read_only_media(path / "index"))
        self._owners = open_store(
            path, writer, lambda: self._open_env(map_nbytes, writer), read_only=self.on_read_only_media
        )
        try:
            self.policy = self._load_policy(policy, persist=writer)
            if writer:
                self.tenants.fill()
        except BaseException:  # (a damaged policy row, say): the lock and the environment go with it
            self.close()
            raise

    # ---------------------------------------------------------------- opening

    def _open_env(self, map_nbytes: int, writer: bool) -> None:
        """Open the environment, its tables and check its format (run by ``open_store``, again to repair)."""
        self.env = lmdb.open(
            str(self.path / "index"),
            readonly=self.on_read_only_media,
            map_size=map_nbytes,
            max_dbs=16,
            subdir=True,
            sync=self.sync,
            metasync=self.sync,
            mode=0o600,
            readahead=False,  # index pages are read at random: readahead only pollutes the page cache
            max_readers=512,
            max_spare_txns=4,
        )
        try:
            db = None if writer else self._open_tables_read_only()
            if db is None and self.on_read_only_media:
                raise StoreOpenError(f"the store at {self.path} lacks tables and is on read-only media")
            if db is None:  # a writer, or a store some table of which was never created
                db = self.write(lambda txn: {n: self.env.open_db(n.encode(), txn=txn) for n in DBS})
            self.db = db
            self._check_format(writer)
        except BaseException:
            self.env.close()
            raise

    def _open_tables_read_only(self) -> dict[str, Any] | None:
        try:  # (py-lmdb keeps handles opened this way; not those opened in a read transaction of ours)
            return {n: self.env.open_db(n.encode(), create=False) for n in DBS}
        except lmdb.NotFoundError:
            return None

    def _check_format(self, writer: bool) -> None:
        with self.read() as txn:
            raw = txn.get(b"format_version", db=self.db["meta"])
        version = None if raw is None else _parse_version(raw)
        if raw is not None and version not in READ_FORMAT_VERSIONS:
            shown = bytes(raw)[:16].decode(errors="replace")
            raise StoreFormatError(
                f"{self.path} holds a tierkv store of format version {shown}; this build reads versions "
                f"{', '.join(map(str, READ_FORMAT_VERSIONS))}. Use another --cache-dir, or delete this one "
                "to start afresh."
            )
        if writer and raw is None:  # a new store: no older build has written to it
            self.write(
                lambda txn: txn.put(
                    b"format_version", str(STORE_FORMAT_VERSION).encode(), db=self.db["meta"], overwrite=False
                )
            )
        elif version == BASE_FORMAT_VERSION:
            log.info(
                "disk tier %s: format version 1 (older builds may share it): retention and pins are off "
                "until `tierkv gc --upgrade` marks it %d",
                self.path,
                STORE_FORMAT_VERSION,
            )
        elif version is not None and version < STORE_FORMAT_VERSION:
            log.info(
                "disk tier %s: format version %d (older builds may share it): records are written in the "
                "older layout until `tierkv gc --upgrade` marks it %d (restores from the page cache copy "
                "faster)",
                self.path,
                version,
                STORE_FORMAT_VERSION,
            )

    def format_version(self, txn: Txn) -> int:
        """The store's format version now (another process may have upgraded it since this one opened)."""
        raw = txn.get(b"format_version", db=self.db["meta"])
        return (_parse_version(raw) or BASE_FORMAT_VERSION) if raw is not None else BASE_FORMAT_VERSION

    def _load_policy(self, given: Policy | None, persist: bool) -> Policy:
        """The stored policy, with the fields ``given`` sets (not None) replacing it; persisted by writers.
        The pin budget has a key of its own: format-1 builds read the policy's JSON and refuse fields
        they do not know."""
        with self.read() as txn:
            raw = txn.get(b"policy", db=self.db["meta"])
            pin_raw = txn.get(b"pin_budget", db=self.db["meta"])
        known = {f.name for f in dataclasses.fields(Policy)}
        fields = {k: v for k, v in json.loads(raw).items() if k in known} if raw else {}
        if pin_raw is not None:
            fields["pin_budget_nbytes"] = int(pin_raw)
        stored = Policy(**fields)
        if given is None:
            return stored
        merged = Policy(
            *(
                g if g is not None else s
                for g, s in zip(dataclasses.astuple(given), dataclasses.astuple(stored))
            )
        )
        if persist and merged != stored:
            v1 = {k: v for k, v in dataclasses.asdict(merged).items() if k != "pin_budget_nbytes"}

            def put(txn: Txn) -> None:
                txn.put(b"policy", json.dumps(v1).encode(), db=self.db["meta"])
                if merged.pin_budget_nbytes is not None:
                    txn.put(b"pin_budget", str(merged.pin_budget_nbytes).encode(), db=self.db["meta"])

            self.write(put)
        return merged

    def close(self) -> None:
        try:
            self.env.close()
        finally:  # (the owners lock is let go whatever LMDB said: gc and readers wait on it)
            self._owners.close()

    @contextlib.contextmanager
    def sole_owner(self) -> Iterator[bool]:
        """Whether no other process has the store open; if so, none can open it while inside (this
        process's owners lock is exclusive until then)."""
        if self.on_read_only_media:  # its lock is exclusive already, and a sweep cannot write there
            raise StoreOpenError(f"the store at {self.path} is on read-only media: nothing there can change")
        alone = self._owners.try_exclusive()
        try:
            yield alone
        finally:
            if alone:
                self._owners.share()

    # ---------------------------------------------------------------- transactions

    @contextlib.contextmanager
    def read(self) -> Iterator[Txn]:
        """A read-only transaction; adopts the map size another process grew the map to."""
        for _ in range(3):
            with normal_priority(), self.gate.shared():
                try:
                    txn = self.env.begin()
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            self.resize(0)
        raise StoreOpenError(f"{self.path}: the index map keeps being resized by another process")

    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in a write transaction and commit. A full map is grown (doubled) and ``fn`` runs
        again in a fresh transaction, so ``fn`` must return what it did rather than record it elsewhere."""
        for _ in range(MAP_GROW_ATTEMPTS):
            try:
                with normal_priority(), self.gate.shared(), self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self.resize(self.env.info()["map_size"] * 2)
            except lmdb.MapResizedError:
                self.resize(0)
        raise lmdb.MapFullError(f"{self.path}: the index map is still full after {MAP_GROW_ATTEMPTS} growths")

    def clear_stale_readers(self) -> None:
        """Free reader slots of processes that died inside a read transaction: each pins an old snapshot,
        and LMDB cannot reuse any page freed since, so the index would grow without bound."""
        cleared = self.env.reader_check()
        if cleared:
            log.warning("disk tier: cleared %d reader slots left by dead processes", cleared)
            self.counters.add("disk", "stale_readers", cleared)

    def resize(self, map_nbytes: int) -> None:
        """Grow the map to ``map_nbytes`` (0: adopt the size another process set), with no transaction of
        this process open, as LMDB requires."""
        if map_nbytes:
            self.clear_stale_readers()  # often the map is "full" only of pages a dead reader pins
        with self.gate.exclusive():
            if map_nbytes:
                log.info("disk tier index full: growing its map to %d bytes", map_nbytes)
            self.env.set_mapsize(map_nbytes)

    # ---------------------------------------------------------------- row updates (inside write(fn))

    def insert(self, txn: Txn, key: bytes, e: Entry, parent: bytes | None = None) -> None:
        """Index an entry (``parent``: the key of the block before it, for ``children``)."""
        txn.put(key, e.pack(), db=self.db["index"])
        table, row = e.time_row(key)
        txn.put(row, b"", db=self.db[table])
        txn.put(time_key(e.created_s, key), b"", db=self.db["ctime"])
        if parent is not None:
            txn.put(key, parent, db=self.db["parents"])
            txn.put(parent + key, b"", db=self.db["children"])
        self.tenants.insert(txn, key, e)
        self._add_totals(txn, e.ns_digest, 1, e.footprint)
        self._add_segment(txn, e.seg_id, 1, e.footprint)
        if e.pin_until_s:
            self._add_pinned(txn, 1, e.footprint)

    def remove(self, txn: Txn, key: bytes, e: Entry) -> bool:
        """Drop an entry and its index rows; True if its segment is now empty and sealed (unlink it)."""
        txn.delete(key, db=self.db["index"])
        table, row = e.time_row(key)
        txn.delete(row, db=self.db[table])
        txn.delete(time_key(e.created_s, key), db=self.db["ctime"])
        parent = txn.get(key, db=self.db["parents"])
        if parent is not None:
            txn.delete(key, db=self.db["parents"])
            txn.delete(bytes(parent) + key, db=self.db["children"])
        self.tenants.remove(txn, key, e)  # (before the namespace's spec may go with its last block)
        self._add_totals(txn, e.ns_digest, -1, -e.footprint)
        if e.pin_until_s:
            self._add_pinned(txn, -1, -e.footprint)
        return self._add_segment(txn, e.seg_id, -1, -e.footprint)

    def replace(self, txn: Txn, key: bytes, old: Entry, new: Entry) -> None:
        """Rewrite an entry whose access time, retention or pin changed (same record, same place)."""
        table, row = old.time_row(key)
        txn.delete(row, db=self.db[table])
        table, row = new.time_row(key)
        txn.put(row, b"", db=self.db[table])
        txn.put(key, new.pack(), db=self.db["index"])
        self.tenants.replace(txn, key, old, new)
        if bool(new.pin_until_s) != bool(old.pin_until_s):
            sign = 1 if new.pin_until_s else -1
            self._add_pinned(txn, sign, sign * new.footprint)

    def _add_totals(self, txn: Txn, ns: bytes, blocks: int, nbytes: int) -> None:
        raw = txn.get(ns, db=self.db["totals"])
        b, n = TOTALS.unpack(raw) if raw else (0, 0)
        if b + blocks < 0 or n + nbytes < 0:  # an index that disagrees with itself: never below zero
            log.error(
                "disk tier totals underflow for namespace %s: %d%+d blocks, %d%+d bytes",
                ns.hex()[:16],
                b,
                blocks,
                n,
                nbytes,
            )
            self.counters.add("disk", "totals_errors")
        if b + blocks <= 0:
            txn.delete(ns, db=self.db["totals"])
            txn.delete(ns, db=self.db["namespaces"])  # its last block: the spec goes too
        else:
            txn.put(ns, TOTALS.pack(b + blocks, max(0, n + nbytes)), db=self.db["totals"])

    def put_namespace(self, txn: Txn, digest: bytes, spec: bytes) -> None:
        existing = txn.get(digest, db=self.db["namespaces"])
        if existing is not None and existing != spec:
            raise NamespaceConflictError(
                f"namespace {digest.hex()[:16]} is registered with another spec: {bytes(existing).decode()}"
            )
        if existing is None:
            txn.put(digest, spec, db=self.db["namespaces"])

    def remove_at(self, found: Sequence[tuple[bytes, tuple[int, int, int]]]) -> list[Hole]:
        """Remove each key only if the index still points at the location given (a writer may have
        replaced the record since it was found)."""

        def remove(txn: Txn) -> list[Hole]:
            holes = []
            for key, location in found:
                raw = txn.get(key, db=self.db["index"])
                if raw is not None and Entry.unpack(raw).location == location:
                    holes.append((*location, self.remove(txn, key, Entry.unpack(raw))))
            return holes

        return self.write(remove) if found else []

    # ---------------------------------------------------------------- queries

    def has_quotas(self) -> bool:
        """Whether a tenant has a disk or pin quota here (then its totals matter)."""
        with self.read() as txn:
            return any(
                q.disk_nbytes is not None or q.pin_nbytes is not None
                for q in self.tenants.quotas(txn).values()
            )

    def total_nbytes(self, txn: Txn) -> int:
        return sum(TOTALS.unpack(v)[1] for _, v in txn.cursor(db=self.db["totals"]))

    def totals(self) -> dict[NamespaceDigest, tuple[int, int]]:
        """Exact (blocks, footprint bytes) per namespace; O(namespaces), no scan."""
        with self.read() as txn:
            return {NamespaceDigest(bytes(k)): TOTALS.unpack(v) for k, v in txn.cursor(db=self.db["totals"])}

    def namespaces(self) -> dict[NamespaceDigest, Namespace]:
        with self.read() as txn:
            return {
                NamespaceDigest(bytes(k)): Namespace.from_json(bytes(v).decode())
                for k, v in txn.cursor(db=self.db["namespaces"])
            }

    def still_indexed(self, key: BlockKey, location: tuple[int, int, int]) -> bool:
        """Whether ``key`` still names the record at ``location`` (a failed read may have raced a sweep)."""
        with self.read() as txn:
            raw = txn.get(key, db=self.db["index"])
        return raw is not None and Entry.unpack(raw).location == location

    def iter_entries(self) -> Iterator[tuple[BlockKey, Entry]]:
        """Every entry, in key order, read in short transactions (safe beside a live writer, but not one
        snapshot: see ``snapshot_entries``)."""
        last: bytes | None = None
        while True:
            batch: list[tuple[BlockKey, Entry]] = []
            with self.read() as txn:
                cur = txn.cursor(db=self.db["index"])
                ok = cur.set_range(last + b"\0") if last is not None else cur.first()
                while ok and len(batch) < 4096:
                    batch.append((BlockKey(bytes(cur.key())), Entry.unpack(cur.value())))
                    ok = cur.next()
            if not batch:
                return
            yield from batch
            last = batch[-1][0]

    def snapshot_entries(self) -> list[tuple[BlockKey, Entry]]:
        """Every entry as of one instant (one read transaction: LMDB's MVCC snapshot)."""
        with self.read() as txn:
            return [(BlockKey(bytes(k)), Entry.unpack(v)) for k, v in txn.cursor(db=self.db["index"])]


def _parse_version(raw: bytes) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None
