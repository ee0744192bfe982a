"""The durable disk tier: an LMDB index over append-only segment files.

LMDB environment ``<dir>/index`` (named databases):

    index       key -> Entry (namespace, segment, offset, nbytes, created_s, last_access_s)
    atime       last_access_ms(8, big-endian) || key -> ""   (LRU eviction and sliding-TTL sweeps)
    ctime       created_ms || key -> ""                      (max-age sweeps)
    segments    seg_id(4) -> SegmentRow (live bytes and records, owner pid, sealed)
    totals      namespace digest -> (blocks, nbytes)         (exact, updated in the same transactions)
    namespaces  namespace digest -> spec JSON
    meta        format version, segment counter, the store's TTL / max-age / budget policy

Records live in ``<dir>/segments`` (see ``segments.py``). A batch is appended and fdatasync'ed first,
then indexed in one LMDB transaction, so after a crash every indexed record is complete; bytes a crash
left unindexed are never referenced and are released by ``gc --compact``.

One writer thread per process does all writes (a write transaction belongs to its thread); readers use
short read-only transactions. Other processes (``tierkv gc``) open the same environment: LMDB's lock
serialises their writers, and sweeps use small transactions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from tierkv.errors import NamespaceConflictError, StoreFormatError
from tierkv.keys import BlockKey, Namespace, NamespaceDigest
from tierkv.metrics import Counters
from tierkv.tiers.segments import SegmentDir, SegmentWriter, aligned

log = logging.getLogger("tierkv.disk")

STORE_FORMAT_VERSION = 1
_ENTRY = struct.Struct("<32sIQIdd")  # ns digest, seg_id, offset, nbytes, created_s, last_access_s
_SEGMENT = struct.Struct("<QIIB")  # live_nbytes, live_records, owner_pid, sealed
_TOTALS = struct.Struct("<QQ")  # blocks, nbytes (footprint: page-aligned record bytes)
_TIME = struct.Struct(">Q")  # milliseconds, big-endian so LMDB's byte order is time order
_SEG_ID = struct.Struct(">I")

DEFAULT_MAP_NBYTES = 1 << 30  # the index only (about 200 B per block); a sparse file, grown on MapFullError
DEFAULT_SEGMENT_NBYTES = 1 << 30  # roll to a new file past this; a fully dead file is unlinked
DEFAULT_BATCH_NBYTES = 64 << 20  # one fdatasync + one commit per batch: amortises the sync cost
DEFAULT_QUEUE_NBYTES = 1 << 30  # write-behind bound; past it saves are dropped (a future miss only)
TOUCH_FLUSH_INTERVAL_S = 1.0  # access times are coalesced in memory and written at most this often
DEGRADED_RETRY_S = 5.0  # after a write error (full disk) the tier drops writes this long, then retries
WRITER_NICE = 19  # where SCHED_IDLE is refused: the lowest priority
SWEEP_BATCH = 256  # deletions per transaction in sweeps: a server's writer is never starved


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
        return cls(*_ENTRY.unpack(raw))

    def pack(self) -> bytes:
        return _ENTRY.pack(self.ns_digest, self.seg_id, self.offset, self.nbytes, self.created_s,
                           self.last_access_s)

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


def _time_key(t: float, key: bytes) -> bytes:
    return _TIME.pack(max(0, int(t * 1000))) + key


Record = list  # of buffers (bytes or memoryviews) written back to back: see codec.encode_parts


@dataclasses.dataclass(slots=True)
class _Put:
    ns_digest: bytes
    key: bytes
    make_record: Callable[[], Record]  # called on the writer thread
    nbytes: int  # estimate, for the queue's bound
    created_s: float
    release: Callable[[], None] | None  # called once the record is written or skipped
    record: Record = dataclasses.field(default_factory=list)

    @property
    def record_nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.record)


@dataclasses.dataclass(slots=True)
class _Purge:
    key: bytes
    location: tuple[int, int, int]  # purge only if the index still points here (not a concurrent rewrite)


class DiskTier:
    """Durable, content-addressed block store. Thread-safe; one instance per process and directory."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        writer: bool = True,
        sync: bool = True,
        queue_nbytes: int = DEFAULT_QUEUE_NBYTES,
        batch_nbytes: int = DEFAULT_BATCH_NBYTES,
        segment_nbytes: int = DEFAULT_SEGMENT_NBYTES,
        map_nbytes: int = DEFAULT_MAP_NBYTES,
        read_threads: int = 4,
        counters: Counters | None = None,
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        self.sync = sync
        self.counters = counters or Counters()
        _make_private_dir(self.path)
        try:
            self._open_env(map_nbytes)
        except lmdb.Error as exc:
            # A store LMDB cannot open at all (damaged meta pages, a truncated file): keep it for a
            # post-mortem, start empty. Never a crash loop.
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
            log.error("cannot open the store at %s (%s): moved aside to %s, starting an empty store",
                      self.path, exc, aside)
            self.path.rename(aside)
            _make_private_dir(self.path)
            self._open_env(map_nbytes)
        self.policy = self._load_policy(policy, persist=writer)
        self.segments = SegmentDir(self.path / "segments", read_threads=read_threads)
        self._read_lock = threading.Lock()  # guards the segment dir's reused read buffer
        self._touched: dict[bytes, float] = {}
        self._touched_lock = threading.Lock()
        self._writer_seg: SegmentWriter | None = None
        self._pending_unlink: list[int] = []  # segments emptied in a transaction, unlinked after commit
        self.segment_nbytes = segment_nbytes
        self.batch_nbytes = batch_nbytes
        self.queue_nbytes = queue_nbytes
        self._queued_nbytes = 0
        self._queued_lock = threading.Lock()
        self._queue: queue.Queue[_Put | _Purge | None] = queue.Queue()
        self._degraded_until = 0.0
        self._degraded = False  # in a failure episode (logged once)
        self._closed = False
        self._thread: threading.Thread | None = None
        if writer:
            self._seal_dead_writers()
            self._thread = threading.Thread(target=self._writer_loop, name="tierkv-disk-writer", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- opening

    def _open_env(self, map_nbytes: int) -> None:
        self._env = lmdb.open(
            str(self.path / "index"), map_size=map_nbytes, max_dbs=8, subdir=True,
            sync=self.sync, metasync=self.sync, mode=0o600,
            readahead=False,  # index pages are read at random: readahead only pollutes the page cache
            max_readers=512, max_spare_txns=4,
        )
        try:
            self._db = {name: self._env.open_db(name.encode()) for name in
                        ("index", "atime", "ctime", "segments", "totals", "namespaces", "meta")}
            self._check_format()
        except BaseException:
            self._env.close()
            raise

    def _check_format(self) -> None:
        with self._env.begin(write=True) as txn:
            raw = txn.get(b"format_version", db=self._db["meta"])
            if raw is None:
                txn.put(b"format_version", str(STORE_FORMAT_VERSION).encode(), db=self._db["meta"])
            elif int(raw) != STORE_FORMAT_VERSION:
                raise StoreFormatError(
                    f"{self.path} holds a tierkv store of format version {int(raw)}; this build reads version "
                    f"{STORE_FORMAT_VERSION}. Use another --cache-dir, or delete this one to start afresh.")

    def _load_policy(self, given: Policy | None, persist: bool) -> Policy:
        """The stored policy, with the fields ``given`` sets (not None) replacing it; persisted by writers."""
        with self._env.begin(write=persist) as txn:
            raw = txn.get(b"policy", db=self._db["meta"])
            stored = Policy(**json.loads(raw)) if raw else Policy()
            if given is None:
                return stored
            merged = Policy(*(g if g is not None else s for g, s in
                              zip(dataclasses.astuple(given), dataclasses.astuple(stored))))
            if persist and merged != stored:
                txn.put(b"policy", json.dumps(dataclasses.asdict(merged)).encode(), db=self._db["meta"])
            return merged

    def _seal_dead_writers(self) -> None:
        """Segments left open by a writer that died are sealed, so they can be freed once empty."""
        with self._env.begin(write=True) as txn:
            cur = txn.cursor(db=self._db["segments"])
            for k, v in list(cur):
                live_nbytes, live_records, pid, sealed = _SEGMENT.unpack(v)
                if not sealed and not _pid_alive(pid):
                    txn.put(k, _SEGMENT.pack(live_nbytes, live_records, pid, 1), db=self._db["segments"])

    def register_namespace(self, ns: Namespace) -> None:
        spec = ns.to_json().encode()
        with self._env.begin(db=self._db["namespaces"]) as txn:
            if txn.get(ns.digest) == spec:
                return
        with self._write_txn() as txn:
            existing = txn.get(ns.digest, db=self._db["namespaces"])
            if existing is not None and existing != spec:
                raise NamespaceConflictError(
                    f"namespace {ns.digest.hex()[:16]} is registered with another spec: {existing.decode()}")
            txn.put(ns.digest, spec, db=self._db["namespaces"])

    def namespaces(self) -> dict[NamespaceDigest, Namespace]:
        with self._env.begin(db=self._db["namespaces"]) as txn:
            return {NamespaceDigest(bytes(k)): Namespace.from_json(bytes(v).decode()) for k, v in txn.cursor()}

    @contextlib.contextmanager
    def _write_txn(self) -> Iterator[lmdb.Transaction]:
        """A write transaction that grows the map once when it is full, then retries."""
        for attempt in range(8):
            try:
                with self._env.begin(write=True) as txn:
                    yield txn
                return
            except lmdb.MapFullError:
                if attempt == 7:
                    raise
                new = self._env.info()["map_size"] * 2
                log.info("disk tier index full: growing map to %d bytes", new)
                self._env.set_mapsize(new)
            except lmdb.MapResizedError:
                self._env.set_mapsize(0)  # another process grew it: adopt its size

    # ---------------------------------------------------------------- reads

    def _expired(self, e: Entry, now: float) -> bool:
        p = self.policy
        if p.ttl_s is not None and now - e.last_access_s > p.ttl_s:
            return True
        return p.max_age_s is not None and now - e.created_s > p.max_age_s

    def locate(self, keys: Sequence[BlockKey]) -> list[Entry]:
        """Entries of the leading ``keys`` the tier holds, unexpired (the index only: no payload read)."""
        now = self.clock()
        out: list[Entry] = []
        with self._env.begin(db=self._db["index"]) as txn:
            for key in keys:
                raw = txn.get(key)
                if raw is None:
                    break
                e = Entry.unpack(raw)
                with self._touched_lock:
                    e.last_access_s = max(e.last_access_s, self._touched.get(key, 0.0))
                if self._expired(e, now):
                    self.counters.add("disk", "expirations")
                    break
                out.append(e)
        return out

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the tier holds, unexpired."""
        return len(self.locate(keys))

    @contextlib.contextmanager
    def read(self, entries: Sequence[Entry]) -> Iterator[list[memoryview]]:
        """The whole records of ``entries``, as views valid inside the ``with`` block only."""
        with self._read_lock:
            yield self.segments.read([e.location for e in entries]) if entries else []

    def read_into(self, requests: Sequence[tuple[Entry, list[memoryview]]],
                  verify: Callable[[int], bool] | None = None) -> list[bool]:
        """Scatter each record into its destination views; ``verify(i)`` runs on the reading thread."""
        return self.segments.readv([(*e.location, views) for e, views in requests], verify)

    def touch(self, keys: Sequence[BlockKey], nbytes: int) -> None:
        """Record hits: refreshes the sliding TTL (written in batches by the writer thread)."""
        now = self.clock()
        with self._touched_lock:
            for key in keys:
                self._touched[bytes(key)] = now
        self.counters.add("disk", "bytes_read", nbytes)

    # ---------------------------------------------------------------- writes

    def put(self, ns_digest: NamespaceDigest, key: BlockKey, record: bytes | Callable[[], Record],
            nbytes: int, created_s: float, release: Callable[[], None] | None = None) -> bool:
        """Queue one record (its bytes, or a function the writer thread calls to encode it).

        ``release`` runs on the writer thread once the record is written or skipped. Returns False (and
        counts a dropped save) when the queue is full or the tier is degraded; then nothing runs and the
        caller still owns what ``release`` would have freed.
        """
        if self._thread is None or self._closed:
            raise RuntimeError("this DiskTier was opened without a writer")
        with self._queued_lock:
            if self.clock() < self._degraded_until or self._queued_nbytes + nbytes > self.queue_nbytes:
                self.counters.add("disk", "dropped_saves")
                return False
            self._queued_nbytes += nbytes
        make = record if callable(record) else (lambda r=record: [r])
        self._queue.put(_Put(ns_digest, key, make, nbytes, created_s, release))
        return True

    def purge(self, key: BlockKey, location: tuple[int, int, int]) -> None:
        """Remove a record that failed verification, if the index still points at what was read."""
        self.counters.add("disk", "corrupt_blocks")
        if self._thread is not None and not self._closed:
            self._queue.put(_Purge(key, location))
        else:
            self._apply_purges([_Purge(key, location)])

    def flush(self) -> None:
        """Block until every queued record is durable (or dropped) and access times are written."""
        if self._thread is not None:
            self._queue.join()
        self._flush_touched()

    def _writer_loop(self) -> None:
        # Background persistence must not slow the model down. On Linux, scheduling settings made with the
        # thread's id apply to this thread only: SCHED_IDLE runs it only on otherwise idle CPU (measured: a
        # server with no cache hits was 9 to 16% slower than with the cache off at nice 0 or 10, on 2 cores).
        # Under constant load the queue then fills and saves are dropped and counted: a future miss only.
        tid = threading.get_native_id()
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
        while True:
            try:
                item = self._queue.get(timeout=TOUCH_FLUSH_INTERVAL_S)
            except queue.Empty:
                try:
                    self._flush_touched()
                except (OSError, lmdb.Error) as exc:
                    self._degrade(exc, 0)
                continue
            if item is None:
                self._queue.task_done()
                return
            items = [item]
            nbytes = item.nbytes if isinstance(item, _Put) else 0
            while nbytes < self.batch_nbytes:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # handled on the next turn, after this batch
                    self._queue.task_done()
                    break
                items.append(nxt)
                nbytes += nxt.nbytes if isinstance(nxt, _Put) else 0
            try:
                self._write_batch([i for i in items if isinstance(i, _Put)])
                self._apply_purges([i for i in items if isinstance(i, _Purge)])
                self._flush_touched()
            except (OSError, lmdb.Error) as exc:  # purges or access times on a full disk: retried later
                self._degrade(exc, 0)
            except Exception:  # the writer must survive anything: a lost batch is only future misses
                log.exception("disk tier writer: batch of %d items failed", len(items))
                self.counters.add("disk", "write_errors")
            finally:
                for _ in items:
                    self._queue.task_done()

    def _segment_for(self, incoming_nbytes: int) -> SegmentWriter:
        seg = self._writer_seg
        if seg is not None and seg.end + incoming_nbytes <= self.segment_nbytes:
            return seg
        with self._write_txn() as txn:
            if seg is not None:
                self._set_segment(txn, seg.seg_id, sealed=True)
            raw = txn.get(b"next_segment", db=self._db["meta"])
            seg_id = int(raw) if raw else 1
            txn.put(b"next_segment", str(seg_id + 1).encode(), db=self._db["meta"])
            txn.put(_SEG_ID.pack(seg_id), _SEGMENT.pack(0, 0, os.getpid(), 0), db=self._db["segments"])
        if seg is not None:
            seg.close()
        self._writer_seg = SegmentWriter(self.segments.file(seg_id), seg_id, sync=self.sync)
        return self._writer_seg

    def _write_batch(self, puts: list[_Put]) -> None:
        if not puts:
            return
        with self._queued_lock:
            self._queued_nbytes -= sum(p.nbytes for p in puts)
        degraded = self.clock() < self._degraded_until
        if degraded:
            self.counters.add("disk", "dropped_saves", len(puts))
        try:
            self._write_fresh(puts, degraded)
        finally:
            for p in puts:
                if p.release is not None:
                    p.release()

    def _write_fresh(self, puts: list[_Put], degraded: bool) -> None:
        # Skip what is already stored (another request saved the same prefix) and duplicates in the batch.
        fresh = []
        with self._env.begin(db=self._db["index"]) as txn:
            seen: set[bytes] = set()
            for p in puts:
                if not degraded and p.key not in seen and txn.get(p.key) is None:
                    p.record = p.make_record()
                    fresh.append(p)
                seen.add(p.key)
        budget = self.policy.budget_nbytes
        if budget is not None:
            fresh = [p for p in fresh if aligned(p.record_nbytes) <= budget]
        if not fresh:
            return
        incoming = sum(aligned(p.record_nbytes) for p in fresh)
        try:
            seg = self._segment_for(incoming)
            offsets = seg.append([p.record for p in fresh])
        except (OSError, lmdb.Error) as exc:
            self._degrade(exc, len(fresh))
            return
        holes: list[tuple[int, int, int]] = []
        try:
            with self._write_txn() as txn:
                if budget is not None:
                    holes += self._evict_for(txn, incoming, budget)
                now = self.clock()
                for p, off in zip(fresh, offsets):
                    e = Entry(p.ns_digest, seg.seg_id, off, p.record_nbytes, p.created_s, now)
                    self._insert(txn, p.key, e)
        except lmdb.Error as exc:  # e.g. the index's file system is full: the appended bytes are orphans
            self._degrade(exc, len(fresh))
            self.segments.punch([(seg.seg_id, off, p.record_nbytes) for p, off in zip(fresh, offsets)])
            return
        if self._degraded:
            self._degraded = False
            log.warning("disk tier writes resumed")
        self.counters.add("disk", "blocks_written", len(fresh))
        self.counters.add("disk", "bytes_written", sum(p.record_nbytes for p in fresh))
        self._release(holes)

    def _degrade(self, exc: Exception, dropped: int) -> None:
        """A write failed (a full disk, say): drop saves for a while, then retry. Logged once per episode."""
        self._degraded_until = self.clock() + DEGRADED_RETRY_S
        self.counters.add("disk", "write_errors")
        self.counters.add("disk", "dropped_saves", dropped)
        if not self._degraded:
            self._degraded = True
            nospace = "No space" in str(exc) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
            log.warning("disk tier write failed (%s): saves are dropped and counted, retrying every %.0f s%s",
                        exc, DEGRADED_RETRY_S, "; the file system is full" if nospace else "")

    def _insert(self, txn: lmdb.Transaction, key: bytes, e: Entry) -> None:
        txn.put(key, e.pack(), db=self._db["index"])
        txn.put(_time_key(e.last_access_s, key), b"", db=self._db["atime"])
        txn.put(_time_key(e.created_s, key), b"", db=self._db["ctime"])
        self._add_totals(txn, e.ns_digest, 1, e.footprint)
        self._add_segment(txn, e.seg_id, 1, e.footprint)

    def _remove(self, txn: lmdb.Transaction, key: bytes, e: Entry) -> bool:
        """Drop an entry and its index rows; True if its segment is now empty and sealed (unlink it)."""
        txn.delete(key, db=self._db["index"])
        txn.delete(_time_key(e.last_access_s, key), db=self._db["atime"])
        txn.delete(_time_key(e.created_s, key), db=self._db["ctime"])
        self._add_totals(txn, e.ns_digest, -1, -e.footprint)
        return self._add_segment(txn, e.seg_id, -1, -e.footprint)

    def _add_totals(self, txn: lmdb.Transaction, ns: bytes, blocks: int, nbytes: int) -> None:
        raw = txn.get(ns, db=self._db["totals"])
        b, n = _TOTALS.unpack(raw) if raw else (0, 0)
        assert b + blocks >= 0 and n + nbytes >= 0, f"totals underflow for {ns.hex()}: {b}+{blocks}, {n}+{nbytes}"
        if b + blocks == 0:
            txn.delete(ns, db=self._db["totals"])
        else:
            txn.put(ns, _TOTALS.pack(b + blocks, n + nbytes), db=self._db["totals"])

    def _add_segment(self, txn: lmdb.Transaction, seg_id: int, records: int, nbytes: int) -> bool:
        k = _SEG_ID.pack(seg_id)
        raw = txn.get(k, db=self._db["segments"])
        live_nbytes, live_records, pid, sealed = _SEGMENT.unpack(raw) if raw else (0, 0, 0, 1)
        live_nbytes, live_records = live_nbytes + nbytes, live_records + records
        if live_records == 0 and sealed:
            txn.delete(k, db=self._db["segments"])
            return True
        txn.put(k, _SEGMENT.pack(live_nbytes, live_records, pid, sealed), db=self._db["segments"])
        return False

    def _set_segment(self, txn: lmdb.Transaction, seg_id: int, sealed: bool) -> None:
        k = _SEG_ID.pack(seg_id)
        raw = txn.get(k, db=self._db["segments"])
        if raw is None:
            return
        live_nbytes, live_records, pid, _ = _SEGMENT.unpack(raw)
        if live_records == 0 and sealed:
            txn.delete(k, db=self._db["segments"])
            self._pending_unlink.append(seg_id)
        else:
            txn.put(k, _SEGMENT.pack(live_nbytes, live_records, pid, int(sealed)), db=self._db["segments"])

    def _evict_for(self, txn: lmdb.Transaction, incoming: int, budget: int) -> list[tuple[int, int, int, bool]]:
        """Evict least-recently-used blocks until ``incoming`` more bytes fit in the budget."""
        total = self._total_nbytes(txn)
        holes: list[tuple[int, int, int, bool]] = []
        if total + incoming <= budget:
            return holes
        cur = txn.cursor(db=self._db["atime"])
        while total + incoming > budget and cur.first():
            tkey = bytes(cur.key())
            key = tkey[_TIME.size:]
            raw = txn.get(key, db=self._db["index"])
            if raw is None:  # stale row (cannot happen in a consistent store): drop it
                txn.delete(tkey, db=self._db["atime"])
                continue
            e = Entry.unpack(raw)
            holes.append((*e.location, self._remove(txn, key, e)))
            total -= e.footprint
            self.counters.add("disk", "evictions")
        return holes

    def _release(self, holes: Sequence[tuple[int, int, int, bool]]) -> int:
        """After commit: punch freed records, unlink segments that emptied. Returns segments removed.

        Emptied segments are punched too: another process may hold the file open, which would keep an
        unlinked file's pages allocated.
        """
        self.segments.punch([(s, o, n) for s, o, n, _ in holes])
        emptied = {s for s, _, _, empty in holes if empty} | set(self._pending_unlink)
        self._pending_unlink.clear()
        for seg_id in emptied:
            self.segments.unlink(seg_id)
        return len(emptied)

    def still_indexed(self, key: BlockKey, location: tuple[int, int, int]) -> bool:
        """Whether ``key`` still names the record at ``location`` (a failed read may have raced a sweep)."""
        with self._env.begin(db=self._db["index"]) as txn:
            raw = txn.get(key)
        return raw is not None and Entry.unpack(raw).location == location

    def _total_nbytes(self, txn: lmdb.Transaction) -> int:
        return sum(_TOTALS.unpack(v)[1] for _, v in txn.cursor(db=self._db["totals"]))

    def _apply_purges(self, purges: Sequence[_Purge]) -> None:
        if not purges:
            return
        holes = []
        with self._write_txn() as txn:
            for p in purges:
                raw = txn.get(p.key, db=self._db["index"])
                if raw is None:
                    continue
                e = Entry.unpack(raw)
                if e.location != p.location:
                    continue
                holes.append((*e.location, self._remove(txn, p.key, e)))
        self._release(holes)

    def _flush_touched(self) -> None:
        with self._touched_lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return
        with self._write_txn() as txn:
            for key, t in touched.items():
                raw = txn.get(key, db=self._db["index"])
                if raw is None:
                    continue
                e = Entry.unpack(raw)
                if t <= e.last_access_s:
                    continue
                txn.delete(_time_key(e.last_access_s, key), db=self._db["atime"])
                e.last_access_s = t
                txn.put(key, e.pack(), db=self._db["index"])
                txn.put(_time_key(t, key), b"", db=self._db["atime"])

    # ---------------------------------------------------------------- maintenance (gc, stats)

    def totals(self) -> dict[NamespaceDigest, tuple[int, int]]:
        """Exact (blocks, footprint bytes) per namespace; O(namespaces), no scan."""
        with self._env.begin(db=self._db["totals"]) as txn:
            return {NamespaceDigest(bytes(k)): _TOTALS.unpack(v) for k, v in txn.cursor()}

    def iter_entries(self) -> Iterator[tuple[BlockKey, Entry]]:
        """Every entry, in key order, read in short transactions (safe beside a live writer)."""
        last: bytes | None = None
        while True:
            batch: list[tuple[BlockKey, Entry]] = []
            with self._env.begin(db=self._db["index"]) as txn:
                cur = txn.cursor()
                ok = cur.set_range(last + b"\0") if last is not None else cur.first()
                while ok and len(batch) < 4096:
                    batch.append((BlockKey(bytes(cur.key())), Entry.unpack(cur.value())))
                    ok = cur.next()
            if not batch:
                return
            yield from batch
            last = batch[-1][0]

    def _sweep(self, index_db: str, stop: Callable[[float, bytes], bool], dry_run: bool,
               progress: Callable[[int], None] | None) -> int:
        """Delete from the oldest end of a time index until ``stop(time_s, key)``, in small transactions."""
        if dry_run:
            n = 0
            with self._env.begin(db=self._db[index_db]) as txn:
                for tkey, _ in txn.cursor():
                    if stop(_TIME.unpack(tkey[: _TIME.size])[0] / 1000.0, bytes(tkey[_TIME.size:])):
                        break
                    n += 1
            return n
        removed = 0
        while True:
            holes = []
            n = 0
            with self._write_txn() as txn:
                cur = txn.cursor(db=self._db[index_db])
                while n < SWEEP_BATCH and cur.first():
                    tkey = bytes(cur.key())
                    key = tkey[_TIME.size:]
                    if stop(_TIME.unpack(tkey[: _TIME.size])[0] / 1000.0, key):
                        break
                    n += 1
                    raw = txn.get(key, db=self._db["index"])
                    if raw is None:
                        txn.delete(tkey, db=self._db[index_db])
                    else:
                        e = Entry.unpack(raw)
                        holes.append((*e.location, self._remove(txn, key, e)))
            self._release(holes)
            removed += n
            if progress:
                progress(n)
            if n < SWEEP_BATCH:
                return removed

    def expire(self, *, ttl_s: float | None = None, max_age_s: float | None = None, dry_run: bool = False,
               progress: Callable[[int], None] | None = None) -> SweepReport:
        """Delete blocks idle longer than ``ttl_s`` or older than ``max_age_s`` (defaults: the policy)."""
        self._flush_touched()
        now = self.clock()
        ttl_s = self.policy.ttl_s if ttl_s is None else ttl_s
        max_age_s = self.policy.max_age_s if max_age_s is None else max_age_s
        n = 0
        if ttl_s is not None:
            n += self._sweep("atime", lambda t, _k: now - t <= ttl_s, dry_run, progress)
        if max_age_s is not None:
            n += self._sweep("ctime", lambda t, _k: now - t <= max_age_s, dry_run, progress)
        self.counters.add("disk", "expirations", n)
        return SweepReport(expired=n)

    def enforce_budget(self, budget_nbytes: int | None = None, *, dry_run: bool = False,
                       progress: Callable[[int], None] | None = None) -> SweepReport:
        budget = self.policy.budget_nbytes if budget_nbytes is None else budget_nbytes
        if budget is None:
            return SweepReport()
        with self._env.begin() as txn:
            excess = self._total_nbytes(txn) - budget
        if excess <= 0:
            return SweepReport()
        freed = [0]

        def stop(_t: float, key: bytes) -> bool:
            if freed[0] >= excess:
                return True
            with self._env.begin(db=self._db["index"]) as t:
                raw = t.get(key)
            freed[0] += Entry.unpack(raw).footprint if raw else 0
            return False

        n = self._sweep("atime", stop, dry_run, progress)
        self.counters.add("disk", "evictions", n)
        return SweepReport(evicted=n, freed_nbytes=freed[0])

    def purge_namespace(self, digest: bytes | None, *, dry_run: bool = False,
                        progress: Callable[[int], None] | None = None) -> SweepReport:
        """Delete every block of one namespace (``None``: of all namespaces)."""
        keys = [k for k, e in self.iter_entries() if digest is None or e.ns_digest == digest]
        if not dry_run:
            self._delete_keys(keys, progress)
        return SweepReport(purged=len(keys))

    def _delete_keys(self, keys: Sequence[bytes], progress: Callable[[int], None] | None = None) -> int:
        removed = 0
        for start in range(0, len(keys), SWEEP_BATCH):
            holes = []
            with self._write_txn() as txn:
                for key in keys[start : start + SWEEP_BATCH]:
                    raw = txn.get(key, db=self._db["index"])
                    if raw is not None:
                        e = Entry.unpack(raw)
                        holes.append((*e.location, self._remove(txn, key, e)))
            self._release(holes)
            removed += len(holes)
            if progress:
                progress(len(keys[start : start + SWEEP_BATCH]))
        return removed

    def check(self, *, dry_run: bool = False, progress: Callable[[int], None] | None = None) -> SweepReport:
        """Read and verify every record (header, tokens, key, payload checksum); purge the bad ones."""
        from tierkv.codec import decode_header, decode_payload
        from tierkv.errors import RecordError
        from tierkv.keys import chain_key

        bad: list[bytes] = []
        checked = 0
        for key, e in self.iter_entries():
            with self._read_lock:
                (view,) = self.segments.read([e.location])
                try:
                    header, token_bytes, stored = decode_header(view)
                    if header.key != key or header.ns_digest != e.ns_digest:
                        raise RecordError("record names another key or namespace")
                    if chain_key(header.parent_key, bytes(token_bytes)) != key:
                        raise RecordError("token ids do not hash to the key")
                    decode_payload(header, stored)
                except RecordError:
                    bad.append(key)
            checked += 1
            if progress:
                progress(1)
        if not dry_run:
            self._delete_keys(bad)
        self.counters.add("disk", "corrupt_blocks", len(bad))
        return SweepReport(checked=checked, corrupt=len(bad))

    def compact(self, *, dry_run: bool = False) -> SweepReport:
        """Release every byte no live record uses: gaps a crash left, whole orphan files, empty segments."""
        live: dict[int, list[tuple[int, int]]] = {}
        for _, e in self.iter_entries():
            live.setdefault(e.seg_id, []).append((e.offset, e.footprint))
        with self._env.begin(db=self._db["segments"]) as txn:
            rows = {(_SEG_ID.unpack(bytes(k))[0]): _SEGMENT.unpack(v) for k, v in txn.cursor()}
        before, _ = self.segments.disk_nbytes()
        removed = 0
        for seg_id in self.segments.list_ids():
            row = rows.get(seg_id)
            ranges = sorted(live.get(seg_id, []))
            active = row is not None and not row[3] and _pid_alive(row[2])
            if not ranges and not active:
                removed += 1
                if not dry_run:
                    self.segments.unlink(seg_id)
                    with self._write_txn() as txn:
                        txn.delete(_SEG_ID.pack(seg_id), db=self._db["segments"])
                continue
            if dry_run:
                continue
            # Gaps between live records (crash leftovers, unpunched deletions); an active writer's tail
            # beyond the last live record is left alone: it may be writing there now.
            holes, pos = [], 0
            for off, n in ranges:
                if off > pos:
                    holes.append((seg_id, pos, off - pos))
                pos = max(pos, off + n)
            if not active:
                size = self.segments.file(seg_id).stat().st_size
                if size > pos:
                    holes.append((seg_id, pos, aligned(size) - pos))
            self.segments.punch(holes)
        after, _ = self.segments.disk_nbytes()
        return SweepReport(segments_removed=removed, freed_nbytes=max(0, before - after))

    def usage(self) -> dict[str, int]:
        with self._env.begin() as txn:
            live = self._total_nbytes(txn)
        allocated, apparent = self.segments.disk_nbytes()
        index_nbytes = sum(p.stat().st_size for p in (self.path / "index").glob("*.mdb"))
        return {"live_nbytes": live, "segment_allocated_nbytes": allocated, "segment_apparent_nbytes": apparent,
                "index_file_nbytes": index_nbytes, "budget_nbytes": self.policy.budget_nbytes or 0}

    def close(self) -> None:
        if self._closed:
            return
        if self._thread is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join()
            if self._writer_seg is not None:
                with self._write_txn() as txn:
                    self._set_segment(txn, self._writer_seg.seg_id, sealed=True)
                self._writer_seg.close()
                self._release([])
        else:
            self._flush_touched()
        self._closed = True
        self.segments.close()
        self._env.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_private_dir(path: Path) -> None:
    """The store's directories are the owner's alone (0700): KV blocks reveal what tenants sent."""
    existed = path.exists()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not existed:
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    for sub in ("index", "segments"):
        (path / sub).mkdir(mode=0o700, exist_ok=True)
        os.chmod(path / sub, 0o700)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
