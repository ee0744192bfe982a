"""The durable disk tier: an LMDB index over append-only segment files.

LMDB environment ``<dir>/index`` (named databases):

    index       key -> Entry (namespace, segment, offset, nbytes, created_s, last_access_s)
    atime       last_access_ms(8, big-endian) || key -> ""   (LRU eviction and sliding-TTL sweeps)
    ctime       created_ms || key -> ""                      (max-age sweeps)
    segments    seg_id(4) -> SegmentRow (live bytes and records, creator pid, sealed)
    totals      namespace digest -> (blocks, nbytes)         (exact, updated in the same transactions)
    namespaces  namespace digest -> spec JSON                (while the namespace has blocks)
    meta        format version, segment counter, the store's TTL / max-age / budget policy

Records live in ``<dir>/segments`` (see ``segments.py``). A batch is appended and fdatasync'ed first,
then indexed in one LMDB transaction, so after a crash or a power cut every indexed record is complete;
bytes a crash left unindexed are never referenced and are released by ``gc --compact``.

Several processes share one directory (workers, ``tierkv gc``): LMDB serialises their write
transactions, and every decision that depends on the index (is this key new or expired, is this record
still the one that was read, is this range dead) is taken inside the write transaction that acts on it.
Each writing process appends to a segment of its own and holds an flock on it while it lives, which is
how other processes tell a live writer's segment from a dead one's. In a process, one writer thread does
the saves (a write transaction belongs to its thread); sweeps may run on other threads; readers use
short read-only transactions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from tierkv.errors import NamespaceConflictError, StoreFormatError, StoreOpenError
from tierkv.keys import BlockKey, Namespace, NamespaceDigest
from tierkv.metrics import Counters
from tierkv.tiers.segments import SegmentDir, SegmentWriter, aligned, fsync_dir

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
MAP_GROW_ATTEMPTS = 8  # doublings of the index map within one write before giving up
FLUSH_TIMEOUT_S = 120.0  # flush() (and so SIGTERM) never waits longer for the writer
DEFAULT_SWEEP_INTERVAL_S = 300.0  # a server's own expiry and budget sweep

_DBS = ("index", "atime", "ctime", "segments", "totals", "namespaces", "meta")
# Errors that mean the environment itself is damaged or foreign: only these may move a store aside.
_CORRUPT = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError, lmdb.VersionMismatchError)
_T = TypeVar("_T")
_Hole = tuple[int, int, int, bool]  # seg_id, offset, nbytes, whether its segment emptied (unlink it)


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
    ns_spec: bytes | None = None  # the namespace's JSON, stored with its first block
    record: Record = dataclasses.field(default_factory=list)

    @property
    def record_nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.record)


@dataclasses.dataclass(slots=True)
class _Barrier:
    """Queued by ``flush``: the writer writes access times when it reaches it."""

    nbytes: int = 0


@dataclasses.dataclass(slots=True)
class _Purge:
    key: bytes
    location: tuple[int, int, int]  # purge only if the index still points here (not a concurrent rewrite)


class _TxnGate:
    """LMDB forbids ``set_mapsize`` while any transaction of this process is open: transactions enter
    shared, a map resize waits until they have all left (exclusive). Re-entrant per thread for shared."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False
        self._local = threading.local()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._resizing:
                    self._cond.wait()
                self._active += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    if self._active == 0:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._local, "depth", 0):
            raise RuntimeError("map resize requested inside a transaction of the same thread")
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class DiskTier:
    """Durable, content-addressed block store. Thread-safe; one instance per process and directory, any
    number of processes per directory (see the module docstring)."""

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
        sweep_interval_s: float = 0.0,
        counters: Counters | None = None,
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        self.sync = sync
        self.counters = counters or Counters()
        self._gate = _TxnGate()
        self._open(map_nbytes, writer)
        self.policy = self._load_policy(policy, persist=writer)
        self.segments = SegmentDir(self.path / "segments", read_threads=read_threads)
        self._read_lock = threading.Lock()  # guards the segment dir's reused read buffer
        self._touched: dict[bytes, float] = {}
        self._touched_lock = threading.Lock()
        self._writer_seg: SegmentWriter | None = None
        self.segment_nbytes = segment_nbytes
        self.batch_nbytes = batch_nbytes
        self.queue_nbytes = queue_nbytes
        self._queued_nbytes = 0
        self._queued_keys: dict[bytes, int] = {}  # key -> puts in the queue: a second save is not queued
        self._queued_lock = threading.Lock()
        self._queue: queue.Queue[_Put | _Purge | _Barrier | None] = queue.Queue()
        self._degraded_until = 0.0
        self._degraded = False  # in a failure episode (logged once)
        self._punch_warned = False
        self._closed = False
        self.read_only = not writer
        self._thread: threading.Thread | None = None
        self._sweeper: threading.Thread | None = None
        self._stop_sweeper = threading.Event()
        if writer:
            self._clear_stale_readers()
            self._seal_dead_writers()
            self._thread = threading.Thread(target=self._writer_loop, name="tierkv-disk-writer", daemon=True)
            self._thread.start()
            if sweep_interval_s > 0:
                self._sweeper = threading.Thread(target=self._sweep_loop, args=(sweep_interval_s,),
                                                 name="tierkv-disk-sweep", daemon=True)
                self._sweeper.start()

    # ---------------------------------------------------------------- opening

    def _open(self, map_nbytes: int, writer: bool) -> None:
        """Open the index. Every process holds ``owners.lock`` shared while it has the store open, so one
        that finds the environment damaged can prove it is alone (exclusive) before it repairs anything:
        a lock-file problem is repaired by recreating ``lock.mdb`` (it holds no data); a damaged
        ``data.mdb`` is moved aside, only by a writer, and only when no other process has the store open.
        Anything else (permissions, read-only media, memory) is a ``StoreOpenError``: the data stays."""
        try:
            _make_private_dir(self.path)
            self._owner_fd = _lock_owner(self.path, exclusive=False)
        except OSError as exc:
            raise StoreOpenError(f"cannot open the store at {self.path}: {exc}") from exc
        try:
            try:
                self._open_env(map_nbytes, writer)
            except _CORRUPT as exc:
                self._repair(map_nbytes, writer, exc)
        except lmdb.Error as exc:
            hint = ""
            if "Resource temporarily unavailable" in str(exc):  # LMDB's reader table is keyed by pid
                hint = ("; another process with the same pid holds it: processes sharing a cache directory "
                        "must share a PID namespace (containers: --pid=host or one pod)")
            raise StoreOpenError(f"cannot open the store at {self.path}: {exc}{hint}") from exc
        except BaseException:
            os.close(self._owner_fd)
            raise

    def _repair(self, map_nbytes: int, writer: bool, exc: lmdb.Error) -> None:
        if not _try_exclusive(self._owner_fd):
            raise StoreOpenError(f"the store at {self.path} cannot be opened ({exc}) and other processes have it "
                                 "open: stop them, then start again") from exc
        try:
            lock = self.path / "index" / "lock.mdb"
            if lock.exists():  # a lock file of another LMDB build, or damaged: recreate it and retry
                lock.unlink()
                try:
                    self._open_env(map_nbytes, writer)
                    log.warning("the store's lock file at %s was unusable (%s): recreated it", lock, exc)
                    return
                except _CORRUPT as again:
                    exc = again
            if not writer:  # a reader (``tierkv stats``) never moves a store: the server owns that
                raise StoreOpenError(f"the store at {self.path} is damaged ({exc}); the next server started "
                                     f"on it moves it aside and starts empty") from exc
            # Damaged meta pages, a truncated or foreign file: keep it for a post-mortem, start empty.
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
            log.error("cannot open the store at %s (%s): moved aside to %s, starting an empty store",
                      self.path, exc, aside)
            self.path.rename(aside)
            _make_private_dir(self.path)
            os.close(self._owner_fd)
            self._owner_fd = _lock_owner(self.path, exclusive=True)
            self._open_env(map_nbytes, writer)
        finally:
            fcntl.flock(self._owner_fd, fcntl.LOCK_SH)  # back to shared: others may open it now

    def _open_env(self, map_nbytes: int, writer: bool) -> None:
        self._env = lmdb.open(
            str(self.path / "index"), map_size=map_nbytes, max_dbs=8, subdir=True,
            sync=self.sync, metasync=self.sync, mode=0o600,
            readahead=False,  # index pages are read at random: readahead only pollutes the page cache
            max_readers=512, max_spare_txns=4,
        )
        try:
            self._db = None if writer else self._open_tables_read_only()
            if self._db is None:  # a writer, or a store some table of which was never created
                self._db = self._write(lambda txn: {n: self._env.open_db(n.encode(), txn=txn) for n in _DBS})
            self._check_format(writer)
        except BaseException:
            self._env.close()
            raise

    def _open_tables_read_only(self) -> dict[str, Any] | None:
        try:  # (py-lmdb keeps handles opened this way; not those opened in a read transaction of ours)
            return {n: self._env.open_db(n.encode(), create=False) for n in _DBS}
        except lmdb.NotFoundError:
            return None

    def _check_format(self, writer: bool) -> None:
        with self._read() as txn:
            raw = txn.get(b"format_version", db=self._db["meta"])
        if raw is None and writer:
            self._write(lambda txn: txn.put(b"format_version", str(STORE_FORMAT_VERSION).encode(),
                                            db=self._db["meta"], overwrite=False))
        elif raw is not None and _parse_version(raw) != STORE_FORMAT_VERSION:
            raise StoreFormatError(
                f"{self.path} holds a tierkv store of format version {bytes(raw)[:16].decode(errors='replace')}; "
                f"this build reads version "
                f"{STORE_FORMAT_VERSION}. Use another --cache-dir, or delete this one to start afresh.")

    def _load_policy(self, given: Policy | None, persist: bool) -> Policy:
        """The stored policy, with the fields ``given`` sets (not None) replacing it; persisted by writers."""
        with self._read() as txn:
            raw = txn.get(b"policy", db=self._db["meta"])
        stored = Policy(**json.loads(raw)) if raw else Policy()
        if given is None:
            return stored
        merged = Policy(*(g if g is not None else s for g, s in
                          zip(dataclasses.astuple(given), dataclasses.astuple(stored))))
        if persist and merged != stored:
            self._write(lambda txn: txn.put(b"policy", json.dumps(dataclasses.asdict(merged)).encode(),
                                            db=self._db["meta"]))
        return merged

    def _seal_dead_writers(self) -> None:
        """Segments left open by a writer that died are sealed, so they can be freed once empty.

        A writer holds an flock on its open segment for its whole life, so "dead" is "unlocked": true
        across PID namespaces and containers, unlike a pid check."""
        def seal(txn: lmdb.Transaction) -> list[int]:
            emptied = []
            for k, v in list(txn.cursor(db=self._db["segments"])):
                row = _SEGMENT.unpack(v)
                seg_id = _SEG_ID.unpack(bytes(k))[0]
                if not row[3] and not self.segments.is_active(seg_id):
                    emptied += [seg_id] if self._set_segment(txn, seg_id, sealed=True) else []
            return emptied

        for seg_id in self._write(seal):
            self.segments.unlink(seg_id)

    def register_namespace(self, ns: Namespace) -> None:
        """Record a namespace's spec (for stats). Saves do this themselves, in the transaction that indexes
        a namespace's first block; the row goes with its last block, so hostile salts cannot grow it."""
        spec = ns.to_json().encode()
        with self._read() as txn:
            if txn.get(ns.digest, db=self._db["namespaces"]) == spec:
                return
        self._write(lambda txn: self._put_namespace(txn, ns.digest, spec))

    def _put_namespace(self, txn: lmdb.Transaction, digest: bytes, spec: bytes) -> None:
        existing = txn.get(digest, db=self._db["namespaces"])
        if existing is not None and existing != spec:
            raise NamespaceConflictError(
                f"namespace {digest.hex()[:16]} is registered with another spec: {bytes(existing).decode()}")
        if existing is None:
            txn.put(digest, spec, db=self._db["namespaces"])

    def namespaces(self) -> dict[NamespaceDigest, Namespace]:
        with self._read() as txn:
            return {NamespaceDigest(bytes(k)): Namespace.from_json(bytes(v).decode())
                    for k, v in txn.cursor(db=self._db["namespaces"])}

    # ---------------------------------------------------------------- transactions

    @contextlib.contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        """A read-only transaction; adopts the map size another process grew the map to."""
        for _ in range(3):
            with _normal_priority(), self._gate.shared():
                try:
                    txn = self._env.begin()
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            self._resize(0)
        raise StoreOpenError(f"{self.path}: the index map keeps being resized by another process")

    def _write(self, fn: Callable[[lmdb.Transaction], _T]) -> _T:
        """Run ``fn`` in a write transaction and commit. A full map is grown (doubled) and ``fn`` runs
        again in a fresh transaction, so ``fn`` must return what it did rather than record it elsewhere."""
        for _ in range(MAP_GROW_ATTEMPTS):
            try:
                with _normal_priority(), self._gate.shared(), self._env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._resize(self._env.info()["map_size"] * 2)
            except lmdb.MapResizedError:
                self._resize(0)
        raise lmdb.MapFullError(f"{self.path}: the index map is still full after {MAP_GROW_ATTEMPTS} growths")

    def _clear_stale_readers(self) -> None:
        """Free reader slots of processes that died inside a read transaction: each pins an old snapshot,
        and LMDB cannot reuse any page freed since, so the index would grow without bound."""
        cleared = self._env.reader_check()
        if cleared:
            log.warning("disk tier: cleared %d reader slots left by dead processes", cleared)
            self.counters.add("disk", "stale_readers", cleared)

    def _resize(self, map_nbytes: int) -> None:
        """Grow the map to ``map_nbytes`` (0: adopt the size another process set), with no transaction of
        this process open, as LMDB requires."""
        if map_nbytes:
            self._clear_stale_readers()  # often the map is "full" only of pages a dead reader pins
        with self._gate.exclusive():
            if map_nbytes:
                log.info("disk tier index full: growing its map to %d bytes", map_nbytes)
            self._env.set_mapsize(map_nbytes)

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
        with self._read() as txn:
            for key in keys:
                raw = txn.get(key, db=self._db["index"])
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

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: stored and unexpired, or queued to be written (a save need not queue it again)."""
        now = self.clock()
        with self._queued_lock:
            out = [bytes(k) in self._queued_keys for k in keys]
        with self._read() as txn:
            for i, key in enumerate(keys):
                if not out[i]:
                    raw = txn.get(key, db=self._db["index"])
                    out[i] = raw is not None and not self._expired(Entry.unpack(raw), now)
        return out

    @contextlib.contextmanager
    def read(self, entries: Sequence[Entry]) -> Iterator[list[memoryview]]:
        """The whole records of ``entries``, as views valid inside the ``with`` block only."""
        with self._read_lock:
            yield self.segments.read([e.location for e in entries]) if entries else []

    def read_into(self, requests: Sequence[tuple[Entry, list[memoryview]]],
                  verify: Callable[[int], bool] | None = None) -> list[bool]:
        """Scatter each record into its destination views; ``verify(i)`` runs on the reading thread."""
        return self.segments.readv([(*e.location, views) for e, views in requests], verify)

    def touch(self, keys: Sequence[BlockKey], nbytes: int = 0) -> None:
        """Record hits: refreshes the sliding TTL (written in batches by the writer thread)."""
        now = self.clock()
        with self._touched_lock:
            for key in keys:
                self._touched[bytes(key)] = now
        if nbytes:
            self.counters.add("disk", "bytes_read", nbytes)

    # ---------------------------------------------------------------- writes

    def put(self, ns_digest: NamespaceDigest, key: BlockKey, record: bytes | Callable[[], Record],
            nbytes: int, created_s: float, release: Callable[[], None] | None = None,
            ns_spec: bytes | None = None) -> bool:
        """Queue one record (its bytes, or a function the writer thread calls to encode it).

        ``release`` runs on the writer thread once the record is written or skipped. Returns False (and
        counts a dropped save) when the queue is full, the tier is degraded or its writer is gone; then
        nothing runs and the caller still owns what ``release`` would have freed. ``ns_spec`` (the
        namespace's JSON) is recorded with the namespace's first block, for stats.
        """
        if self._thread is None or self._closed:
            raise RuntimeError("this DiskTier was opened without a writer")
        with self._queued_lock:
            if not self._thread.is_alive():
                self._writer_gone()
                self.counters.add("disk", "dropped_saves")
                return False
            if self._queued_keys.get(bytes(key)):  # already on its way: nothing to do
                if release is not None:
                    release()
                return True
            if time.monotonic() < self._degraded_until or self._queued_nbytes + nbytes > self.queue_nbytes:
                self.counters.add("disk", "dropped_saves")
                return False
            self._queued_nbytes += nbytes
            self._queued_keys[bytes(key)] = 1
        make = record if callable(record) else (lambda r=record: [r])
        self._queue.put(_Put(ns_digest, bytes(key), make, nbytes, created_s, release, ns_spec))
        return True

    def purge(self, key: BlockKey, location: tuple[int, int, int]) -> None:
        """Remove a record that failed verification, if the index still points at what was read."""
        self.counters.add("disk", "corrupt_blocks")
        if self._thread is not None and not self._closed and self._thread.is_alive():
            self._queue.put(_Purge(bytes(key), location))
        else:
            self._apply_purges([_Purge(bytes(key), location)])

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued record is durable (or dropped) and access times are written.

        Never waits for ever: returns False (logged) after ``timeout_s`` or when the writer is gone. With a
        writer thread, the caller's thread opens no write transaction (LMDB's write lock may be held by
        another process for long): the access times go through the queue like the records."""
        ok = True
        if self._thread is not None:
            if self._thread.is_alive():
                self._queue.put(_Barrier())
            deadline = time.monotonic() + timeout_s
            with self._queue.all_tasks_done:
                while self._queue.unfinished_tasks:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        log.warning("disk tier flush: %d queued writes not done (%s)", self._queue.unfinished_tasks,
                                    "writer thread gone" if not self._thread.is_alive() else "timed out")
                        ok = False
                        break
                    self._queue.all_tasks_done.wait(min(left, 1.0))
            return ok
        try:
            self._flush_touched()
        except (OSError, lmdb.Error) as exc:
            log.warning("disk tier flush: access times not written: %s", exc)
            ok = False
        return ok

    def _writer_gone(self) -> None:
        if not self._degraded:
            self._degraded = True
            log.error("disk tier writer thread is gone: saves are dropped and counted (host-only caching)")

    def _writer_loop(self) -> None:
        # Background persistence must not slow the model down. On Linux, scheduling settings made with the
        # thread's id apply to this thread only: SCHED_IDLE runs it only on otherwise idle CPU (measured: a
        # server with no cache hits was 9 to 16% slower than with the cache off at nice 0 or 10, on 2 cores).
        # Under constant load the queue then fills and saves are dropped and counted: a future miss only.
        _idle_priority()
        while True:
            try:
                item = self._queue.get(timeout=TOUCH_FLUSH_INTERVAL_S)
            except queue.Empty:
                self._guarded(self._flush_touched)
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
            puts = [i for i in items if isinstance(i, _Put)]
            try:
                self._guarded(self._write_batch, puts)
                self._guarded(self._apply_purges, [i for i in items if isinstance(i, _Purge)])
                self._guarded(self._flush_touched)
            finally:
                for _ in items:
                    self._queue.task_done()

    def _guarded(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a writer step; nothing it raises may kill the writer thread (a lost batch is only misses)."""
        try:
            fn(*args)
        except (OSError, lmdb.Error) as exc:  # a full disk, say: degrade, retry later
            self._degrade(exc, 0)
        except Exception:
            log.exception("disk tier writer: unexpected error (counted; the writer goes on)")
            self.counters.add("disk", "write_errors")

    def _segment_for(self, incoming_nbytes: int) -> SegmentWriter:
        seg = self._writer_seg
        if seg is not None and seg.end + incoming_nbytes <= self.segment_nbytes:
            return seg

        def allocate(txn: lmdb.Transaction) -> int:
            raw = txn.get(b"next_segment", db=self._db["meta"])
            seg_id = int(raw) if raw else 1
            txn.put(b"next_segment", str(seg_id + 1).encode(), db=self._db["meta"])
            return seg_id

        seg_id = self._write(allocate)
        # The file exists (locked) before its row: a process that sees the row unlocked knows it is dead.
        new = SegmentWriter(self.segments, seg_id, sync=self.sync)

        def register(txn: lmdb.Transaction) -> bool:
            txn.put(_SEG_ID.pack(seg_id), _SEGMENT.pack(0, 0, os.getpid(), 0), db=self._db["segments"])
            return seg is not None and self._set_segment(txn, seg.seg_id, sealed=True)

        try:
            emptied = self._write(register)
        except BaseException:
            new.close()
            raise
        if seg is not None:
            seg.close()
            if emptied:
                self.segments.unlink(seg.seg_id)
        self._writer_seg = new
        return new

    def _write_batch(self, puts: list[_Put]) -> None:
        if not puts:
            return
        try:
            degraded = time.monotonic() < self._degraded_until
            if degraded:
                self.counters.add("disk", "dropped_saves", len(puts))
            else:
                self._write_fresh(puts)
        finally:
            with self._queued_lock:
                self._queued_nbytes -= sum(p.nbytes for p in puts)
                for p in puts:
                    self._queued_keys.pop(p.key, None)
            for p in puts:
                if p.release is not None:
                    p.release()

    def _write_fresh(self, puts: list[_Put]) -> None:
        # A first look, outside the write transaction, only saves encoding and appending what is already
        # stored; the decision is taken again inside the write transaction (another process may be
        # writing the same prefix).
        now = self.clock()
        fresh: list[_Put] = []
        seen: set[bytes] = set()
        with self._read() as txn:
            for p in puts:
                if p.key in seen:
                    continue
                seen.add(p.key)
                raw = txn.get(p.key, db=self._db["index"])
                if raw is None or self._expired(Entry.unpack(raw), now):
                    fresh.append(p)
        for p in fresh:
            p.record = p.make_record()
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

        def index(txn: lmdb.Transaction) -> tuple[list[_Hole], list[_Hole], int]:
            now = self.clock()
            holes: list[_Hole] = []
            unused: list[_Hole] = []  # appended, but another writer stored the key first
            for p, off in zip(fresh, offsets):
                raw = txn.get(p.key, db=self._db["index"])
                if raw is not None:
                    old = Entry.unpack(raw)
                    if not self._expired(old, now):
                        unused.append((seg.seg_id, off, p.record_nbytes, False))
                        continue
                    holes.append((*old.location, self._remove(txn, p.key, old)))  # replaced: same transaction
                if p.ns_spec is not None:
                    self._put_namespace(txn, p.ns_digest, p.ns_spec)
                self._insert(txn, p.key, Entry(p.ns_digest, seg.seg_id, off, p.record_nbytes, p.created_s, now))
            evicted: list[_Hole] = []
            if budget is not None:
                evicted = self._evict_over(txn, budget)
            return holes + evicted, unused, len(evicted)

        try:
            holes, unused, evicted = self._write(index)
        except (lmdb.Error, NamespaceConflictError) as exc:  # index full, say: the appended bytes are orphans
            self._degrade(exc, len(fresh))
            self._release([(seg.seg_id, off, p.record_nbytes, False) for p, off in zip(fresh, offsets)])
            return
        if self._degraded:
            self._degraded = False
            log.warning("disk tier writes resumed")
        written = len(fresh) - len(unused)
        self.counters.add("disk", "blocks_written", written)
        self.counters.add("disk", "bytes_written", sum(p.record_nbytes for p in fresh) - sum(h[2] for h in unused))
        self.counters.add("disk", "evictions", evicted)
        self._release(holes + unused)

    def _degrade(self, exc: Exception, dropped: int) -> None:
        """A write failed (a full disk, say): drop saves for a while, then retry. Logged once per episode."""
        self._degraded_until = time.monotonic() + DEGRADED_RETRY_S
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
        if b + blocks < 0 or n + nbytes < 0:  # an index that disagrees with itself: never below zero
            log.error("disk tier totals underflow for namespace %s: %d%+d blocks, %d%+d bytes", ns.hex()[:16],
                      b, blocks, n, nbytes)
            self.counters.add("disk", "totals_errors")
        if b + blocks <= 0:
            txn.delete(ns, db=self._db["totals"])
            txn.delete(ns, db=self._db["namespaces"])  # its last block: the spec goes too
        else:
            txn.put(ns, _TOTALS.pack(b + blocks, max(0, n + nbytes)), db=self._db["totals"])

    def _add_segment(self, txn: lmdb.Transaction, seg_id: int, records: int, nbytes: int) -> bool:
        k = _SEG_ID.pack(seg_id)
        raw = txn.get(k, db=self._db["segments"])
        live_nbytes, live_records, pid, sealed = _SEGMENT.unpack(raw) if raw else (0, 0, 0, 1)
        live_nbytes, live_records = max(0, live_nbytes + nbytes), max(0, live_records + records)
        if live_records == 0 and sealed:
            txn.delete(k, db=self._db["segments"])
            return True
        txn.put(k, _SEGMENT.pack(live_nbytes, live_records, pid, sealed), db=self._db["segments"])
        return False

    def _set_segment(self, txn: lmdb.Transaction, seg_id: int, sealed: bool) -> bool:
        """Seal (or not) a segment's row; True if it is now sealed and empty (its row is gone: unlink it)."""
        k = _SEG_ID.pack(seg_id)
        raw = txn.get(k, db=self._db["segments"])
        if raw is None:
            return False
        live_nbytes, live_records, pid, _ = _SEGMENT.unpack(raw)
        if live_records == 0 and sealed:
            txn.delete(k, db=self._db["segments"])
            return True
        txn.put(k, _SEGMENT.pack(live_nbytes, live_records, pid, int(sealed)), db=self._db["segments"])
        return False

    def _evict_over(self, txn: lmdb.Transaction, budget: int) -> list[_Hole]:
        """Evict least-recently-used blocks until the live bytes fit in ``budget``."""
        total = self._total_nbytes(txn)
        holes: list[_Hole] = []
        if total <= budget:
            return holes
        cur = txn.cursor(db=self._db["atime"])
        while total > budget and cur.first():
            tkey = bytes(cur.key())
            key = tkey[_TIME.size:]
            raw = txn.get(key, db=self._db["index"])
            if raw is None:  # stale row (cannot happen in a consistent store): drop it
                txn.delete(tkey, db=self._db["atime"])
                continue
            e = Entry.unpack(raw)
            holes.append((*e.location, self._remove(txn, key, e)))
            total -= e.footprint
        return holes

    def _release(self, holes: Sequence[_Hole]) -> int:
        """After commit: punch freed records, unlink segments that emptied. Returns segments removed.

        Emptied segments are punched too: another process may hold the file open, which would keep an
        unlinked file's pages allocated."""
        if not holes:
            return 0
        done = self.segments.punch([(s, o, n) for s, o, n, _ in holes])
        if done < len(holes):
            self.counters.add("disk", "punch_unsupported", len(holes) - done)
            if not self._punch_warned:
                self._punch_warned = True
                log.warning("the file system under %s cannot punch holes: freed records keep their disk space "
                            "until their segment empties, so the byte budget is not held on disk; run "
                            "`tierkv gc --compact` or use ext4/xfs/btrfs", self.path)
        emptied = {s for s, _, _, empty in holes if empty}
        for seg_id in emptied:
            self.segments.unlink(seg_id)
        return len(emptied)

    def still_indexed(self, key: BlockKey, location: tuple[int, int, int]) -> bool:
        """Whether ``key`` still names the record at ``location`` (a failed read may have raced a sweep)."""
        with self._read() as txn:
            raw = txn.get(key, db=self._db["index"])
        return raw is not None and Entry.unpack(raw).location == location

    def _total_nbytes(self, txn: lmdb.Transaction) -> int:
        return sum(_TOTALS.unpack(v)[1] for _, v in txn.cursor(db=self._db["totals"]))

    def _apply_purges(self, purges: Sequence[_Purge]) -> int:
        """Remove each key only if the index still points at the location that was found bad (a writer may
        have replaced it since). Returns how many were removed."""
        if not purges:
            return 0

        def remove(txn: lmdb.Transaction) -> list[_Hole]:
            holes = []
            for p in purges:
                raw = txn.get(p.key, db=self._db["index"])
                if raw is None:
                    continue
                e = Entry.unpack(raw)
                if e.location == p.location:
                    holes.append((*e.location, self._remove(txn, p.key, e)))
            return holes

        holes = self._write(remove)
        self._release(holes)
        return len(holes)

    def _flush_touched(self) -> None:
        with self._touched_lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return

        def write(txn: lmdb.Transaction) -> None:
            for key, t in touched.items():
                raw = txn.get(key, db=self._db["index"])
                if raw is None:
                    continue
                e = Entry.unpack(raw)
                if t <= e.last_access_s or self._expired(e, t):  # an expired block stays expired
                    continue
                txn.delete(_time_key(e.last_access_s, key), db=self._db["atime"])
                e.last_access_s = t
                txn.put(key, e.pack(), db=self._db["index"])
                txn.put(_time_key(t, key), b"", db=self._db["atime"])

        try:
            self._write(write)
        except BaseException:
            with self._touched_lock:  # keep them for the next try
                for key, t in touched.items():
                    self._touched[key] = max(t, self._touched.get(key, 0.0))
            raise

    # ---------------------------------------------------------------- background sweep

    def _sweep_loop(self, interval_s: float) -> None:
        """The server's own gc: expiry and budget every ``interval_s``, at idle priority, off the model
        thread; also seals segments of writers that died and drops read descriptors of segments other
        processes removed."""
        _idle_priority()
        while not self._stop_sweeper.wait(interval_s):
            try:
                report = self.expire() + self.enforce_budget()
                self._seal_dead_writers()  # a crashed neighbour's segment can be freed once empty
                self._clear_stale_readers()
                self.segments.forget_removed()
                if report.expired or report.evicted:
                    log.info("disk sweep: %d expired, %d evicted", report.expired, report.evicted)
                self.counters.add("disk", "sweeps")
            except Exception:
                log.exception("disk sweep failed (counted; retried next interval)")
                self.counters.add("disk", "sweep_errors")

    # ---------------------------------------------------------------- maintenance (gc, stats)

    def totals(self) -> dict[NamespaceDigest, tuple[int, int]]:
        """Exact (blocks, footprint bytes) per namespace; O(namespaces), no scan."""
        with self._read() as txn:
            return {NamespaceDigest(bytes(k)): _TOTALS.unpack(v) for k, v in txn.cursor(db=self._db["totals"])}

    def iter_entries(self) -> Iterator[tuple[BlockKey, Entry]]:
        """Every entry, in key order, read in short transactions (safe beside a live writer, but not one
        snapshot: see ``snapshot_entries``)."""
        last: bytes | None = None
        while True:
            batch: list[tuple[BlockKey, Entry]] = []
            with self._read() as txn:
                cur = txn.cursor(db=self._db["index"])
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
        with self._read() as txn:
            return [(BlockKey(bytes(k)), Entry.unpack(v)) for k, v in txn.cursor(db=self._db["index"])]

    def _sweep(self, index_db: str, stop: Callable[[lmdb.Transaction, float, bytes], bool], dry_run: bool,
               progress: Callable[[int], None] | None) -> int:
        """Delete from the oldest end of a time index until ``stop(txn, time_s, key)``, in small
        transactions (a server's writer is never starved); each decision is taken in the transaction that
        acts on it."""
        if dry_run:
            n = 0
            with self._read() as txn:
                for tkey, _ in txn.cursor(db=self._db[index_db]):
                    if stop(txn, _TIME.unpack(tkey[: _TIME.size])[0] / 1000.0, bytes(tkey[_TIME.size:])):
                        break
                    n += 1
            return n

        def batch(txn: lmdb.Transaction) -> tuple[int, list[_Hole]]:
            holes: list[_Hole] = []
            n = 0
            cur = txn.cursor(db=self._db[index_db])
            while n < SWEEP_BATCH and cur.first():
                tkey = bytes(cur.key())
                key = tkey[_TIME.size:]
                if stop(txn, _TIME.unpack(tkey[: _TIME.size])[0] / 1000.0, key):
                    break
                n += 1
                raw = txn.get(key, db=self._db["index"])
                if raw is None:
                    txn.delete(tkey, db=self._db[index_db])
                else:
                    e = Entry.unpack(raw)
                    holes.append((*e.location, self._remove(txn, key, e)))
            return n, holes

        removed = 0
        while True:
            n, holes = self._write(batch)
            self._release(holes)
            removed += len(holes)
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
            n += self._sweep("atime", lambda _txn, t, _k: now - t <= ttl_s, dry_run, progress)
        if max_age_s is not None:
            n += self._sweep("ctime", lambda _txn, t, _k: now - t <= max_age_s, dry_run, progress)
        self.counters.add("disk", "expirations", n)
        return SweepReport(expired=n)

    def enforce_budget(self, budget_nbytes: int | None = None, *, dry_run: bool = False,
                       progress: Callable[[int], None] | None = None) -> SweepReport:
        budget = self.policy.budget_nbytes if budget_nbytes is None else budget_nbytes
        if budget is None:
            return SweepReport()
        freed = [0]
        dry_total = [-1]

        def stop(txn: lmdb.Transaction, _t: float, key: bytes) -> bool:
            if dry_run:  # nothing is deleted: count down a copy of the total
                if dry_total[0] < 0:
                    dry_total[0] = self._total_nbytes(txn)
                over = dry_total[0] - freed[0] > budget
            else:
                over = self._total_nbytes(txn) > budget
            if not over:
                return True
            raw = txn.get(key, db=self._db["index"])
            freed[0] += Entry.unpack(raw).footprint if raw else 0
            return False

        n = self._sweep("atime", stop, dry_run, progress)
        self.counters.add("disk", "evictions", n)
        return SweepReport(evicted=n, freed_nbytes=freed[0])

    def purge_namespace(self, digest: bytes | None, *, dry_run: bool = False,
                        progress: Callable[[int], None] | None = None) -> SweepReport:
        """Delete every block of one namespace (``None``: of all namespaces)."""
        found = [(k, e.location) for k, e in self.iter_entries() if digest is None or e.ns_digest == digest]
        if dry_run:
            return SweepReport(purged=len(found))
        n = 0
        for start in range(0, len(found), SWEEP_BATCH):
            part = found[start : start + SWEEP_BATCH]
            n += self._apply_purges([_Purge(k, loc) for k, loc in part])
            if progress:
                progress(len(part))
        return SweepReport(purged=n)

    def check(self, *, dry_run: bool = False, progress: Callable[[int], None] | None = None) -> SweepReport:
        """Read and verify every record (header, tokens, key, payload checksum); purge the bad ones.

        A purge removes the record that was read, by location: never a record a writer put in its place."""
        from tierkv.codec import decode_header, decode_payload
        from tierkv.errors import RecordError
        from tierkv.keys import chain_key

        bad: list[_Purge] = []
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
                    bad.append(_Purge(bytes(key), e.location))
                finally:  # views into the reused read buffer must not outlive the lock (it may be replaced)
                    view = header = token_bytes = stored = None
            checked += 1
            if progress:
                progress(1)
        if dry_run:
            corrupt = sum(self.still_indexed(p.key, p.location) for p in bad)
        else:
            # Only records still indexed where they were read count: a sweep or a rewrite that raced the
            # read is not corruption.
            corrupt = sum(self._apply_purges(bad[i : i + SWEEP_BATCH]) for i in range(0, len(bad), SWEEP_BATCH))
        self.counters.add("disk", "corrupt_blocks", corrupt)
        return SweepReport(checked=checked, corrupt=corrupt)

    def compact(self, *, dry_run: bool = False) -> SweepReport:
        """Release every byte no live record uses: gaps a crash left, whole orphan files, empty segments.

        Safe beside writers in other processes. Segments whose writer is alive hold its flock: they are
        never removed, and only gaps before their last live record are punched (a writer only appends
        past its committed records). Which segments are inactive is decided *before* the live set is read,
        in one snapshot: an inactive segment never gains a record, so the snapshot is final for it."""
        ids = self.segments.list_ids()
        inactive = {s for s in ids if not self.segments.is_active(s)}
        live: dict[int, list[tuple[int, int]]] = {}
        for _, e in self.snapshot_entries():
            live.setdefault(e.seg_id, []).append((e.offset, e.footprint))
        before, _ = self.segments.disk_nbytes()
        removed = 0
        for seg_id in ids:
            ranges = sorted(live.get(seg_id, []))
            if not ranges and seg_id in inactive:
                removed += 1
                if not dry_run:
                    self._drop_segment(seg_id)
                continue
            if dry_run:
                continue
            holes, pos = [], 0
            for off, n in ranges:
                if off > pos:
                    holes.append((seg_id, pos, off - pos))
                pos = max(pos, off + n)
            if seg_id in inactive:  # nobody appends to it any more: its tail past the last record is dead
                with contextlib.suppress(FileNotFoundError):
                    size = self.segments.file(seg_id).stat().st_size
                    if size > pos:
                        holes.append((seg_id, pos, aligned(size) - pos))
            self.segments.punch(holes)
        if not dry_run:
            self.segments.remove_stale_temp_files()
        after, _ = self.segments.disk_nbytes()
        return SweepReport(segments_removed=removed, freed_nbytes=max(0, before - after))

    def _drop_segment(self, seg_id: int) -> None:
        """Unlink an inactive segment with no live record, and its row if it has no live record left."""
        def drop(txn: lmdb.Transaction) -> bool:
            raw = txn.get(_SEG_ID.pack(seg_id), db=self._db["segments"])
            if raw is not None and _SEGMENT.unpack(raw)[1] > 0:
                return False  # the row disagrees with the snapshot: leave both for a later pass
            txn.delete(_SEG_ID.pack(seg_id), db=self._db["segments"])
            return True

        if self._write(drop):
            self.segments.unlink(seg_id)

    def usage(self) -> dict[str, int]:
        with self._read() as txn:
            live = self._total_nbytes(txn)
        allocated, apparent = self.segments.disk_nbytes()
        index_nbytes = sum(p.stat().st_size for p in (self.path / "index").glob("*.mdb"))
        return {"live_nbytes": live, "segment_allocated_nbytes": allocated, "segment_apparent_nbytes": apparent,
                "index_file_nbytes": index_nbytes, "budget_nbytes": self.policy.budget_nbytes or 0}

    def close(self) -> None:
        if self._closed:
            return
        self._stop_sweeper.set()
        if self._sweeper is not None:
            self._sweeper.join()
        if self._thread is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join(timeout=FLUSH_TIMEOUT_S)
            if self._thread.is_alive():
                # Stuck (another process holds LMDB's write lock?): closing its segment would release the
                # flock under a live append and closing the environment would pull it from under a
                # commit. Leave both to the process exit.
                log.error("disk tier writer still busy after %.0f s: its segment and the index stay open until "
                          "the process exits", FLUSH_TIMEOUT_S)
                self._closed = True
                return
            if self._writer_seg is not None:
                seg = self._writer_seg
                with contextlib.suppress(OSError, lmdb.Error):
                    if self._write(lambda txn: self._set_segment(txn, seg.seg_id, sealed=True)):
                        self.segments.unlink(seg.seg_id)
                seg.close()
        else:
            with contextlib.suppress(OSError, lmdb.Error):
                self._flush_touched()
        self._closed = True
        self.segments.close()
        self._env.close()
        os.close(self._owner_fd)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_priority = threading.local()  # .idle: this thread runs at idle priority outside transactions


def _idle_priority() -> None:
    """Run the calling thread only on otherwise idle CPU (SCHED_IDLE), else at the lowest nice."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        _priority.idle = True
    except (OSError, AttributeError):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)


@contextlib.contextmanager
def _normal_priority() -> Iterator[None]:
    """An idle-priority thread holding LMDB's write lock (or a place in the resize gate) would make the
    model thread and other processes wait for CPU nobody gives it: transactions run at normal priority."""
    if not getattr(_priority, "idle", False):
        yield
        return
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # not permitted here: stay idle
        yield
        return
    _priority.idle = False
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        _priority.idle = True


def _parse_version(raw: bytes) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


def _lock_owner(path: Path, exclusive: bool) -> int:
    """Open and flock ``<store>/owners.lock`` (shared by every process that has the store open)."""
    fd = os.open(path / "owners.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _try_exclusive(fd: int) -> bool:
    """Upgrade our shared owner lock to exclusive if no other process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _make_private_dir(path: Path) -> None:
    """The store's directories are the owner's alone (0700): KV blocks reveal what tenants sent."""
    existed = path.exists()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not existed:
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    created = not existed
    for sub in ("index", "segments"):
        created |= not (path / sub).exists()
        (path / sub).mkdir(mode=0o700, exist_ok=True)
        if (path / sub).stat().st_mode & 0o077:
            os.chmod(path / sub, 0o700)
    if created:  # the new directories themselves must survive a power cut
        fsync_dir(path)
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)
