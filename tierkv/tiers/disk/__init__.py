"""The durable disk tier: an LMDB index (``index.py``, schema in ``schema.py``) over append-only segment
files (``segments.py``), written behind by one thread per process (``writer.py``) and swept by
``sweeps.py``. This module is the façade the store and the CLI use; its write side is ``writes.py``.

Several processes share one directory (workers, an engine's processes, ``tierkv gc``): LMDB serialises
their write transactions, every decision that depends on the index is taken inside the write transaction
that acts on it, and each writing process appends to a segment of its own, flock-held while it lives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from tierkv import native
from tierkv.errors import ConfigError
from tierkv.keys import BlockChain, BlockKey, Namespace, NamespaceDigest
from tierkv.metrics import Counters
from tierkv.tenancy import Quota
from tierkv.tiers.base import Tier
from tierkv.tiers.disk import describe
from tierkv.tiers.disk.access_times import Touch
from tierkv.tiers.disk.index import Index
from tierkv.tiers.disk.opening import read_index_ahead
from tierkv.tiers.disk.pins import check_pin
from tierkv.tiers.disk.read_modes import FILE as READ_SPEEDS_FILE
from tierkv.tiers.disk.read_modes import ReadModes, configured_mode
from tierkv.tiers.disk.schema import (
    ALIGNED_RECORDS_FORMAT_VERSION,
    RETENTION_FORMAT_VERSION,
    STORE_FORMAT_VERSION,
    Entry,
    Policy,
    SweepReport,
)
from tierkv.tiers.disk.segments import SegmentDir
from tierkv.tiers.disk.sweeps import DEFAULT_SWEEP_INTERVAL_S, Progress, Sweeper, Sweeps
from tierkv.tiers.disk.tenant_rows import TenantUsage
from tierkv.tiers.disk.writer import (
    DEFAULT_BATCH_NBYTES,
    DEFAULT_QUEUE_NBYTES,
    DEFAULT_SEGMENT_NBYTES,
    AccessTimes,
    Writer,
)
from tierkv.tiers.disk.writes import DiskWrites
from tierkv.units import env_flag

if TYPE_CHECKING:
    from tierkv.tiers.target import Target

log = logging.getLogger("tierkv.disk")

# What a server reads of its index ahead at start-up (``read_ahead``): an index of about a million blocks.
INDEX_READ_AHEAD_NBYTES = 256 << 20

__all__ = ["DEFAULT_SWEEP_INTERVAL_S", "STORE_FORMAT_VERSION", "DiskTier", "Entry", "Policy", "SweepReport"]

DEFAULT_MAP_NBYTES = 1 << 30  # the index only (about 200 B per block); a sparse file, grown when full


def _quietly(close: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # (the error that stopped the open is the one to raise)
        close()


class DiskTier(DiskWrites, Tier):
    """Durable, content-addressed block store. Thread-safe; one instance per process and directory, any
    number of processes per directory."""

    name = "disk"

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
        direct_reads: bool | None = None,
        direct_writes: bool | None = None,
    ) -> None:
        """``direct_reads``: the native reader reads what the page cache lacks with O_DIRECT, and what it
        holds from it; False: everything buffered with readahead, so that the page cache keeps what was read
        (None: ``TIERKV_DIRECT_READS`` where set, else, where the kernel has cachestat(2), whichever of the
        two this disk serves faster, measured by cold restores (``read_modes.py``); docs/architecture.md). ``direct_writes``: the native writer writes records
        past the page cache, with O_DIRECT, where the file system allows it (None: unless ``TIERKV_DIRECT_WRITES=0``):
        the host tier already holds what was just saved, and the page cache's upkeep of written pages can
        cost more CPU than the copy itself."""
        self.path = Path(path)
        self.clock = clock
        self.counters = counters or Counters()
        self.read_only = not writer
        self.index = Index(
            self.path, map_nbytes=map_nbytes, writer=writer, sync=sync, policy=policy, counters=self.counters
        )
        self.writer: Writer | None = None
        self._sweeper: Sweeper | None = None
        # Until the open is whole, a failed step closes what the earlier ones opened: the index holds the
        # store's owners lock (a writer's segment its own), which a process that goes on would keep.
        with contextlib.ExitStack() as undo:
            undo.callback(_quietly, self.index.close)
            with self.index.read() as txn:
                store_format = self.index.format_version(txn)
            # Records in the newer layout (payload 64-byte aligned) only where no older build shares the store:
            # those refuse a store of format 3. Read at open: an upgrade is made with older builds stopped.
            self.record_version = 2 if store_format >= ALIGNED_RECORDS_FORMAT_VERSION else 1
            # The mode set (and by what), or None: O_DIRECT or buffered, run by run, whichever this disk serves
            # faster (read_modes.py); the note says who set it, or why the default reads buffered.
            direct_reads, self._reads_note = configured_mode(direct_reads)
            self.read_modes = ReadModes(self.path / READ_SPEEDS_FILE, fixed=direct_reads)
            if direct_writes is None:
                direct_writes = env_flag("TIERKV_DIRECT_WRITES", True)
            self.segments = SegmentDir(
                self.path / "segments",
                read_threads=read_threads,
                counters=self.counters,
                direct_reads=direct_reads is not False,
                direct_writes=direct_writes,
                read_modes=self.read_modes,
            )
            undo.callback(_quietly, self.segments.close)
            self.sweeps = Sweeps(self.index, self.segments, self.counters)
            self.times = AccessTimes(self.index, self.counters)
            self._closed = False
            self._transient_logged = False  # a read that failed not for the record's sake: logged once
            self._probed = threading.local()  # .found: this thread's last probe's entries (see probe)
            if writer:
                self.index.clear_stale_readers()
                self.sweeps.seal_dead_writers()
                self.writer = Writer(
                    self.index,
                    self.segments,
                    self.times,
                    clock=clock,
                    sync=sync,
                    counters=self.counters,
                    queue_nbytes=queue_nbytes,
                    batch_nbytes=batch_nbytes,
                    segment_nbytes=segment_nbytes,
                )
                undo.callback(_quietly, self.writer.close)
                if sweep_interval_s > 0:
                    self._sweeper = Sweeper(
                        lambda: self.expire() + self.enforce_budget(), self.sweeps, sweep_interval_s
                    )
                    undo.callback(_quietly, self._sweeper.stop)
            undo.pop_all()  # opened whole: nothing to undo

    @property
    def policy(self) -> Policy:
        return self.index.policy

    # ---------------------------------------------------------------- reads

    def locate(self, keys: Sequence[BlockKey]) -> list[Entry]:
        """Entries of the leading ``keys`` the tier holds, unexpired (the index only: no payload read)."""
        now = self.clock()
        out: list[Entry] = []
        with self.index.read() as txn:
            for key in keys:
                raw = txn.get(key, db=self.index.db["index"])
                if raw is None:
                    break
                e = Entry.unpack(raw)
                if self._expired(key, e, now):
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
        out = self.writer.queued(keys) if self.writer is not None else [False] * len(keys)
        with self.index.read() as txn:
            for i, key in enumerate(keys):
                if not out[i]:
                    raw = txn.get(key, db=self.index.db["index"])
                    out[i] = raw is not None and not self.policy.expired(Entry.unpack(raw), now)
        return out

    @contextlib.contextmanager
    def read(
        self, entries: Sequence[Entry], failed: set[tuple[int, int, int]] | None = None
    ) -> Iterator[list[memoryview]]:
        """The whole records of ``entries``, as views valid inside the ``with`` block only (zeros for one
        that cannot be read; with an I/O error its location is added to ``failed``)."""
        with self.segments.read_lock:
            yield self.segments.read([e.location for e in entries], failed) if entries else []

    def read_scatter(
        self,
        requests: Sequence[tuple[Entry, list[memoryview]]],
        verify: Callable[[int], bool] | None = None,
        failed: set[tuple[int, int, int]] | None = None,
    ) -> list[bool]:
        """Scatter each record into its destination views; ``verify(i)`` runs on the reading thread. The
        locations of records an I/O error hit are added to ``failed``."""
        return self.segments.readv([(*e.location, views) for e, views in requests], verify, failed)

    # ---------------------------------------------------------------- the Tier calls

    def probe(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        now = self.clock()
        found: dict[BlockKey, Entry] = {}
        keys = [chain.keys[i] for i in idx]
        with self.index.read() as txn:
            db = self.index.db["index"]
            raws = [txn.get(key, db=db) for key in keys]
        # One pass, no call per block on the common path (a restore probes every block of a prompt).
        # Without a TTL or a maximum age nothing expires: what a hit or a request adds only extends them.
        expiring = self.policy.ttl_s is not None or self.policy.max_age_s is not None
        pendings = self.times.last_many(keys) if expiring else [None] * len(keys)
        for key, e, pending in zip(keys, Entry.unpack_many(raws), pendings):
            if e is None:
                continue
            if expiring and self._expired_after(e, pending, now):
                continue
            found[key] = e
        out = [key in found for key in keys]
        # A restore probes, then reads what it found on the same thread: the read reuses these entries
        # instead of reading the index again (a record changed since is caught by its verification).
        self._probed.found = (chain.keys, found)
        return out

    def _located(self, chain: BlockChain, first: int, count: int) -> list[Entry]:
        keys, found = getattr(self._probed, "found", (None, {}))
        self._probed.found = (None, {})
        if keys is chain.keys:
            entries = []
            for key in chain.keys[first : first + count]:
                e = found.get(key)
                if e is None:
                    break
                entries.append(e)
            if len(entries) == count:
                return entries
        return self.locate(chain.keys[first : first + count])

    def _expired(self, key: BlockKey, e: Entry, now: float) -> bool:
        return self._expired_after(e, self.times.last(key), now)

    def _expired_after(self, e: Entry, pending: Touch | None, now: float) -> bool:
        """``e`` expired, counting ``pending`` (its hits and retention not written yet)."""
        if pending is not None:
            e.last_access_s = max(e.last_access_s, pending.t)
            e.retain_s = max(e.retain_s, pending.retain_s)
        return self.policy.expired(e, now)

    def read_into(self, chain: BlockChain, first: int, count: int, target: Target) -> int:
        """Records verified on the reading threads; a bad one (or one an I/O error hit) ends the run and
        is purged, if still indexed: a sweep in another process may have released it meanwhile, and then
        it is a plain miss."""
        from tierkv.tiers.disk.reader import read_into  # torch: not for the shell tools

        return read_into(self, chain, first, count, target)

    def check_pin(self, chain: BlockChain, count: int, record_nbytes: int) -> None:
        """Raise ``PinBudgetError`` unless pinning blocks ``0..count-1`` of ``chain`` fits in the pin
        budget (``pins.check_pin``)."""
        check_pin(self, chain, count, record_nbytes)

    def drop(self, ns: NamespaceDigest | None) -> int:
        return self.purge_namespace(ns).purged

    def format_version(self) -> int:
        """The store's format version now (``schema.py``: another process may have upgraded it)."""
        with self.index.read() as txn:
            return self.index.format_version(txn)

    def retention_enabled(self) -> bool:
        """Whether blocks here can hold a retention or a pin: a store of format 2 or 3 (a format-1 store may be
        shared with older builds, which could not read such an entry: ``tierkv gc --upgrade``)."""
        with self.index.read() as txn:
            return self.index.format_version(txn) >= RETENTION_FORMAT_VERSION

    def check_retention(self) -> None:
        """ConfigError (with the way out) unless ``retention_enabled``."""
        if not self.retention_enabled():
            raise ConfigError(
                f"the cache directory {self.path} is format 1 (older tierkv builds may share it): retention "
                "and pins need `tierkv gc --upgrade --cache-dir DIR` (stop older builds first)"
            )

    def stats(self) -> dict[str, int]:
        usage = self.usage()
        queued = self.writer.queued_nbytes if self.writer is not None else 0
        seg = self.segments
        return {
            **usage,
            "used_nbytes": usage["live_nbytes"],
            "capacity_nbytes": usage["budget_nbytes"],
            "write_queue_nbytes": queued,
            **self.read_modes.gauges(native.enabled() and seg.direct_reads and seg.direct_ok),
        }

    def still_indexed(self, key: BlockKey, location: tuple[int, int, int]) -> bool:
        return self.index.still_indexed(key, location)

    def totals(self) -> dict[NamespaceDigest, tuple[int, int]]:
        return self.index.totals()

    def namespaces(self) -> dict[NamespaceDigest, Namespace]:
        return self.index.namespaces()

    def iter_entries(self) -> Iterator[tuple[BlockKey, Entry]]:
        return self.index.iter_entries()

    def set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        """The tenants' quotas (by tenant id): stored, so every process here evicts by them."""
        if not self.read_only:
            self.index.tenants.set_quotas(quotas)

    def stored_quotas(self) -> dict[bytes, Quota]:
        """The tenants' quotas as last stored here (by any process)."""
        with self.index.read() as txn:
            return dict(self.index.tenants.quotas(txn))

    def tenant_usage(self) -> dict[bytes, dict[str, int]]:
        return {
            tid: {"disk_nbytes": u[1], "pinned_nbytes": u[3]}
            for tid, (u, _) in self.tenants().items()
            if u[0]
        }

    def tenants(self) -> dict[bytes, tuple[TenantUsage, Quota | None]]:
        """Per tenant id, its (blocks, nbytes, pinned blocks, pinned nbytes) here and its quotas."""
        with self.index.read() as txn:
            usage = self.index.tenants.usage(txn)
            quotas = self.index.tenants.quotas(txn)
        return {tid: (usage.get(tid, (0, 0, 0, 0)), quotas.get(tid)) for tid in usage.keys() | quotas.keys()}

    def snapshot_entries(self) -> list[tuple[BlockKey, Entry]]:
        return self.index.snapshot_entries()

    def usage(self) -> dict[str, int]:
        with self.index.read() as txn:
            live = self.index.total_nbytes(txn)
            pinned = self.index.pinned_nbytes(txn)
        allocated, apparent = self.segments.disk_nbytes()
        index_nbytes = sum(p.stat().st_size for p in (self.path / "index").glob("*.mdb"))
        return {
            "live_nbytes": live,
            "segment_allocated_nbytes": allocated,
            "segment_apparent_nbytes": apparent,
            "index_file_nbytes": index_nbytes,
            "budget_nbytes": self.policy.budget_nbytes or 0,
            "pinned_nbytes": pinned,  # never evicted: a budget below it cannot be met until pins end
        }

    def describe(self) -> str:
        """How this tier is set up, in one phrase (the server's start-up line: ``describe.py``)."""
        return describe.setup(self)

    def read_ahead(self, max_nbytes: int = INDEX_READ_AHEAD_NBYTES) -> int:
        """Before the first restore (a server at start-up): the index file read into the page cache by the
        kernel's readahead, up to ``max_nbytes`` (each lookup walks its B-trees: cold, a page read from
        disk at a time), and the reader's modules imported. Returns the index bytes asked for."""
        from tierkv.tiers.disk import reader  # noqa: F401 (imported on the first read otherwise)

        if native.enabled():
            from tierkv.tiers.disk import native_read  # noqa: F401
        return read_index_ahead(self.path, max_nbytes)

    def read_path(self) -> str:
        """Which reader serves this tier: native (O_DIRECT or buffered) or Python, and why."""
        return describe.read_path(self)

    # ---------------------------------------------------------------- maintenance (gc, stats)

    def expire(self, **options: Any) -> SweepReport:
        """Delete blocks idle longer than their TTL or older than the max age: ``Sweeps.expire``'s options
        (``ttl_s``, ``max_age_s``, ``dry_run``, ``progress``, ``counted``), now by this tier's clock."""
        self.times.flush()
        return self.sweeps.expire(self.clock(), **options)

    def enforce_budget(self, budget_nbytes: int | None = None, **options: Any) -> SweepReport:
        """``Sweeps.enforce_budget``, its options (``dry_run``, ``progress``, ``counted``)."""
        return self.sweeps.enforce_budget(budget_nbytes, **options)

    def purge_namespace(self, digest: bytes | None, **options: Any) -> SweepReport:
        """``Sweeps.purge_namespace``, its options (``dry_run``, ``progress``, ``counted``)."""
        return self.sweeps.purge_namespace(digest, **options)

    def check(self, *, dry_run: bool = False, progress: Progress = None) -> SweepReport:
        return self.sweeps.check(dry_run=dry_run, progress=progress)

    def compact(self, *, dry_run: bool = False) -> SweepReport:
        return self.sweeps.compact(dry_run=dry_run)

    def close(self) -> None:
        if self._closed:
            return
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        if self.writer is not None:
            # Saves arriving meanwhile still queue (or are dropped and counted): closed only once done.
            if not self.writer.close():
                self._closed = True
                return  # a stuck writer keeps its segment and the index (see Writer.close)
        else:
            with contextlib.suppress(OSError, lmdb.Error):
                self.times.flush()
        self._closed = True
        if not self.read_only:
            self.read_modes.save()
        self.segments.close()
        self.index.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
