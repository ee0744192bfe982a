"""Day two: the store's promises after expiry, beside gc, with several processes, a full map, and
descriptors that accumulate. Each test here failed against the store as it was at 29e5fab."""

import errno
import fcntl
import logging
import os
import subprocess
import sys
import threading
import time

import lmdb
import pytest
import torch

from tierkv import StoreOpenError, TieredStore, block_keys
from tierkv.tiers import disk as disk_mod
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk import segments as segments_mod
from tierkv.tiers.disk.schema import SEG_ID, SEGMENT

from helpers import REPO, gc_beside, make_kv, run_python, writer_held


def _toks(p: int, n: int = 64) -> list[int]:
    return [p * 1000 + t for t in range(n)]


def check_consistent(disk: DiskTier) -> None:
    """Totals and per-segment live counts equal a full scan of the index."""
    by_ns: dict[bytes, list[int]] = {}
    by_seg: dict[int, list[int]] = {}
    for _, e in disk.snapshot_entries():
        row = by_ns.setdefault(e.ns_digest, [0, 0])
        row[0] += 1
        row[1] += e.footprint
        seg = by_seg.setdefault(e.seg_id, [0, 0])
        seg[0] += e.footprint
        seg[1] += 1
    assert disk.totals() == {k: tuple(v) for k, v in by_ns.items()}
    with disk.index.read() as txn:
        rows = {
            SEG_ID.unpack(bytes(k))[0]: SEGMENT.unpack(v) for k, v in txn.cursor(db=disk.index.db["segments"])
        }
    for seg_id, (nbytes, records) in by_seg.items():
        assert rows[seg_id][:2] == (nbytes, records), f"segment {seg_id}"
    for seg_id, row in rows.items():
        if seg_id not in by_seg:
            assert row[:2] == (0, 0), f"segment {seg_id} counts records nobody indexes"


# ------------------------------------------------------------------------------------------ 1: expiry


def test_an_expired_block_is_cached_again_with_exact_totals(tmp_path, ns) -> None:
    now = [1000.0]
    with TieredStore.open(tmp_path, host_bytes=0, ttl_s=60, clock=lambda: now[0]) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        now[0] += 90  # idle past the TTL; nothing swept it
        assert store.lookup(ns, _toks(0)).num_tokens == 0
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        assert store.lookup(ns, _toks(0)).num_tokens == 64
        n, kv = store.load(ns, _toks(0))
        assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=0))
        check_consistent(store.tier("disk"))
        assert store.tier("disk").totals()[ns.digest][0] == 4  # replaced, not added beside the old records
        assert (
            store.tier("disk").usage()["segment_allocated_nbytes"]
            <= store.tier("disk").usage()["live_nbytes"] + 4096
        )


def test_a_server_store_sweeps_on_its_own(tmp_path, ns) -> None:
    now = [1000.0]
    with TieredStore.open(
        tmp_path, host_bytes=0, ttl_s=60, clock=lambda: now[0], sweep_interval_s=0.05
    ) as store:
        for p in range(3):
            store.save(ns, _toks(p), make_kv(ns, 64, seed=p))
        store.flush()
        assert store.tier("disk").totals()[ns.digest][0] == 12
        now[0] += 120
        disk = store.tier("disk")

        def swept() -> bool:  # the space is released after the commit that removed the rows: wait for both
            return (
                not disk.totals()
                and store.stats()["disk"]["sweeps"] >= 1
                and (not disk.segments.list_ids() or disk.usage()["segment_allocated_nbytes"] <= 4096)
            )

        deadline = time.monotonic() + 30  # the sweeper runs at idle priority: slow on a busy machine
        while not swept() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert disk.totals() == {}
        assert store.stats()["disk"]["sweeps"] >= 1
        assert not disk.segments.list_ids() or disk.usage()["segment_allocated_nbytes"] <= 4096


# ------------------------------------------------------------------------------------------ 9: RAM and disk


