"""The disk tier's sweeps: expiry, budget, purges, verification, compaction, and the background sweeper.

Safe beside writers in this and other processes: deletions go in small transactions (a server's writer
is never starved), each decision is taken in the transaction that acts on it, and space is released
only after the commit that freed it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable

from tierkv.codec import check_stored
from tierkv.cpus import spread_here
from tierkv.errors import RecordError
from tierkv.keys import BlockKey
from tierkv.metrics import Counters
from tierkv.priority import background_priority
from tierkv.tiers.disk.index import EVICTION_ORDER, Index, Txn
from tierkv.tiers.disk.schema import TIME, DryCount, Entry, Hole, SweepReport, time_key, time_of
from tierkv.tiers.disk.segments import SegmentDir, aligned

__all__ = ["DEFAULT_SWEEP_INTERVAL_S", "Progress", "SWEEP_BATCH", "Sweeper", "Sweeps"]

log = logging.getLogger("tierkv.disk")

SWEEP_BATCH = 256  # deletions per transaction
PURGE_SCAN = 4096  # index entries a purge looks at per transaction (it holds LMDB's write lock meanwhile)
DEFAULT_SWEEP_INTERVAL_S = 300.0  # a server's own expiry and budget sweep
Progress = Callable[[int], None] | None
STOP = object()  # a walk's verdict: this row and all after it stay


class Sweeps:
    def __init__(self, index: Index, segments: SegmentDir, counters: Counters) -> None:
        self.index = index
        self.segments = segments
        self.counters = counters

    def seal_dead_writers(self) -> None:
        """Segments left open by a writer that died are sealed, so they can be freed once empty.

        A writer holds an flock on its open segment for its whole life, so "dead" is "unlocked": true
        across PID namespaces and containers, unlike a pid check."""

        def seal(txn: Txn) -> list[int]:
            emptied = []
            for seg_id, row in self.index.segment_rows(txn).items():
                if (
                    not row[3]
                    and not self.segments.is_active(seg_id)
                    and self.index.seal_segment(txn, seg_id)
                ):
                    emptied.append(seg_id)
            return emptied

        for seg_id in self.index.write(seal):
            self.segments.unlink(seg_id)

    def _sweep(
        self,
        table: str,
        stop: Callable[[Txn, float, bytes], bool],
        dry_run: bool,
        progress: Progress,
        counted: DryCount | None = None,
    ) -> tuple[int, int]:
        """Delete from the oldest end of a time table until ``stop(txn, time_s, key)``; as ``_walk``."""
        return self._walk(
            table, lambda txn, t, key, _e: STOP if stop(txn, t, key) else None, dry_run, progress, counted
        )

    def _walk(
        self,
        table: str,
        decide: Callable[[Txn, float, bytes, Entry | None], Entry | object | None],
        dry_run: bool,
        progress: Progress,
        counted: DryCount | None = None,
    ) -> tuple[int, int]:
        """Walk a time table from its oldest end; per row ``decide(txn, time_s, key, entry)`` says
        ``STOP``, None (remove the entry) or a new entry for it (which leaves this table: a pin or a
        retention that ended). Returns how many entries were removed and the bytes given back
        (``SegmentDir.release``). A dry run removes nothing and counts what it would remove, the
        records' bytes, each block once across the walks sharing ``counted``."""
        db = self.index.db
        if dry_run:
            n = nbytes = 0
            counted = DryCount() if counted is None else counted
            with self.index.read() as txn:
                for tkey, _ in txn.cursor(db=db[table]):
                    key = bytes(tkey[TIME.size :])
                    raw = txn.get(key, db=db["index"])
                    e = Entry.unpack(raw) if raw else None
                    verdict = decide(txn, time_of(tkey), key, e)
                    if verdict is STOP:
                        break
                    if verdict is None and e is not None and counted.add(key, e):
                        n += 1
                        nbytes += e.footprint
            return n, nbytes

        def batch(txn: Txn) -> tuple[int, list[Hole]]:
            holes: list[Hole] = []
            n = 0
            cur = txn.cursor(db=db[table])
            while n < SWEEP_BATCH and cur.first():
                tkey = bytes(cur.key())
                key = tkey[TIME.size :]
                raw = txn.get(key, db=db["index"])
                e = Entry.unpack(raw) if raw is not None else None
                verdict = decide(txn, time_of(tkey), key, e)
                if verdict is STOP:
                    break
                n += 1
                if e is None or _row_of(table, key, e) != (table, tkey):  # a stale row: drop it
                    txn.delete(tkey, db=db[table])
                elif verdict is None:
                    holes.append((*e.location, self.index.remove(txn, key, e)))
                else:
                    assert isinstance(verdict, Entry) and verdict.time_row(key)[0] != table
                    self.index.replace(txn, key, e, verdict)
            return n, holes

        removed = freed = 0
        while True:
            n, holes = self.index.write(batch)
            freed += self.segments.release(holes)
            removed += len(holes)
            if progress:
                progress(n)
            if n < SWEEP_BATCH:
                return removed, freed

    def expire(
        self,
        now: float,
        *,
        ttl_s: float | None = None,
        max_age_s: float | None = None,
        dry_run: bool = False,
        progress: Progress = None,
        counted: DryCount | None = None,
    ) -> SweepReport:
        """Delete blocks idle longer than ``ttl_s`` (or their own retention, if longer) or older than
        ``max_age_s`` (defaults: the policy); pins that ended return their blocks to the other classes.
        ``counted``: a dry run's count so far (``DryCount``)."""
        policy = self.index.policy
        ttl_s = policy.ttl_s if ttl_s is None else ttl_s
        max_age_s = policy.max_age_s if max_age_s is None else max_age_s
        rules = dataclasses.replace(policy, ttl_s=ttl_s, max_age_s=max_age_s)

        def lapsed(
            end: Callable[[Entry], Entry],
        ) -> Callable[[Txn, float, bytes, Entry | None], Entry | object | None]:
            def decide(_txn: Txn, t: float, _key: bytes, e: Entry | None) -> Entry | object | None:
                if t >= now:
                    return STOP
                if e is None:
                    return None  # (a stale row: dropped)
                ended = end(e)
                return None if rules.expired(ended, now) else ended

            return decide

        counted = DryCount() if counted is None else counted  # a dry run's: each block once
        unpin, unretain = (
            lapsed(lambda e: dataclasses.replace(e, pin_until_s=0.0)),
            lapsed(lambda e: dataclasses.replace(e, retain_s=0.0)),
        )
        done = [
            self._walk("pinned", unpin, dry_run, progress, counted),
            self._walk("retained", unretain, dry_run, progress, counted),
        ]
        if ttl_s is not None:
            done.append(
                self._sweep("atime", lambda _txn, t, _k: now - t <= ttl_s, dry_run, progress, counted)
            )
        if max_age_s is not None:
            done.append(
                self._sweep("ctime", lambda _txn, t, _k: now - t <= max_age_s, dry_run, progress, counted)
            )
        n = sum(removed for removed, _ in done)
        self.counters.add("disk", "expirations", n)
        return SweepReport(expired=n, freed_nbytes=sum(nbytes for _, nbytes in done))

    def enforce_budget(
        self,
        budget_nbytes: int | None = None,
        *,
        dry_run: bool = False,
        progress: Progress = None,
        counted: DryCount | None = None,
    ) -> SweepReport:
        """Evict in ``Index.evict_over``'s order (never a pinned block) until the live bytes fit.
        ``counted``: a dry run's count so far (``DryCount``): those blocks are gone already."""
        budget = self.index.policy.budget_nbytes if budget_nbytes is None else budget_nbytes
        if budget is None:
            return SweepReport()
        counted = DryCount() if counted is None else counted
        freed = [0]
        dry_total = [-1]

        def stop(txn: Txn, _t: float, key: bytes) -> bool:  # a dry run's: nothing is deleted
            if dry_total[0] < 0:
                dry_total[0] = self.index.total_nbytes(txn) - counted.nbytes  # after the steps before
            if dry_total[0] - freed[0] <= budget:
                return True
            if key in counted.keys:
                return False  # gone already (an earlier step's)
            raw = txn.get(key, db=self.index.db["index"])
            freed[0] += Entry.unpack(raw).footprint if raw else 0
            return False

        def evict(txn: Txn) -> list[Hole]:
            return self.index.evict_over(txn, budget, max_blocks=SWEEP_BATCH)

        n = 0
        if not dry_run and self.index.has_quotas():
            fixed = self.index.tenants.reconcile()
            if fixed:
                log.warning(
                    "disk tier: the usage of %d tenants had drifted (an older build writing?): fixed", fixed
                )

        def over_quota(txn: Txn) -> list[Hole]:
            total = self.index.total_nbytes(txn)
            return self.index.tenants.evict_over_quota(txn, total, budget, SWEEP_BATCH)[0]

        while not dry_run:  # tenants above their quota first (a dry run counts the store-wide order only)
            holes = self.index.write(over_quota)
            freed[0] += self.segments.release(holes)
            n += len(holes)
            if not holes:  # none above its quota (or a batch that only mended rows: the next sweep goes on)
                break
        if dry_run:  # counted in time order: as many blocks as leaves first would take, near enough
            n += sum(self._sweep(table, stop, dry_run, progress, counted)[0] for table in EVICTION_ORDER)
        while not dry_run:  # in ``Index.evict_over``'s order: leaves before their prefixes
            holes = self.index.write(evict)
            freed[0] += self.segments.release(holes)
            n += len(holes)
            if progress:
                progress(len(holes))
            if len(holes) < SWEEP_BATCH:
                break
        self.counters.add("disk", "evictions", n)
        return SweepReport(evicted=n, freed_nbytes=freed[0])

    def remove_at(self, found: list[tuple[bytes, tuple[int, int, int]]], progress: Progress = None) -> int:
        """Remove the records found at these locations (not what may have replaced them), in batches."""
        n = 0
        for start in range(0, len(found), SWEEP_BATCH):
            part = found[start : start + SWEEP_BATCH]
            holes = self.index.remove_at(part)
            self.segments.release(holes)
            n += len(holes)
            if progress:
                progress(len(part))
        return n

    def purge_namespace(
        self,
        digest: bytes | None,
        *,
        dry_run: bool = False,
        progress: Progress = None,
        counted: DryCount | None = None,
    ) -> SweepReport:
        """Delete every block of one namespace (``None``: of all namespaces).

        Each batch is found and removed in one write transaction, walking the index in key order: a
        record any writer committed before the purge began is seen by it (LMDB serialises write
        transactions), where a scan in read transactions could miss one committed just behind it. (The
        store's own saves still on their way are dropped by their writer: ``write_behind.Generations``.)
        """
        if dry_run:
            counted = DryCount() if counted is None else counted
            before = counted.nbytes
            matching = (
                (k, e) for k, e in self.index.iter_entries() if digest is None or e.ns_digest == digest
            )
            n = sum(counted.add(bytes(k), e) for k, e in matching)
            return SweepReport(purged=n, freed_nbytes=counted.nbytes - before)
        db = self.index.db
        last: bytes | None = None

        def batch(txn: Txn) -> tuple[bytes | None, list[Hole]]:
            cur = txn.cursor(db=db["index"])
            ok = cur.set_range(last + b"\0") if last is not None else cur.first()
            found: list[tuple[bytes, Entry]] = []
            scanned, key = 0, None
            while ok and scanned < PURGE_SCAN and len(found) < SWEEP_BATCH:
                key, e = bytes(cur.key()), Entry.unpack(cur.value())
                if digest is None or e.ns_digest == digest:
                    found.append((key, e))
                scanned += 1
                ok = cur.next()
            holes = [(*e.location, self.index.remove(txn, k, e)) for k, e in found]  # the cursor is done
            return (key if ok else None), holes

        removed = freed = 0
        while True:
            last, holes = self.index.write(batch)
            freed += self.segments.release(holes)
            removed += len(holes)
            if progress and holes:
                progress(len(holes))
            if last is None:
                return SweepReport(purged=removed, freed_nbytes=freed)

    def check(self, *, dry_run: bool = False, progress: Progress = None) -> SweepReport:
        """Read and verify every record (header, tokens, key, payload checksum); purge the bad ones.

        Only records still indexed where they were read count: a sweep or a rewrite that raced the read is
        not corruption, and its replacement is never purged."""
        bad: list[tuple[bytes, tuple[int, int, int]]] = []
        checked = 0
        for key, e in self.index.iter_entries():
            if not self._verifies(key, e):
                bad.append((bytes(key), e.location))
            checked += 1
            if progress:
                progress(1)
        if dry_run:
            found = [loc for k, loc in bad if self.index.still_indexed(BlockKey(k), loc)]
            corrupt, freed = len(found), sum(aligned(n) for _, _, n in found)
        else:  # what punching the records' holes gave back, measured
            before, _ = self.segments.disk_nbytes()
            corrupt = self.remove_at(bad)
            after, _ = self.segments.disk_nbytes()
            freed = max(0, before - after)
        self.counters.add("disk", "corrupt_blocks", corrupt)
        return SweepReport(checked=checked, corrupt=corrupt, freed_nbytes=freed)

    def _verifies(self, key: bytes, e: Entry) -> bool:
        # Views into the reused read buffer must not outlive the lock (it may be replaced): they live in
        # _record_ok's frame only.
        failed: set[tuple[int, int, int]] = set()
        with self.segments.read_lock:
            ok = _record_ok(key, e, self.segments.read([e.location], failed)[0])
        if failed:  # unreadable (EIO): purged like a corrupt record, and counted as what it is too
            self.counters.add("disk", "read_errors")
        return ok

    def compact(self, *, dry_run: bool = False) -> SweepReport:
        """Release every byte no live record uses: gaps a crash left, whole orphan files, empty segments.

        Segments whose writer is alive hold its flock: they are never removed, and only gaps before their
        last live record are punched (a writer only appends past its committed records). Which segments
        are inactive is decided *before* the live set is read, in one snapshot: an inactive segment never
        gains a record, so the snapshot is final for it."""
        ids = self.segments.list_ids()
        inactive = {s for s in ids if not self.segments.is_active(s)}
        live: dict[int, list[tuple[int, int]]] = {}
        for _, e in self.index.snapshot_entries():
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
        """Unlink an inactive segment with no live record, and its row (unless the row disagrees)."""

        def drop(txn: Txn) -> bool:
            row = self.index.segment_rows(txn).get(seg_id)
            if row is not None and row[1] > 0:
                return False  # the row disagrees with the snapshot: leave both for a later pass
            if row is not None:
                self.index.seal_segment(txn, seg_id)
            return True

        if self.index.write(drop):
            self.segments.unlink(seg_id)


