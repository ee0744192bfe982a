"""The disk writer's pipeline (writer.py, appender.py): while batches wait, the next one is appended as the
one before it is indexed; a record is indexed only after its own batch's sync (the syncs in order), a flush
waits for all of it, and a failed append loses its batch and the one in flight beside it, no other."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from test_day_two import check_consistent

from tierkv import TieredStore, native
from tierkv.tiers.disk import batch_index, segment_writer, writer
from tierkv.tiers.disk.appender import Appender
from tierkv.tiers.disk.files import ALIGN

from helpers import make_kv, writer_held

PROMPTS = 6


def _toks(p: int, n: int) -> list[int]:
    return [p * 10_000 + t for t in range(n)]


def _prompts(ns, count: int) -> tuple[int, list[torch.Tensor], int]:
    """``count`` prompts' KV of 4 blocks each, and the batch size that makes a batch of each prompt."""
    n = 4 * ns.block_tokens
    kvs = [make_kv(ns, n, seed=p) for p in range(count)]
    return n, kvs, 4 * kvs[0][:, :, : ns.block_tokens].numel() * kvs[0].element_size()


def _reopened_restores_exactly(path, ns, kvs: list[torch.Tensor], hits: list[int]) -> None:
    """After a reopen, each prompt restores the tokens ``hits`` says, each bit-identical to what was saved."""
    with TieredStore.open(path, host_bytes=0) as store:
        for p, kv in enumerate(kvs):
            hit, got = store.restore(ns, _toks(p, kv.shape[2]))
            assert hit.num_tokens == hits[p]
            if hits[p]:
                assert torch.equal(got, kv)


def _logged(monkeypatch, events: list[tuple[str, int, float]], slow_s: float, fail_call: int = 0) -> None:
    """Log each append's start and end and each batch's indexing, by the batch's first file offset; appends
    take ``slow_s`` longer (a slow disk), and append number ``fail_call`` (1-based) fails as a full disk."""
    write, index = segment_writer.SegmentWriter.write, writer.Writer._index_appended
    sync = segment_writer.SegmentWriter.sync_data
    calls = [0]
    indexing = [-1]  # the batch being indexed (its start): the one whose sync comes next
    lock = threading.Lock()

    def slow_write(self, start, reserved_nbytes, records):
        with lock:
            calls[0] += 1
            n = calls[0]
            events.append(("append", start, time.monotonic()))
        time.sleep(slow_s)
        if n == fail_call:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, start, reserved_nbytes, records)
        with lock:
            events.append(("written", start, time.monotonic()))

    def logged_sync(self):
        sync(self)
        with lock:
            events.append(("synced", indexing[0], time.monotonic()))

    def logged_index(self, a):
        indexing[0] = a.start
        index(self, a)
        with lock:
            events.append(("indexed", a.start, time.monotonic()))

    monkeypatch.setattr(segment_writer.SegmentWriter, "write", slow_write)
    monkeypatch.setattr(segment_writer.SegmentWriter, "sync_data", logged_sync)
    monkeypatch.setattr(writer.Writer, "_index_appended", logged_index)


def test_the_next_batch_is_appended_while_the_one_before_it_is_indexed(tmp_path, ns, monkeypatch) -> None:
    events: list[tuple[str, int, float]] = []
    _logged(monkeypatch, events, slow_s=0.05)
    n, kvs, batch_nbytes = _prompts(ns, PROMPTS)
    # a batch per prompt: its 4 blocks
    with TieredStore.open(tmp_path, host_bytes=0, batch_nbytes=batch_nbytes) as store:
        # every save queued before the writer takes the first (on a loaded machine the saves came slower
        # than the writer took them, and no batch was left to append beside another)
        with writer_held(store):
            for p in range(PROMPTS):
                store.save(ns, _toks(p, n), kvs[p])
        assert store.flush() == 0
        at = {(kind, start): t for kind, start, t in events}
        starts = sorted(start for kind, start, _ in events if kind == "append")
        assert len(starts) >= 3
        for s in starts:  # every batch indexed, each only after its write and then its own sync
            assert at["written", s] <= at["synced", s] <= at["indexed", s]
        synced = [start for kind, start, _ in events if kind == "synced"]
        assert synced == starts  # one sync per batch, in order
        # and some batch's append started before the batch before it was indexed
        assert any(at["append", b] < at["indexed", a] for a, b in zip(starts, starts[1:])), events
        check_consistent(store.tier("disk"))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for p in range(PROMPTS):
            hit, got = store.restore(ns, _toks(p, n))
            assert hit.by_tier["disk"] == n and torch.equal(got, kvs[p])