def test_memory_tiers_apply_the_ttl(tmp_path, ns) -> None:
    now = [1000.0]
    with TieredStore.open(None, host_bytes=1 << 20, ttl_s=60, clock=lambda: now[0]) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        now[0] += 50
        assert store.load(ns, _toks(0))[0] == 64  # a hit refreshes it
        now[0] += 50
        assert store.lookup(ns, _toks(0)).num_tokens == 64
        now[0] += 61
        assert store.lookup(ns, _toks(0)).num_tokens == 0
        assert store.load(ns, _toks(0)) == (0, None)


def test_a_block_served_from_ram_survives_a_restart_after_its_disk_copy_expired(tmp_path, ns) -> None:
    now = [1000.0]
    with TieredStore.open(tmp_path, host_bytes=1 << 20, ttl_s=60, clock=lambda: now[0]) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        for _ in range(4):  # served from RAM every 40 s: RAM and disk copies both stay fresh
            now[0] += 40
            assert store.restore(ns, _toks(0))[0].by_tier["host"] == 64
            store.flush()
        assert store.tier("disk").lookup(block_keys(ns, _toks(0))) == 4
        store.tier("disk").enforce_budget(1)  # `tierkv gc --budget` from cron: the disk copy is gone
        assert store.tier("disk").totals() == {}
        now[0] += 1
        assert store.restore(ns, _toks(0))[0].by_tier["host"] == 64  # RAM still serves it...
        store.flush()  # ...and wrote it back
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))  # a save of a RAM-held prefix writes what disk lost
        store.flush()
        assert store.tier("disk").totals()[ns.digest][0] == 4
    with TieredStore.open(tmp_path, host_bytes=1 << 20, ttl_s=60, clock=lambda: now[0]) as store:
        n, kv = store.load(ns, _toks(0))
        assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=0))


# ------------------------------------------------------------------------------------------ 3: processes

SAVER = """
import sys
from tierkv import Namespace, TieredStore
from helpers import make_kv
ns = Namespace.from_json(sys.argv[1])
with TieredStore.open(sys.argv[2], host_bytes=0, batch_nbytes=16 * 1024) as store:
    print("open", flush=True)
    sys.stdin.readline()  # all processes start saving together
    for p in range(int(sys.argv[3])):
        store.save(ns, [p * 1000 + t for t in range(96)], make_kv(ns, 96, seed=p))
        if p % 5 == 0:
            store.flush()
    store.flush()
    print("segment", store.tier("disk").writer.segment.seg_id if store.tier("disk").writer.segment else -1, flush=True)
"""