def _row_of(table: str, key: bytes, e: Entry) -> tuple[str, bytes]:
    """The row ``e`` should have in ``table``'s kind of table: its creation time, or its class's time."""
    return ("ctime", time_key(e.created_s, key)) if table == "ctime" else e.time_row(key)


def _record_ok(key: bytes, e: Entry, view: memoryview) -> bool:
    try:
        return check_stored(view, key).ns_digest == e.ns_digest
    except RecordError:
        return False


class Sweeper:
    """The server's own gc: ``sweep()`` every ``interval_s`` on a thread at nice 19, off the model
    thread; it also seals segments of writers that died, clears stale reader slots and drops read
    descriptors of segments other processes removed."""

    def __init__(self, sweep: Callable[[], SweepReport], sweeps: Sweeps, interval_s: float) -> None:
        self._sweep = sweep
        self._sweeps = sweeps
        self._stop = threading.Event()
        self.interval_s = interval_s
        self._thread = threading.Thread(
            target=self._loop, args=(interval_s,), name="tierkv-disk-sweep", daemon=True
        )
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        spread_here()
        background_priority()
        counters = self._sweeps.counters
        while not self._stop.wait(interval_s):
            try:
                report = self._sweep()
                self._sweeps.seal_dead_writers()  # a crashed neighbour's segment can be freed once empty
                self._sweeps.index.clear_stale_readers()
                self._sweeps.segments.forget_removed()
                if report.expired or report.evicted:
                    log.info("disk sweep: %d expired, %d evicted", report.expired, report.evicted)
                counters.add("disk", "sweeps")
            except Exception:
                log.exception("disk sweep failed (counted; retried next interval)")
                counters.add("disk", "sweep_errors")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