def test_a_failed_append_loses_its_batch_and_the_one_in_flight_beside_it_and_no_other(
    tmp_path, ns, monkeypatch
) -> None:
    """The batch in flight beside a failed one is dropped too: the failed run's sync may have taken its
    writeback error (Linux reports one to a single sync of the file), and its own sync would return 0."""
    events: list[tuple[str, int, float]] = []
    _logged(monkeypatch, events, slow_s=0.05, fail_call=2)
    monkeypatch.setattr(writer, "DEGRADED_RETRY_S", 0.0)  # the batches after it are written, not dropped
    n, kvs, batch_nbytes = _prompts(ns, PROMPTS)
    with TieredStore.open(tmp_path, host_bytes=0, batch_nbytes=batch_nbytes) as store:
        with writer_held(store):  # all queued first: the third batch is in flight beside the second
            for p in range(PROMPTS):
                store.save(ns, _toks(p, n), kvs[p])
        store.flush()
        stats = store.stats()["disk"]
        assert stats["write_errors"] == 1 and stats["dropped_saves"] == 8
        hits = [store.lookup(ns, _toks(p, n)).num_tokens for p in range(PROMPTS)]
        assert hits == [n, 0, 0] + [n] * (PROMPTS - 3)  # the second append's batch and the third's
        check_consistent(store.tier("disk"))
    _reopened_restores_exactly(tmp_path, ns, kvs, hits)


def _save_all(store, ns, kvs, n: int) -> int:
    with writer_held(store):  # all queued first: a writer waking mid-save would cut a prompt's batch
        for p, kv in enumerate(kvs):
            store.save(ns, _toks(p, n), kv)
    return store.flush()


@pytest.mark.parametrize("delta", [ALIGN, -ALIGN], ids=["records-larger", "records-smaller"])
@pytest.mark.parametrize("native_on", [True, False], ids=["native", "python"])
def test_records_that_do_not_fill_their_reservation_exactly_are_refused_before_any_write_and_counted(
    tmp_path, ns, monkeypatch, native_on, delta
) -> None:
    """A run whose records would take other bytes than were reserved for it (larger: they would spill into
    the next run's) is refused before any write: a bug, not the disk, so that batch alone is lost,
    counted, flush says so, and the batches after it are written (the tier is not degraded)."""
    if native_on and not native.enabled():
        pytest.skip(f"native writer not built: {native.reason()}")
    write = segment_writer.SegmentWriter.write
    calls = [0]
    untouched: list[bool] = []

    def misreserved(self, start, reserved_nbytes, records):
        calls[0] += 1
        if calls[0] != 2:
            return write(self, start, reserved_nbytes, records)
        rfd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY)  # the writer's own is write-only
        try:
            write(self, start, reserved_nbytes - delta, records)
        finally:
            untouched.append(not any(os.pread(rfd, reserved_nbytes, start)))  # the run's own range
            os.close(rfd)

    monkeypatch.setattr(segment_writer.SegmentWriter, "write", misreserved)
    n, kvs, batch_nbytes = _prompts(ns, PROMPTS)
    with (
        native.use(native_on),
        TieredStore.open(tmp_path, host_bytes=0, batch_nbytes=batch_nbytes) as store,
    ):
        assert _save_all(store, ns, kvs, n) == 4
        assert untouched == [True]  # nothing of the refused run reached the file
        stats = store.stats()["disk"]
        assert stats["write_errors"] == 1 and stats["dropped_saves"] == 4
        hits = [store.lookup(ns, _toks(p, n)).num_tokens for p in range(PROMPTS)]
        assert hits == [n, 0] + [n] * (PROMPTS - 2)
        check_consistent(store.tier("disk"))
    _reopened_restores_exactly(tmp_path, ns, kvs, hits)