def test_several_processes_saving_the_same_prefixes_keep_totals_exact(tmp_path, ns) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, ns.to_json(), str(tmp_path), "60"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "open", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    segs = {int(out.split()[-1]) for out, _ in outs}
    assert len(segs) == 3  # each process appended to its own segment
    with DiskTier(tmp_path) as disk:
        check_consistent(disk)
        assert disk.totals()[ns.digest][0] == 60 * 6  # every block once, whoever wrote it
        assert disk.check().corrupt == 0
    # The budget then evicts exactly what it must: no double-counted bytes.
    with DiskTier(tmp_path) as disk:
        live = disk.totals()[ns.digest][1]
        report = disk.enforce_budget(live // 2)
        assert disk.totals()[ns.digest][1] <= live // 2
        assert disk.totals()[ns.digest][1] > live // 2 - 2 * 4096
        assert report.evicted == 60 * 6 - disk.totals()[ns.digest][0]
        check_consistent(disk)


# ------------------------------------------------------------------------------------------ 2: gc beside a writer

BIG_WRITER = """
import sys, time
from tierkv import Namespace, TieredStore
from helpers import make_kv
ns = Namespace.from_json(sys.argv[1])
prompts = int(sys.argv[3])
with TieredStore.open(sys.argv[2], host_bytes=0, batch_nbytes=96 * 1024, segment_nbytes=2 << 20) as store:
    print("open", flush=True)
    kv = make_kv(ns, 16 * 40, seed=1)
    for p in range(prompts):
        store.save(ns, [p * 1000 + t for t in range(16 * 40)], kv)
        if p % 8 == 7:
            store.flush()
    store.flush()
    print("done", store.stats()["disk"]["blocks_written"], flush=True)
"""


def check_gc_beside_a_writer(tmp_path, ns, prompts: int) -> dict[str, int]:
    """A writer saves ``prompts`` prompts of 40 blocks (many thousands of entries, segments of 2 MiB that
    roll over every ~500 records) while gc runs every option in a loop from other processes."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.Popen(
        [sys.executable, "-c", BIG_WRITER, ns.to_json(), str(tmp_path), str(prompts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "open"
    runs, out = gc_beside(
        proc,
        tmp_path,
        [["--compact"], ["--check"], ["--compact", "--ttl", "1h"], ["--budget", "1TiB", "--compact"]],
    )
    written = int(out.split()[-1])
    assert written == prompts * 40
    kv = make_kv(ns, 16 * 40, seed=1)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        disk = store.tier("disk")
        check_consistent(disk)
        assert disk.totals()[ns.digest][0] == prompts * 40
        for p in range(prompts):  # every prompt whole and exact: compaction destroyed nothing
            n, got = store.load(ns, [p * 1000 + t for t in range(16 * 40)])
            assert n == 16 * 40, f"prompt {p}: {n} tokens"
            assert torch.equal(got, kv)
        assert disk.check().corrupt == 0
        segments_rolled = len({e.seg_id for _, e in disk.snapshot_entries()})
    return {"runs": runs, "entries": written, "segments": segments_rolled}


def test_gc_every_option_beside_a_writer_destroys_nothing(tmp_path, ns) -> None:
    stats = check_gc_beside_a_writer(tmp_path, ns, 160)  # 6400 entries: crosses every 4096 and 256 batch
    print(f"gc beside a writer: {stats}")
    assert stats["runs"] >= 4 and stats["segments"] >= 10


@pytest.mark.slow
def test_gc_every_option_beside_a_writer_long(tmp_path, ns) -> None:
    # 3,000 prompts (120,000 entries): the native writer saves 1,000 in about 10 s, a dozen gc runs'
    # time (a gc run is a process of its own, about a second here), where 20 runs are asked for
    stats = check_gc_beside_a_writer(tmp_path, ns, 3000)
    print(f"gc beside a writer: {stats}")
    assert stats["runs"] >= 20 and stats["segments"] >= 60


def test_compaction_never_touches_a_live_writers_segment_whatever_its_pid(tmp_path, ns) -> None:
    """A server in another PID namespace looks dead to a pid check: liveness is the segment's flock."""
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        seg_id = store.tier("disk").writer.segment.seg_id
        key = SEG_ID.pack(seg_id)
        store.tier("disk").index.write(
            lambda txn: txn.put(
                key,
                SEGMENT.pack(
                    *SEGMENT.unpack(txn.get(key, db=store.tier("disk").index.db["segments"]))[:2],
                    2**31 - 2,
                    0,
                ),
                db=store.tier("disk").index.db["segments"],
            )
        )  # a pid nobody has here
        r = run_python(f"""
            from tierkv.tiers.disk import DiskTier
            with DiskTier({str(tmp_path)!r}) as disk:  # a second writer starting: seals dead writers' segments
                disk.compact()
                disk.purge_namespace(None)  # the segment empties: a sealed one would be unlinked now
        """)
        assert r.returncode == 0, r.stderr
        store.save(ns, _toks(1), make_kv(ns, 64, seed=1))  # appends to the same segment after the gc
        store.flush()
        assert store.tier("disk").writer.segment.seg_id == seg_id
        r = run_python(f"""
            from tierkv.tiers.disk import DiskTier
            with DiskTier({str(tmp_path)!r}) as disk:
                disk.compact()
        """)
        assert r.returncode == 0, r.stderr
        assert store.tier("disk").segments.file(seg_id).exists()
        n, kv = store.load(ns, _toks(1))
        assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=1))


