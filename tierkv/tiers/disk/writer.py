"""The disk tier's write-behind: one thread per process appends queued records to this process's own
segment and indexes them, and writes access times, purges and flush barriers in queue order (batch by
batch; within a batch, purges first). A record whose save was purged or invalidated since it was queued
is dropped, not indexed (``Put.live``, checked in the indexing transaction).

Write order: a batch is appended and fdatasync'ed first, then indexed in one LMDB transaction, so after
a crash or a power cut every indexed record is complete; bytes a crash left unindexed are never
referenced and are released by ``gc --compact``. While more batches wait, the next one is appended (on
the appender thread) as this one is indexed: a record is still indexed only after its own fdatasync, and a
batch is done (its saves settled, a flush's barrier passed) only once indexed. A turn's purges may so
run before the batch in flight is indexed: harmless, since a purge names an indexed location only.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import lmdb

from tierkv.errors import NamespaceConflictError
from tierkv.metrics import Counters
from tierkv.priority import background_priority
from tierkv.tiers.batching import BatchQueue
from tierkv.tiers.disk.access_times import AccessTimes
from tierkv.tiers.disk.appender import Appender
from tierkv.tiers.disk.batch_index import evicts, fresh_records, index_batch
from tierkv.tiers.disk.index import Index, Txn
from tierkv.tiers.disk.schema import Hole
from tierkv.tiers.disk.segment_writer import SegmentWriter
from tierkv.tiers.disk.segments import SegmentDir, aligned
from tierkv.tiers.disk.write_items import Appending, Barrier, Item, Purge, Put, Record

__all__ = [
    "Barrier",
    "DEFAULT_BATCH_NBYTES",
    "DEFAULT_QUEUE_NBYTES",
    "DEFAULT_SEGMENT_NBYTES",
    "DEGRADED_RETRY_S",
    "FLUSH_TIMEOUT_S",
    "Item",
    "Purge",
    "Put",
    "Record",
    "TOUCH_FLUSH_INTERVAL_S",
    "Writer",
]

log = logging.getLogger("tierkv.disk")


DEFAULT_SEGMENT_NBYTES = 1 << 30  # roll to a new file past this; a fully dead file is unlinked
DEFAULT_BATCH_NBYTES = 64 << 20  # one fdatasync + one commit per batch: amortises the sync cost
DEFAULT_QUEUE_NBYTES = 1 << 30  # write-behind bound; past it saves are dropped (a future miss only)
TOUCH_FLUSH_INTERVAL_S = 1.0  # access times are coalesced in memory and written at most this often
DEGRADED_RETRY_S = 5.0  # after a write error (full disk) the tier drops writes this long, then retries
FLUSH_TIMEOUT_S = 120.0  # flush() (and so SIGTERM) never waits longer for the writer


class Writer:
    def __init__(
        self,
        index: Index,
        segments: SegmentDir,
        times: AccessTimes,
        *,
        clock: Callable[[], float],
        sync: bool,
        counters: Counters,
        queue_nbytes: int = DEFAULT_QUEUE_NBYTES,
        batch_nbytes: int = DEFAULT_BATCH_NBYTES,
        segment_nbytes: int = DEFAULT_SEGMENT_NBYTES,
    ) -> None:
        self.index = index
        self.segments = segments
        self.times = times
        times.writing = self.pending  # a hit on a block still on its way here waits for it
        self.clock = clock
        self.sync = sync
        self.counters = counters
        self.queue_nbytes = queue_nbytes
        self.batch_nbytes = batch_nbytes
        self.segment_nbytes = segment_nbytes
        self.segment: SegmentWriter | None = None  # this process's own, flock-held while it lives
        self._queued_nbytes = 0
        self._queued_keys: dict[bytes, Put] = {}  # keys in the queue: a second save is not queued
        self._lock = threading.Lock()
        self._degraded_until = 0.0
        self._degraded = False  # in a failure episode (logged once)
        # Background persistence must not slow the model down (measured: a server with no cache hits was 9
        # to 16% slower than with the cache off with the writer at nice 0 or 10, on 2 cores). The thread's
        # Python runs at nice 19; its byte work (checksums, writes, syncs) runs in the native writer at
        # SCHED_IDLE, without the GIL (priority.py says why never Python at idle priority).
        self._appender = Appender("tierkv-disk-append")
        self._in_flight: Appending | None = None  # the batch being appended, indexed by the next turn
        try:
            self._batches: BatchQueue[Item] = BatchQueue(
                "tierkv-disk-writer",
                self._handle,
                item_nbytes=lambda i: i.nbytes,
                batch_nbytes=batch_nbytes,
                idle_s=TOUCH_FLUSH_INTERVAL_S,
                on_idle=lambda: self._guarded(self.times.flush),
                on_start=background_priority,
                on_stop=self._finish_in_flight,
            )
        except BaseException:  # (no thread left behind: a failed open is retried, a pids limit is hit again)
            self._appender.stop(5.0)
            raise
        self.thread = self._batches.thread
        # Called on the writer thread after each batch while the queue has room: the write-behind refills
        # it from the host tier's dirty blocks (write-back).
        self.on_room: Callable[[], object] | None = None

    # ---------------------------------------------------------------- callers' side

    def put(self, item: Put, full_ok: bool = False) -> bool | None:
        """Queue a record; False (a dropped save, counted) when full, degraded or the writer is gone.
        With ``full_ok`` a full queue returns None instead, counting nothing (the caller keeps the block
        to write back later)."""
        with self._lock:
            if not self.thread.is_alive():
                self._note_gone()
                self.counters.add("disk", "dropped_saves")
                return False
            queued = self._queued_keys.get(item.key)
            if queued is not None and queued.is_live():  # already on its way: nothing to do
                if item.release is not None:
                    item.release()
                return True
            degraded = time.monotonic() < self._degraded_until
            if not degraded and self._queued_nbytes + item.nbytes > self.queue_nbytes and full_ok:
                return None
            if degraded or self._queued_nbytes + item.nbytes > self.queue_nbytes:
                self.counters.add("disk", "dropped_saves")
                return False
            self._queued_nbytes += item.nbytes
            self._queued_keys[item.key] = item
        self._batches.put(item)
        return True

    @property
    def queued_nbytes(self) -> int:
        """Bytes of records waiting for the writer thread (what the queue's budget counts)."""
        return self._queued_nbytes

    def room(self, nbytes: int) -> bool:
        """Whether a put of ``nbytes`` would be queued now."""
        with self._lock:
            return (
                self.thread.is_alive()
                and time.monotonic() >= self._degraded_until
                and self._queued_nbytes + nbytes <= self.queue_nbytes
            )

    @property
    def healthy(self) -> bool:
        """Alive and not degraded: a put may be queued now or once the queue has room."""
        return self.thread.is_alive() and time.monotonic() >= self._degraded_until

    @property
    def accepting(self) -> bool:
        """Whether a put now could be queued (alive, not degraded, the queue not full): else callers need
        not copy blocks for it."""
        with self._lock:
            return (
                self.thread.is_alive()
                and time.monotonic() >= self._degraded_until
                and self._queued_nbytes < self.queue_nbytes
            )

    def queued(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: a live save of it is queued (one purged or invalidated since will be dropped)."""
        with self._lock:
            items = [self._queued_keys.get(bytes(k)) for k in keys]
        return [p is not None and p.is_live() for p in items]

    def pending(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: a save of it is queued or being written, live or not."""
        with self._lock:
            return [bytes(k) in self._queued_keys for k in keys]

    def purge(self, item: Purge) -> bool:
        if not self.thread.is_alive():
            return False
        self._batches.put(item)
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far is done (records durable, access times written).

        Never waits for ever (False, logged, after ``timeout_s`` or when the writer is gone), and never
        opens a transaction on the caller's thread: LMDB's write lock may be held by another process."""
        if self.thread.is_alive():
            self._batches.put(Barrier())
        if self._batches.join(timeout_s):
            return True
        log.warning(
            "disk tier flush: %d queued writes not done (%s)",
            self._batches.pending,
            "timed out" if self.thread.is_alive() else "writer thread gone",
        )
        return False

    def close(self) -> bool:
        """Stop the thread and seal this process's segment. False if the thread is stuck: then its segment
        and the index stay open (closing them would pull them from under a live append or commit)."""
        self.flush(FLUSH_TIMEOUT_S)
        if not self._batches.stop(FLUSH_TIMEOUT_S):
            log.error(
                "disk tier writer still busy after %.0f s: its segment and the index stay open until "
                "the process exits",
                FLUSH_TIMEOUT_S,
            )
            return False
        if not self._appender.stop(FLUSH_TIMEOUT_S):  # a write still running (the writer thread died)
            log.error(
                "disk tier: a segment write still busy after %.0f s: its segment stays open until the "
                "process exits",
                FLUSH_TIMEOUT_S,
            )
            return False
        seg = self.segment
        if seg is not None:
            try:
                if self.index.write(lambda txn: self.index.seal_segment(txn, seg.seg_id)):
                    self.segments.unlink(seg.seg_id)
            except (OSError, lmdb.Error) as exc:
                log.warning("disk tier: could not seal segment %d at close: %s", seg.seg_id, exc)
            seg.close()
        return True

    # ---------------------------------------------------------------- the thread

    def _handle(self, items: list[Item]) -> None:
        """One batch: purges, records appended and indexed, then access times. Purges first: each names the
        location it found bad, never a record written since, and a save of the same block in this batch
        (the caller recomputed it) must not be skipped as already stored, then lose to the purge."""
        purges = [(i.key, i.location) for i in items if isinstance(i, Purge)]
        if purges:
            self._guarded(lambda: self.segments.release(self.index.remove_at(purges)))
        puts = [i for i in items if isinstance(i, Put)]
        self._guarded(self._write_batch, puts)
        # The batch appending now is indexed on the next turn, while the batch after it is appended; now
        # if no batch is waiting, or a flush waits for it.
        if not self._batches.waiting or any(isinstance(i, Barrier) for i in items):
            self._finish_in_flight()
        self._guarded(self.times.flush)
        if self.on_room is not None and self.accepting:
            self._guarded(self.on_room)

    def _guarded(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a step; nothing it raises may kill the writer thread (a lost batch is only future misses)."""
        try:
            fn(*args)
        except (OSError, lmdb.Error) as exc:  # a full disk, say: degrade, retry later
            self._degrade(exc, 0)
        except Exception:
            log.exception("disk tier writer: unexpected error (counted; the writer goes on)")
            self.counters.add("disk", "write_errors")

    def _note_gone(self) -> None:
        if not self._degraded:
            self._degraded = True
            log.error("disk tier writer thread is gone: saves are dropped and counted (host-only caching)")

    def _segment_for(self, incoming_nbytes: int) -> SegmentWriter:
        seg = self.segment
        if seg is not None and seg.end + incoming_nbytes <= self.segment_nbytes:
            return seg
        # The batch in flight is indexed first: sealing its segment before would count it empty.
        self._finish_in_flight()
        seg_id = self.index.allocate_segment()
        # The file exists (locked) before its row: a process that sees the row unlocked knows it is dead.
        new = SegmentWriter(self.segments, seg_id, sync=self.sync)

        def register(txn: Txn) -> bool:
            self.index.add_segment_row(txn, seg_id)
            return seg is not None and self.index.seal_segment(txn, seg.seg_id)

        try:
            emptied = self.index.write(register)
        except BaseException:
            new.close()
            raise
        if seg is not None:
            seg.close()
            if emptied:
                self.segments.unlink(seg.seg_id)
        self.segment = new
        return new

    def _write_batch(self, puts: list[Put]) -> None:
        """Start appending a batch's records, then index the batch appended before it."""
        if not puts:
            return
        appending = None
        try:
            if time.monotonic() < self._degraded_until:
                self.counters.add("disk", "dropped_saves", len(puts))
            else:
                appending = self._write_fresh(puts)
        except (OSError, lmdb.Error) as exc:  # the index unreadable, say: the batch is lost, counted
            self._degrade(exc, len(puts))
        except Exception:
            self._lost_to_a_bug(len(puts))
        finally:
            prev, self._in_flight = self._in_flight, appending
            try:
                if appending is None:
                    self._settle(puts)
            finally:
                if prev is not None:
                    self._finish(prev)

    def _settle(self, puts: list[Put]) -> None:
        """A batch done (indexed, skipped or dropped): out of the queue's bound, its buffers released."""
        self.times.requeue([p.key for p in puts])  # retention asked for them before they were indexed
        with self._lock:
            self._queued_nbytes -= sum(p.nbytes for p in puts)
            for p in puts:
                if self._queued_keys.get(p.key) is p:  # not a later save of the key (this one died)
                    del self._queued_keys[p.key]
        for p in puts:
            if p.release is not None:
                p.release()

    def _finish_in_flight(self) -> None:
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            self._finish(prev)

    def _finish(self, a: Appending) -> None:
        """Wait for a batch's append, index it, settle it. Raises nothing (its steps are guarded)."""
        try:
            self._guarded(self._index_appended, a)
        finally:
            self._settle(a.puts)

    def _write_fresh(self, puts: list[Put]) -> Appending | None:
        """Records not stored yet: their segment space taken and their append started (None: none)."""
        fresh = fresh_records(self.index, puts, self.clock())
        if not fresh:
            return None
        records = [p.record for p in fresh]
        try:
            seg = self._segment_for(sum(aligned(p.record_nbytes) for p in fresh))
            start, offsets = seg.reserve(records)
        except (OSError, lmdb.Error) as exc:
            self._degrade(exc, len(fresh))
            return None
        nbytes = seg.end - start
        job = self._appender.submit(lambda: seg.write(start, nbytes, records))
        return Appending(puts, fresh, seg, start, nbytes, offsets, job)

    def _index_appended(self, a: Appending) -> None:
        fresh, seg, nbytes = a.fresh, a.seg, a.nbytes
        # A write or sync of this file failed while this run was in flight: that sync may have taken this
        # run's writeback error (reported once per file), which this run's own sync would then not report.
        beside = a.start < seg.failed_below
        try:
            a.job.result()
            if not beside:
                seg.sync_data()  # in order: one batch's sync before the next's, each before its commit
        except (OSError, lmdb.Error) as exc:
            self._degrade(exc, len(fresh))
            seg.failed_below = seg.end  # the runs in flight, reserved after this one, fail too
        except Exception:  # not the disk's (a bug in a write's arguments, say): this batch only, counted
            self._lost_to_a_bug(len(fresh))
        else:
            if not beside:
                return self._index_synced(a)
            self.counters.add("disk", "dropped_saves", len(fresh))
        if seg.end == a.start + nbytes:  # the last reserved (none in flight): its space is taken again
            seg.end = seg.failed_below = a.start
        self.segments.release([(seg.seg_id, a.start, nbytes, False)])  # a failed native write punched it

    def _index_synced(self, a: Appending) -> None:
        fresh, seg, offsets = a.fresh, a.seg, a.offsets
        budget = self.index.policy.budget_nbytes
        if budget is not None and evicts(self.index, fresh, budget):
            # The hits not written yet, before this batch's eviction reads the access times: without them,
            # a block hit while the batch was written was evicted as if it had not been.
            self._guarded(self.times.flush)
        # and the batch's own (hits while it was queued: not in the index yet, they wait in ``times``)
        touched = self.times.last_many([p.key for p in fresh])

        def index(txn: Txn) -> tuple[list[Hole], list[Hole], int]:
            return index_batch(self.index, txn, fresh, offsets, seg.seg_id, self.clock(), touched)

        try:
            holes, unused, evicted = self.index.write(index)
        except Exception as exc:  # not committed (index full, say): the appended bytes are orphans
            if isinstance(exc, (lmdb.Error, NamespaceConflictError)):
                self._degrade(exc, len(fresh))
            else:
                self._lost_to_a_bug(len(fresh))
            self.segments.release(
                [(seg.seg_id, off, p.record_nbytes, False) for p, off in zip(fresh, offsets)]
            )
            return
        if self._degraded:
            self._degraded = False
            log.warning("disk tier writes resumed")
        self.counters.add("disk", "blocks_written", len(fresh) - len(unused))
        self.counters.add(
            "disk", "bytes_written", sum(p.record_nbytes for p in fresh) - sum(h[2] for h in unused)
        )
        self.counters.add("disk", "evictions", evicted)
        self.segments.release(holes + unused)

    def _lost_to_a_bug(self, dropped: int) -> None:
        """A step failed with what no disk raises (a bug): its batch is lost, counted (flush reports it),
        the writer goes on; the tier is not degraded, since the next batch may well be written."""
        log.exception(
            "disk tier writer: a batch failed unexpectedly (%d saves dropped; the writer goes on)", dropped
        )
        self.counters.add("disk", "write_errors")
        self.counters.add("disk", "dropped_saves", dropped)

    def _degrade(self, exc: Exception, dropped: int) -> None:
        """A write failed (a full disk, say): drop saves for a while, then retry. Logged once per episode."""
        self._degraded_until = time.monotonic() + DEGRADED_RETRY_S
        self.counters.add("disk", "write_errors")
        self.counters.add("disk", "dropped_saves", dropped)
        if not self._degraded:
            self._degraded = True
            nospace = "No space" in str(exc) or (
                isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            )
            log.warning(
                "disk tier write failed (%s): saves are dropped and counted, retrying every %.0f s%s",
                exc,
                DEGRADED_RETRY_S,
                "; the file system is full" if nospace else "",
            )