def test_a_failed_last_batch_gives_its_file_range_to_the_next_save_which_restores_exactly(
    tmp_path, ns, monkeypatch
) -> None:
    events: list[tuple[str, int, float]] = []
    _logged(monkeypatch, events, slow_s=0.0, fail_call=PROMPTS)  # the last prompt's batch
    monkeypatch.setattr(writer, "DEGRADED_RETRY_S", 0.0)
    n, kvs, batch_nbytes = _prompts(ns, PROMPTS + 1)
    with TieredStore.open(tmp_path, host_bytes=0, batch_nbytes=batch_nbytes) as store:
        for p in range(PROMPTS):
            with writer_held(store):  # the prompt's blocks all queued: one batch, however late it wakes
                store.save(ns, _toks(p, n), kvs[p])
            store.flush()  # one batch at a time: the last one fails with none beside it
        assert store.stats()["disk"]["dropped_saves"] == 4
        failed_at = [start for kind, start, _ in events if kind == "append"][-1]
        with writer_held(store):
            store.save(ns, _toks(PROMPTS, n), kvs[PROMPTS])
        assert store.flush() == 0
        assert [start for kind, start, _ in events if kind == "written"][-1] == failed_at
        check_consistent(store.tier("disk"))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for p in range(PROMPTS + 1):
            hit, got = store.restore(ns, _toks(p, n))
            assert hit.num_tokens == (0 if p == PROMPTS - 1 else n)
            if hit.num_tokens:
                assert torch.equal(got, kvs[p])


def test_the_appender_runs_jobs_and_stop_joins_its_threads() -> None:
    appender = Appender("test-append")
    ran: list[int] = []
    jobs = [appender.submit(lambda i=i: ran.append(i)) for i in range(5)]
    boom = appender.submit(lambda: (_ for _ in ()).throw(OSError(errno.EIO, "bad sector")))
    for job in jobs:
        job.result()
    try:
        boom.result()
        raise AssertionError("the job's error was not raised")
    except OSError as exc:
        assert exc.errno == errno.EIO
    assert sorted(ran) == list(range(5)) and all(job.fn is None for job in jobs)
    assert appender.stop(5.0) and not any(t.is_alive() for t in appender.threads)
    late = appender.submit(lambda: ran.append(99))  # no thread left: run here
    late.result()
    assert ran[-1] == 99


@pytest.mark.parametrize("step", ["preparing", "writing", "indexing"])
def test_a_bug_while_a_batch_is_prepared_written_or_indexed_loses_that_batch_only_and_is_counted(
    tmp_path, ns, monkeypatch, step
) -> None:
    """A batch that a bug stops while it is prepared (records made, ordered), written or indexed is lost
    alone, counted, and flush says so; the tier is not degraded (the batches after it are written)."""
    from tierkv.tiers.disk import index as index_mod

    target, name, failing_call = {
        "preparing": (batch_index, "by_chain", 2),  # a call a batch
        "writing": (segment_writer.SegmentWriter, "write", 2),
        "indexing": (index_mod.Index, "insert", 5),  # a call a block, 4 blocks a batch
    }[step]
    real = getattr(target, name)
    calls = [0]

    def buggy(*args, **kwargs):
        calls[0] += 1
        if calls[0] == failing_call:  # the second batch
            raise RuntimeError("a bug, not the disk")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, buggy)
    n, kvs, batch_nbytes = _prompts(ns, PROMPTS)
    with TieredStore.open(tmp_path, host_bytes=0, batch_nbytes=batch_nbytes) as store:
        assert _save_all(store, ns, kvs, n) == 4
        stats = store.stats()["disk"]
        assert stats["write_errors"] == 1 and stats["dropped_saves"] == 4
        hits = [store.lookup(ns, _toks(p, n)).num_tokens for p in range(PROMPTS)]
        assert hits == [n, 0] + [n] * (PROMPTS - 2)
        check_consistent(store.tier("disk"))