def test_gc_check_purges_the_record_it_read_not_its_replacement(tmp_path, ns) -> None:
    now = [1000.0]
    with TieredStore.open(tmp_path, host_bytes=0, ttl_s=60, clock=lambda: now[0]) as store:
        store.save(ns, _toks(0, 16), make_kv(ns, 16, seed=0))
        store.flush()
        ((_, e),) = store.tier("disk").snapshot_entries()
        path = store.tier("disk").segments.file(e.seg_id)
        data = bytearray(path.read_bytes())
        data[e.offset + e.nbytes - 8] ^= 0xFF
        path.write_bytes(bytes(data))

        def rewrite_after_the_read(_n: int) -> None:  # a writer replaces the (expired) key meanwhile
            now[0] += 90
            store.save(ns, _toks(0, 16), make_kv(ns, 16, seed=0))
            store.flush()

        report = store.tier("disk").check(progress=rewrite_after_the_read)
        assert report.checked == 1 and report.corrupt == 0  # the bad record was already replaced
        n, kv = store.load(ns, _toks(0, 16))
        assert n == 16 and torch.equal(kv, make_kv(ns, 16, seed=0))
        check_consistent(store.tier("disk"))


# ------------------------------------------------------------------------------------------ 4: the map


def test_the_index_map_grows_beside_readers(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path, host_bytes=0, map_nbytes=256 * 1024, batch_nbytes=64 * 1024) as store:
        stop = threading.Event()
        errors: list[BaseException] = []

        def read() -> None:
            while not stop.is_set():
                try:
                    store.lookup(ns, _toks(0, 256))
                    store.tier("disk").totals()
                except BaseException as exc:  # noqa: BLE001 - the test reports any
                    errors.append(exc)
                    return
                time.sleep(0.001)  # busy readers, but not a spin that starves the idle-priority writer

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        for p in range(120):
            store.save(ns, _toks(p, 256), make_kv(ns, 256, seed=p % 3))
        assert store.tier("disk").flush(timeout_s=300)
        stop.set()
        for t in readers:
            t.join()
        assert not errors, errors
        assert store.tier("disk").index.env.info()["map_size"] > 256 * 1024
        assert store.tier("disk").writer.thread.is_alive()
        assert store.tier("disk").totals()[ns.digest][0] == 120 * 16
        assert store.stats()["disk"]["write_errors"] == 0
        check_consistent(store.tier("disk"))


def test_another_process_growing_the_map_is_adopted(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path, host_bytes=0, map_nbytes=256 * 1024) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        r = run_python(
            f"""
            from tierkv import Namespace, TieredStore
            from helpers import make_kv
            ns = Namespace.from_json({ns.to_json()!r})
            with TieredStore.open({str(tmp_path)!r}, host_bytes=0, map_nbytes=256 * 1024) as s:
                for p in range(1, 80):
                    s.save(ns, [p * 1000 + t for t in range(256)], make_kv(ns, 256, seed=0))
        """,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr
        assert store.lookup(ns, _toks(79, 256)).num_tokens == 256  # reads past our old map size
        store.save(ns, _toks(500), make_kv(ns, 64, seed=0))
        assert store.tier("disk").flush(timeout_s=60)
        assert store.lookup(ns, _toks(500)).num_tokens == 64
        check_consistent(store.tier("disk"))


def test_the_writer_survives_any_error_and_flush_never_hangs(tmp_path, ns, monkeypatch, caplog) -> None:
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        real = store.tier("disk").writer._write_fresh
        calls = [0]

        def flaky(puts):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("generator didn't stop after throw()")
            return real(puts)

        monkeypatch.setattr(store.tier("disk").writer, "_write_fresh", flaky)
        with caplog.at_level(logging.ERROR):
            with writer_held(store):  # the save's 4 blocks one batch, however late the writer wakes
                store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
            assert store.tier("disk").flush(timeout_s=30)
        stats = store.stats()["disk"]  # the save's blocks lost, counted
        assert stats["write_errors"] == 1 and stats["dropped_saves"] == 64 // ns.block_tokens
        assert store.tier("disk").writer.thread.is_alive()
        store.save(ns, _toks(1), make_kv(ns, 64, seed=1))
        assert store.tier("disk").flush(timeout_s=30)
        assert store.lookup(ns, _toks(1)).num_tokens == 64
        assert any("writer goes on" in r.message for r in caplog.records)


def test_flush_returns_when_the_writer_is_stuck(tmp_path, ns, monkeypatch) -> None:
    gate = threading.Event()
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        real = store.tier("disk").writer._write_fresh
        monkeypatch.setattr(store.tier("disk").writer, "_write_fresh", lambda puts: (gate.wait(), real(puts)))
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        t0 = time.monotonic()
        assert store.tier("disk").flush(timeout_s=0.5) is False
        assert time.monotonic() - t0 < 5
        gate.set()
        assert store.tier("disk").flush(timeout_s=30)


# ------------------------------------------------------------------------------------------ 5: opening


def test_a_cache_dir_that_is_a_file_says_so_and_is_left_as_it_is(tmp_path) -> None:
    path = tmp_path / "notes.json"
    path.write_text("{}")
    with pytest.raises(StoreOpenError, match="it is a file, not a directory"):
        TieredStore.open(path, host_bytes=0)
    assert path.read_text() == "{}"


def test_a_store_that_cannot_be_opened_is_left_where_it_is(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path / "cache", host_bytes=0) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
    lock = tmp_path / "cache" / "index" / "lock.mdb"
    lock.unlink()
    lock.mkdir()  # not corruption: an environment problem (as permissions or read-only media are)
    with pytest.raises(StoreOpenError, match="cannot open the store"):
        TieredStore.open(tmp_path / "cache", host_bytes=0)
    assert not list(tmp_path.glob("cache.corrupt-*"))
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "stats", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "cannot open the store" in r.stderr
    lock.rmdir()
    with TieredStore.open(tmp_path / "cache", host_bytes=0) as store:  # and the data is all there
        assert store.lookup(ns, _toks(0)).num_tokens == 64


def test_an_open_that_fails_after_the_index_releases_the_owners_lock(tmp_path, ns, monkeypatch) -> None:
    with TieredStore.open(tmp_path / "cache", host_bytes=0) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))

    def no_segment_file(*args, **kwargs):  # as a full disk or a process out of descriptors would
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "Writer", no_segment_file)
    with pytest.raises(OSError, match="No space left"):
        DiskTier(tmp_path / "cache")
    # Nothing of the failed open holds the owners lock: gc, which needs it exclusive, could run.
    fd = os.open(tmp_path / "cache" / "owners.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_an_open_whose_writer_thread_cannot_start_leaves_no_thread_behind(tmp_path, monkeypatch) -> None:
    """The writer starts its append threads, then its batch thread: where the second cannot start (a pids
    limit), the first ended with it (a cold review: two threads were left behind at each failed open)."""
    import threading

    from tierkv.tiers.disk import writer as writer_mod

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(writer_mod, "BatchQueue", no_thread)
    with pytest.raises(RuntimeError, match="start new thread"):
        DiskTier(tmp_path / "cache")
    assert [t.name for t in threading.enumerate() if t.name.startswith("tierkv-disk")] == []
    fd = os.open(tmp_path / "cache" / "owners.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_reader_never_moves_a_damaged_store_aside(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path / "cache", host_bytes=0) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
    with open(tmp_path / "cache" / "index" / "data.mdb", "r+b") as f:
        f.write(os.urandom(8192))
    with pytest.raises(StoreOpenError, match="damaged"):
        DiskTier(tmp_path / "cache", writer=False)
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "stats", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode != 0 and "damaged" in r.stderr
    assert not list(tmp_path.glob("cache.corrupt-*"))


# ------------------------------------------------------------------------------------------ 6: descriptors


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_read_descriptors_are_bounded_and_dropped_when_segments_go(tmp_path, ns, monkeypatch) -> None:
    monkeypatch.setattr(segments_mod, "MAX_READ_FDS", 16)
    with TieredStore.open(tmp_path, host_bytes=0, segment_nbytes=8192) as store:  # a segment every 2 records
        for p in range(40):
            store.save(ns, _toks(p, 32), make_kv(ns, 32, seed=p))
            store.flush()
        base = _fd_count()
        for p in range(40):
            assert store.load(ns, _toks(p, 32))[0] == 32
        assert store.tier("disk").segments.open_fds() <= 16
        assert _fd_count() <= base + 16
        # Another process removes every segment (gc purges all): the cached descriptors pin them no more.
        r = subprocess.run(
            [sys.executable, "-m", "tierkv.cli", "gc", "--cache-dir", str(tmp_path), "--all", "--json"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert store.tier("disk").segments.forget_removed() > 0
        # the writer's own segment (still there) at most: its descriptors with readahead, without, O_DIRECT
        assert store.tier("disk").segments.open_fds() <= 3
        assert store.lookup(ns, _toks(3, 32)).num_tokens == 0


# ------------------------------------------------------------------------------------------ holes


def test_a_file_system_without_hole_punching_is_counted_and_logged_once(
    tmp_path, ns, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(segments_mod, "punch_hole", lambda fd, off, n: False)
    with caplog.at_level(logging.WARNING), TieredStore.open(tmp_path, host_bytes=0) as store:
        for p in range(3):
            store.save(ns, _toks(p), make_kv(ns, 64, seed=p))
        store.flush()
        expired = store.tier("disk").expire(ttl_s=0)
        store.tier("disk").purge_namespace(None)
        assert store.stats()["disk"]["punch_unsupported"] == 12
        # nothing was given back (the writer's segment stays until it empties and is sealed): freed says so
        assert expired.expired > 0 and expired.freed_nbytes == 0
    assert sum("cannot punch holes" in r.message for r in caplog.records) == 1


def test_lmdb_errors_on_reads_never_escape_as_map_resized(tmp_path, ns) -> None:
    """Sanity for the transaction gate: a resize waits for open transactions of every thread."""
    with DiskTier(tmp_path, map_nbytes=64 * 1024) as disk:
        entered, release = threading.Event(), threading.Event()

        def hold_a_read() -> None:
            with disk.index.read():
                entered.set()
                release.wait(10)

        t = threading.Thread(target=hold_a_read)
        t.start()
        entered.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (disk.index.resize(128 * 1024), done.set())).start()
        assert not done.wait(0.3)  # the resize waits for the open read transaction
        release.set()
        assert done.wait(5)
        t.join()
        assert disk.index.env.info()["map_size"] == 128 * 1024
        with pytest.raises(lmdb.Error):
            disk.index.write(lambda txn: txn.put(b"", b"x"))  # LMDB's own errors still surface


# ------------------------------------------------------------------------------------------ review findings


def test_max_age_applies_in_ram_and_a_rewrite_keeps_the_age(tmp_path, ns) -> None:
    now = [1000.0]
    with TieredStore.open(
        tmp_path, host_bytes=1 << 20, ttl_s=1000, max_age_s=100, clock=lambda: now[0]
    ) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        store.tier("disk").enforce_budget(1)  # the disk copy goes; RAM serves and writes it back
        for _ in range(3):
            now[0] += 30
            assert store.restore(ns, _toks(0))[0].by_tier["host"] == 64
            store.flush()
        assert {e.created_s for _, e in store.tier("disk").snapshot_entries()} == {1000.0}  # its age, not now
        now[0] += 20  # 110 s after it was created: past the max age everywhere, however often it is hit
        assert store.lookup(ns, _toks(0)).num_tokens == 0


def test_a_lock_file_problem_never_moves_a_store_others_have_open(tmp_path, ns) -> None:
    """LMDB reports a lock file of another build (or a damaged one) as VersionMismatch / Invalid, the same
    errors as a damaged data file. The bundled LMDB here reinitialises a foreign lock file when it is alone,
    so the error is injected into the second process's first open, as another build would raise it."""
    cache = tmp_path / "cache"
    opener = f"""
        import lmdb
        from tierkv import TieredStore, StoreOpenError
        from tierkv.tiers.disk import index as disk
        real, calls = disk.Index._open_env, [0]
        def fail_once(self, *args):
            calls[0] += 1
            if calls[0] == 1:
                raise lmdb.VersionMismatchError("mdb_env_open: MDB_VERSION_MISMATCH")
            return real(self, *args)
        disk.Index._open_env = fail_once
        try:
            with TieredStore.open({str(cache)!r}, host_bytes=0) as s:
                print("opened", s.lookup(__import__("tierkv").Namespace.from_json({ns.to_json()!r}),
                                         [t for t in range(64)]).num_tokens)
        except StoreOpenError as exc:
            print("refused:", exc)
    """
    with TieredStore.open(cache, host_bytes=0) as store:
        store.save(ns, list(range(64)), make_kv(ns, 64, seed=0))
        store.flush()
        r = run_python(opener)
        assert "refused" in r.stdout and "other processes have it open" in r.stdout, r.stdout + r.stderr
        assert not list(tmp_path.glob("cache.corrupt-*"))
        assert store.lookup(ns, list(range(64))).num_tokens == 64
    r = run_python(opener)  # alone now: the lock file is recreated, the data kept
    assert r.stdout.split() == ["opened", "64"], r.stdout + r.stderr
    assert not list(tmp_path.glob("cache.corrupt-*"))


def test_flush_never_waits_on_another_process_holding_the_write_lock(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
        with subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"""
import lmdb, sys, time
env = lmdb.open({str(tmp_path / "index")!r}, max_dbs=8)
with env.begin(write=True):
    print("held", flush=True)
    time.sleep(6)
""",
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        ) as holder:
            assert holder.stdout.readline().strip() == "held"
            store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
            store.load(ns, _toks(0))
            t0 = time.monotonic()
            ok = store.tier("disk").flush(timeout_s=1)
            assert not ok and time.monotonic() - t0 < 4
            holder.wait(30)
        assert store.tier("disk").flush(timeout_s=30)
        assert store.lookup(ns, _toks(0)).num_tokens == 64


def test_reader_slots_of_killed_processes_are_cleared(tmp_path, ns) -> None:
    """A process killed inside a read transaction leaves a reader slot pinning an old snapshot (LMDB can
    then reuse no page freed since). The slot outlives it while other processes keep the store open:
    the server's sweep clears it."""
    with TieredStore.open(tmp_path, host_bytes=0, sweep_interval_s=0.05) as store:
        store.save(ns, _toks(0), make_kv(ns, 64, seed=0))
        store.flush()
        with subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"""
import lmdb, time
env = lmdb.open({str(tmp_path / "index")!r}, max_dbs=8)
txn = env.begin()
print("reading", flush=True)
time.sleep(60)
""",
            ],
            stdout=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout.readline().strip() == "reading"
            proc.kill()
        deadline = time.monotonic() + 20
        while store.stats()["disk"]["stale_readers"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.stats()["disk"]["stale_readers"] >= 1
        assert store.lookup(ns, _toks(0)).num_tokens == 64
