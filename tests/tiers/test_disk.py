import json
import os
import signal
import subprocess
import sys
import threading
import time

import lmdb
import pytest
import torch

from tierkv import Namespace, NamespaceConflictError, StoreFormatError, TieredStore
from tierkv.codec import HEADER_NBYTES
from tierkv.tiers.disk import DiskTier, Policy
from tierkv.tiers.disk.segments import aligned
from tierkv.tiers.disk.write_items import Barrier

from helpers import REPO, gc_beside, make_kv, run_python, writer_held


def _totals_by_scan(disk: DiskTier) -> dict[bytes, tuple[int, int]]:
    out: dict[bytes, list[int]] = {}
    for _, e in disk.iter_entries():
        row = out.setdefault(e.ns_digest, [0, 0])
        row[0] += 1
        row[1] += e.footprint
    return {k: tuple(v) for k, v in out.items()}


def test_persists_across_processes(tmp_path, ns) -> None:
    r = run_python(
        f"""
        from tierkv import Namespace, TieredStore
        from helpers import make_kv
        ns = Namespace.from_json({ns.to_json()!r})
        with TieredStore.open({str(tmp_path)!r}, host_bytes=0) as store:
            store.save(ns, list(range(200)), make_kv(ns, 200, seed=7))
            store.flush()
    """,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        n, got = store.load(ns, list(range(200)))
    assert n == 192 and torch.equal(got, make_kv(ns, 200, seed=7)[:, :, :192])


def test_sliding_ttl_and_max_age_with_injected_clock(tmp_path, ns) -> None:
    now = [1000.0]
    toks = list(range(32))
    with TieredStore.open(tmp_path, host_bytes=0, ttl_s=100, max_age_s=250, clock=lambda: now[0]) as store:
        store.save(ns, toks, make_kv(ns, 32))
        store.flush()
        now[0] = 1090
        assert store.lookup(ns, toks).num_tokens == 32
        assert store.load(ns, toks)[0] == 32  # a hit refreshes the sliding TTL
        now[0] = 1170  # 170 s after saving, 80 s after the hit
        assert store.lookup(ns, toks).num_tokens == 32
        now[0] = 1260  # idle 170 s: expired before any sweep
        assert store.lookup(ns, toks).num_tokens == 0
        assert store.load(ns, toks) == (0, None)
        footprint = sum(e.footprint for _, e in store.tier("disk").index.iter_entries())
        dry = store.tier("disk").expire(dry_run=True)  # both idle and too old: each block counted once
        assert (dry.expired, dry.freed_nbytes) == (2, footprint)
        report = store.tier("disk").expire()
        assert report.expired == 2 and store.tier("disk").totals() == {}
        assert report.freed_nbytes == footprint  # what gc reports as freed

        store.save(ns, toks, make_kv(ns, 32))
        store.flush()
        for t in (1300, 1400, 1500):  # touched every 100 s, but older than max_age at 1520
            now[0] = t
            assert store.load(ns, toks)[0] == 32
        now[0] = 1520
        assert store.lookup(ns, toks).num_tokens == 0


def test_budget_holds_while_writing_ten_times_its_size(tmp_path, ns) -> None:
    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)  # header, 16 token ids, 1 KiB payload: one page
    budget = 40 * block_footprint
    with TieredStore.open(
        tmp_path, host_bytes=0, disk_bytes=budget, batch_nbytes=8 * block_footprint
    ) as store:
        for p in range(50):  # 50 prompts x 8 blocks = 10x the budget
            toks = [p * 1000 + t for t in range(128)]
            store.save(ns, toks, make_kv(ns, 128, seed=p))
            if p % 5 == 0:
                store.flush()
                assert store.tier("disk").usage()["live_nbytes"] <= budget
        store.flush()
        usage = store.tier("disk").usage()
        assert usage["live_nbytes"] <= budget
        assert (
            usage["segment_allocated_nbytes"] <= budget + 64 * 1024
        )  # holes punched: the file does not grow
        assert store.lookup(ns, [49 * 1000 + t for t in range(128)]).num_tokens == 128  # newest kept
        assert store.lookup(ns, list(range(128))).num_tokens == 0  # oldest evicted
        assert store.stats()["disk"]["evictions"] >= 360
        assert store.tier("disk").totals() == _totals_by_scan(store.tier("disk"))


@pytest.mark.parametrize("how", ["writer", "gc"])
def test_a_budget_evicts_a_prompts_last_blocks_first_and_keeps_what_a_lookup_reaches(
    tmp_path, ns, how
) -> None:
    """A prompt's blocks share one access time. Over the budget, the writer's eviction and ``tierkv gc
    --budget``'s take its last blocks first (leaves before their prefixes): what stays is a prefix that
    hits, none of it unreachable. Before, by time and key alone, they took blocks from anywhere in it."""
    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    toks = list(range(40 * 16))
    budget = 15 * block_footprint
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=budget if how == "writer" else None) as store:
        # The save in one batch (the writer takes what is queued when it wakes): a save in several is
        # the test below's.
        batches = store.tier("disk").writer._batches
        gate, handle = threading.Event(), batches._handle
        batches._handle = lambda batch: (gate.wait(30), handle(batch))
        batches.put(Barrier())  # the writer waits in this one until the whole save is queued
        store.save(ns, toks, make_kv(ns, len(toks)))
        gate.set()
        store.flush()
        disk = store.tier("disk")
        if how == "gc":
            assert disk.usage()["live_nbytes"] == 40 * block_footprint
            assert disk.enforce_budget(budget).evicted == 25
        assert disk.usage()["live_nbytes"] == budget
        assert store.lookup(ns, toks).num_tokens == 15 * 16  # the first 15 blocks: all it holds
        assert disk.totals() == _totals_by_scan(disk)


@pytest.mark.parametrize("batch_blocks", [20, 7])
def test_a_save_larger_than_the_budget_in_several_batches_keeps_a_prefix_that_hits(
    tmp_path, ns, batch_blocks
) -> None:
    """A save the writer takes in several batches, larger than the whole budget: the first batch's
    eviction takes its own last blocks, and the batches after it, whose prefix on disk now ends before
    them, are evicted first. Before, they stayed (younger than the prefix), and the next eviction, by the
    oldest leaf, took the reachable prefix's end instead, until no block of the prompt hit."""
    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    toks = list(range(40 * 16))
    budget = 15 * block_footprint
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=budget) as store:
        store.tier("disk").writer._batches.batch_items = batch_blocks
        with writer_held(store):  # the whole save queued before the writer takes its first batch
            store.save(ns, toks, make_kv(ns, len(toks)))
        assert store.flush() == 0  # nothing lost: the budget's choice, not a failed write
        disk = store.tier("disk")
        assert disk.usage()["live_nbytes"] <= budget
        held = store.lookup(ns, toks).num_tokens // 16
        assert held * block_footprint == disk.usage()["live_nbytes"]  # every block kept is reachable
        assert held == 15  # the budget, filled exactly (no headroom below 1 GiB)
        stats = store.stats()["disk"]
        assert stats["evictions"] == 40 - held and stats["blocks_written"] == 40
        assert disk.totals() == _totals_by_scan(disk)
        # Saved again, whole: what fits of it is kept again, reachable.
        store.save(ns, toks, make_kv(ns, len(toks)))
        store.flush()
        assert store.lookup(ns, toks).num_tokens // 16 * block_footprint == disk.usage()["live_nbytes"] > 0


def test_prompts_saved_chunk_by_chunk_past_the_budget_keep_only_blocks_that_hit(tmp_path, ns) -> None:
    """Two long prompts saved in chunks of 8 blocks, alternately (an engine's chunked prefill, each chunk a
    save from ``start_block``), past a budget of 15 blocks: one chunk's eviction takes the other prompt's
    end, and that prompt's next chunk, with no prefix on disk, goes before any block a lookup reaches."""
    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    p, q = list(range(40 * 16)), [100_000 + t for t in range(40 * 16)]
    kp, kq = make_kv(ns, len(p), seed=1), make_kv(ns, len(q), seed=2)
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=15 * block_footprint) as store:
        for c in range(0, 40, 8):
            for toks, kv in ((p, kp), (q, kq)):
                store.save(
                    ns, toks[: (c + 8) * 16], kv[:, :, c * 16 : (c + 8) * 16], start_block=c, kv_start=c * 16
                )
                assert store.flush() == 0
        disk = store.tier("disk")
        held = (store.lookup(ns, p).num_tokens + store.lookup(ns, q).num_tokens) // 16
        assert held * block_footprint == disk.usage()["live_nbytes"] == 15 * block_footprint
        stats = store.stats()["disk"]
        assert stats["blocks_written"] - stats["evictions"] == held
        assert disk.totals() == _totals_by_scan(disk)


def test_a_continuation_saved_without_its_prefix_is_kept_where_the_budget_has_room(tmp_path, ns) -> None:
    """Blocks saved from ``start_block`` whose prefix is not on disk (an engine's own cache holds it) are
    stored while the budget has room, and a restore from ``start_block`` reads them."""
    toks = list(range(50 * 16))
    kv = make_kv(ns, len(toks))
    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=60 * block_footprint) as store:
        store.save(ns, toks, kv[:, :, 40 * 16 :], start_block=40, kv_start=40 * 16)
        assert store.flush() == 0
        assert store.lookup(ns, toks).num_tokens == 0  # nothing from block 0
        hit, _ = store.restore(ns, toks, torch.zeros_like(kv), start_block=40)
        assert hit.num_blocks == 50 and store.stats()["disk"]["evictions"] == 0


def test_blocks_whose_prefix_is_not_all_on_disk_go_before_a_reachable_prompt(tmp_path, ns) -> None:
    """Over the budget, a batch's blocks that no lookup from disk reaches go before an older prompt that
    hits, whether their parent is missing, later in the same batch, or stored but itself unreachable."""
    fp = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    now = [10_000.0]
    p = list(range(25 * 16))
    kv = make_kv(ns, len(p), seed=1)
    r = [500_000 + t for t in range(10 * 16)]
    with TieredStore.open(tmp_path, host_bytes=0, clock=lambda: now[0], disk_bytes=20 * fp) as store:
        store.save(ns, p[: 15 * 16], kv[:, :, 10 * 16 : 15 * 16], start_block=10, kv_start=10 * 16)
        store.flush()  # blocks 10..14 with room: kept, though nothing before them is stored
        now[0] += 1
        store.save(ns, r, make_kv(ns, len(r), seed=9))
        store.flush()  # R: 10 blocks that hit, older than what comes next
        now[0] += 1
        # In one batch: blocks 20..24, then 15..24 again (kept from the first: 15..19 come after 20..24).
        with writer_held(store):
            store.save(ns, p, kv[:, :, 20 * 16 :], start_block=20, kv_start=20 * 16)
            store.save(ns, p, kv[:, :, 15 * 16 :], start_block=15, kv_start=15 * 16)
        assert store.flush() == 0
        disk = store.tier("disk")
        assert store.lookup(ns, r).num_tokens == 10 * 16  # over by 5: five of P's went, none of R's
        assert disk.usage()["live_nbytes"] == 20 * fp
        hit, _ = store.restore(ns, p, torch.zeros_like(kv), start_block=10)
        assert hit.num_blocks == 20  # P taken from its end: 10..19 stay, 20..24 went
        assert disk.totals() == _totals_by_scan(disk)


def test_a_hit_just_before_a_batch_counts_for_that_batchs_eviction(tmp_path, ns) -> None:
    """Hits are written to the index in batches (at most once a second, and after each write batch): the
    writer applies those pending before a batch's eviction reads the access times. Before, the prompt hit
    last was evicted as if it had not been, because its hit was written just after."""
    fp = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    now = [1000.0]
    x, y, z = (list(range(k * 1000, k * 1000 + 4 * 16)) for k in (1, 2, 3))
    with TieredStore.open(tmp_path, host_bytes=0, clock=lambda: now[0], disk_bytes=8 * fp) as store:
        for toks in (x, y):
            store.save(ns, toks, make_kv(ns, len(toks)))
            store.flush()
            now[0] += 1000
        assert store.load(ns, x)[0] == len(x)  # x: the one hit last (its hit not written yet)
        now[0] += 1000
        store.save(ns, z, make_kv(ns, len(z)))  # over the budget by one prompt
        store.flush()
        assert [store.lookup(ns, t).num_tokens for t in (x, y, z)] == [len(x), 0, len(z)]


@pytest.mark.parametrize("hit_last", ["one", "two"])
def test_the_prompt_hit_last_is_kept_whatever_the_writer_was_doing(tmp_path, ns, hit_last) -> None:
    """``two`` is saved while the writer is busy; ``one``, stored before, is hit (from the host tier) after
    that save, and, with ``hit_last`` two, ``two`` is hit after it while its save still waits. The writer
    then indexes ``two``'s save over a 5-block budget: the prompt hit last is kept whole. Before, a new
    block's access time was the indexing's, up to a batch or a full queue after its save (a new user's
    three requests in a second: the one hit last was gone after a restart); and a hit on a block whose
    save was queued was dropped as a hit on an absent block (a cold review)."""
    fp = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    now = [1000.0]
    one, two = list(range(3 * 16)), [9000 + t for t in range(5 * 16)]
    with TieredStore.open(tmp_path, host_bytes=1 << 20, clock=lambda: now[0], disk_bytes=5 * fp) as store:
        store.save(ns, one, make_kv(ns, len(one), seed=1))
        store.flush()
        now[0] = 2000.0
        with writer_held(store):
            store.save(ns, two, make_kv(ns, len(two), seed=2))
            now[0] = 2500.0
            assert store.restore(ns, one)[0].by_tier["host"] == len(one)
            if hit_last == "two":
                now[0] = 3000.0
                assert store.restore(ns, two)[0].by_tier["host"] == len(two)
                store.tier("disk").times.flush()  # (as the writer's idle flush may, before two is indexed)
            now[0] = 4000.0  # the writer indexes two's save only now
        assert store.flush() == 0
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=5 * fp) as store:
        held = [store.lookup(ns, toks).num_tokens // 16 for toks in (one, two)]
        assert held == ([3, 2] if hit_last == "one" else [0, 5])  # two gives its last blocks first


def test_a_save_queued_longer_than_the_ttl_is_not_indexed_already_expired(tmp_path, ns) -> None:
    """A block's access time is when it was queued; a writer that indexes it later than the TTL (a
    stalled disk) gives it its indexing time instead, or a lookup would miss what was just written."""
    now = [1000.0]
    toks = list(range(3 * 16))
    with TieredStore.open(tmp_path, host_bytes=0, clock=lambda: now[0], ttl_s=100) as store:
        with writer_held(store):
            store.save(ns, toks, make_kv(ns, len(toks)))  # queued at 1000
            now[0] = 1150.0  # indexed 150 s later
        assert store.flush() == 0
        assert store.lookup(ns, toks).num_tokens == len(toks)


def test_a_budget_evicts_the_least_recently_used_prompt_first_and_a_shared_prefix_last(tmp_path, ns) -> None:
    """Leaves first does not undo the time order: of two prompts after a shared prefix, the one used
    longer ago loses its own blocks (from its end) first; the shared prefix, which the other still
    needs, stays."""
    now = [1000.0]
    shared = list(range(10 * 16))
    old, new = shared + list(range(5000, 5000 + 10 * 16)), shared + list(range(9000, 9000 + 10 * 16))
    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    with TieredStore.open(tmp_path, host_bytes=0, clock=lambda: now[0]) as store:
        store.save(ns, old, make_kv(ns, len(old), seed=1))
        store.flush()
        now[0] = 2000.0
        store.save(ns, new, make_kv(ns, len(new), seed=2))
        store.load(ns, new)  # and used: its shared blocks are recent too
        store.flush()
        disk = store.tier("disk")
        assert disk.enforce_budget(24 * block_footprint).evicted == 6
        assert store.lookup(ns, old).num_tokens == 14 * 16  # its last 6 blocks went
        assert store.lookup(ns, new).num_tokens == 20 * 16
        assert disk.enforce_budget(20 * block_footprint).evicted == 4
        assert store.lookup(ns, old).num_tokens == 10 * 16 and store.lookup(ns, new).num_tokens == 20 * 16


def test_full_file_system_degrades_to_no_disk_writes(tmp_path, ns) -> None:
    """RLIMIT_FSIZE makes the kernel refuse writes past 256 KiB (EFBIG): a real write failure."""
    r = run_python(f"""
        import resource, signal, torch
        from tierkv import Namespace, TieredStore
        from helpers import make_kv
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ns = Namespace.from_json({ns.to_json()!r})
        with TieredStore.open({str(tmp_path)!r}, host_bytes=2**22) as store:
            store.save(ns, list(range(64)), make_kv(ns, 64))
            store.flush()
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
            for p in range(1, 40):
                toks = [p * 1000 + t for t in range(64)]
                store.save(ns, toks, make_kv(ns, 64, seed=p))
                store.flush()
            n, kv = store.load(ns, [39000 + t for t in range(64)])
            assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=39)), "host tier still serves"
            store.tier("host").clear()
            n, kv = store.load(ns, list(range(64)))
            assert n == 64 and torch.equal(kv, make_kv(ns, 64)), "disk reads go on"
            s = store.stats()["disk"]
            print(s["dropped_saves"], s["write_errors"])
    """)
    assert r.returncode == 0, r.stderr
    dropped, errors = map(int, r.stdout.split())
    assert dropped > 0 and errors > 0


def test_flipped_bytes_are_misses_and_gc_check_purges_them(tmp_path, ns) -> None:
    prompts = [[p * 1000 + t for t in range(64)] for p in range(3)]
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for p, toks in enumerate(prompts):
            store.save(ns, toks, make_kv(ns, 64, seed=p))
        store.flush()
        entries = list(store.tier("disk").iter_entries())
    segs = {}
    for _, e in entries[::4]:  # damage every 4th record somewhere in its payload or header
        path = tmp_path / "segments" / f"{e.seg_id:010d}.seg"
        data = segs.setdefault(path, bytearray(path.read_bytes()))
        data[e.offset + (e.nbytes * 7) // 11] ^= 0x10
    for path, data in segs.items():
        path.write_bytes(bytes(data))
    bad = len(entries[::4])
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "gc", "--cache-dir", str(tmp_path), "--check", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1 and f"{bad} corrupt record(s) found and purged" in r.stderr  # as fsck does
    report = json.loads(r.stdout)
    assert report["checked"] == len(entries) and report["corrupt"] == bad
    assert report["freed_nbytes"] >= bad * min(e.nbytes for _, e in entries)  # their pages given back
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        assert sum(b for b, _ in store.tier("disk").totals().values()) == len(entries) - bad
        for p, toks in enumerate(prompts):
            n, kv = store.load(ns, toks)
            assert n < 64 or torch.equal(kv, make_kv(ns, 64, seed=p))
        assert store.stats()["disk"]["corrupt_blocks"] == 0  # nothing bad left to find


def test_other_format_version_is_a_clear_error(tmp_path) -> None:
    DiskTier(tmp_path, writer=False).close()
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreFormatError, match="version 99"):
        DiskTier(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "stats", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "version 99" in r.stderr


def test_namespace_conflict_is_detected(tmp_path, ns) -> None:
    with DiskTier(tmp_path, writer=False) as disk:
        disk.register_namespace(ns)
        disk.index.write(
            lambda txn: txn.put(ns.digest, b'{"model_id":"other"}', db=disk.index.db["namespaces"])
        )
        with pytest.raises(NamespaceConflictError):
            disk.register_namespace(ns)


WRITER = """
import sys, time
from tierkv import Namespace, TieredStore
from helpers import make_kv
ns = Namespace.from_json(sys.argv[1])
with TieredStore.open(sys.argv[2], host_bytes=0, batch_nbytes=32 * 1024) as store:
    for p in range(int(sys.argv[3])):
        toks = [p * 1000 + t for t in range(96)]
        store.save(ns, toks, make_kv(ns, 96, seed=p))
        if p % 3 == 0:
            store.flush()
            print(p, flush=True)
        for q in (p // 2, p // 3):  # read back older prompts: every hit must be exact
            n, kv = store.load(ns, [q * 1000 + t for t in range(96)])
            assert n == 0 or __import__("torch").equal(kv, make_kv(ns, 96, seed=q)[:, :, :n]), (p, q, n)
    print("corrupt", store.stats()["disk"]["corrupt_blocks"], flush=True)
"""


def _writer(tmp_path, ns, prompts: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, ns.to_json(), str(tmp_path), str(prompts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests")},
    )


def test_gc_in_another_process_while_a_writer_writes(tmp_path, ns) -> None:
    proc = _writer(tmp_path, ns, 150)
    assert proc.stdout is not None
    proc.stdout.readline()  # the store exists
    gc_runs, out = gc_beside(
        proc, tmp_path, [["--budget", "60KiB"], ["--ttl", "1s"], ["--check"], ["--compact"]]
    )
    assert gc_runs >= 4
    assert out.strip().splitlines()[-1] == "corrupt 0"  # the writer never saw a bad block
    with DiskTier(tmp_path, writer=False) as disk:
        assert disk.totals() == _totals_by_scan(disk)
        assert disk.check().corrupt == 0


@pytest.mark.parametrize("kill_after_lines", [2, 5])
def test_sigkill_mid_batches_leaves_a_consistent_store(tmp_path, ns, kill_after_lines: int) -> None:
    proc = _writer(tmp_path, ns, 1000)
    assert proc.stdout is not None
    for _ in range(kill_after_lines):
        proc.stdout.readline()
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        disk = store.tier("disk")
        assert disk.totals() == _totals_by_scan(disk)
        report = disk.check()
        assert report.corrupt == 0 and report.checked > 0
        for p in range(3 * (kill_after_lines - 1)):  # flushed before the printed line: durable
            toks = [p * 1000 + t for t in range(96)]
            n, kv = store.load(ns, toks)
            assert n == 96 and torch.equal(kv, make_kv(ns, 96, seed=p))
        # The killed writer's open segment is sealed; compaction releases its unindexed tail.
        disk.compact()
        assert disk.usage()["segment_allocated_nbytes"] <= disk.usage()["live_nbytes"] + 4096 * 4
        store.save(ns, list(range(64)), make_kv(ns, 64))  # and the store takes new writes
        store.flush()
        assert store.lookup(ns, list(range(64))).num_tokens == 64


def test_stats_are_exact_after_reopen(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=2**20) as store:
        for p in range(5):
            store.save(ns, [p * 100 + t for t in range(48)], make_kv(ns, 48, seed=p))
    with DiskTier(tmp_path, writer=False) as disk:
        ((blocks, nbytes),) = disk.totals().values()
        assert blocks == 15 and nbytes == disk.usage()["live_nbytes"]
        assert disk.policy.budget_nbytes == 2**20  # the policy persisted for gc
        assert Namespace.from_json(disk.namespaces()[ns.digest].to_json()) == ns


def test_purge_namespace_resumes_its_scan_across_transactions(tmp_path, ns, monkeypatch) -> None:
    """The purge finds and removes each batch inside one write transaction, a bounded number of entries
    looked at per transaction: every block of the namespace goes, the other's all stay, totals exact."""
    from tierkv.tiers.disk import sweeps

    monkeypatch.setattr(sweeps, "PURGE_SCAN", 5)
    monkeypatch.setattr(sweeps, "SWEEP_BATCH", 3)
    other = Namespace.from_json(ns.to_json()).with_salt("other")
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for space in (ns, other):
            for j in range(4):
                store.save(space, [j * 1000 + t for t in range(64)], make_kv(space, 64, seed=j))
        store.flush()
        disk = store.tier("disk")
        ours = sum(e.footprint for _, e in disk.index.iter_entries() if e.ns_digest == ns.digest)
        assert disk.purge_namespace(ns.digest, dry_run=True).freed_nbytes == ours
        report = disk.purge_namespace(ns.digest)
        assert report.purged == 16 and report.freed_nbytes == ours  # what gc reports as freed
        assert disk.totals() == _totals_by_scan(disk) and set(disk.totals()) == {other.digest}
        assert disk.totals()[other.digest][0] == 16
        assert disk.purge_namespace(None).purged == 16 and disk.totals() == {}


def test_over_its_budget_the_writer_evicts_a_headroom_below_it_at_once(tmp_path, ns) -> None:
    """``evict_over(headroom_nbytes=...)``: nothing while within the budget; once over it, down to the
    headroom below it (the writer's: a 64th of a budget of 1 GiB or more, at most 256 MiB), so that a long
    prompt is taken a stretch at a time, not scanned to its end at every batch."""
    from tierkv.tiers.disk.eviction import headroom

    block_footprint = aligned(HEADER_NBYTES + 4 * 16 + 1024)
    toks = list(range(40 * 16))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, make_kv(ns, len(toks)))
        store.flush()
        index = store.tier("disk").index
        assert (
            index.write(lambda txn: index.evict_over(txn, 40 * block_footprint, headroom_nbytes=8 << 20))
            == []
        )
        holes = index.write(
            lambda txn: index.evict_over(txn, 39 * block_footprint, headroom_nbytes=5 * block_footprint)
        )
        assert len(holes) == 6
        assert store.lookup(ns, toks).num_tokens == 34 * 16
    assert headroom(1 << 20) == 0 and headroom(4 << 30) == 64 << 20 and headroom(1 << 40) == 256 << 20


def test_a_budget_above_what_the_file_system_has_is_said_at_start_up(tmp_path) -> None:
    """A 20 GiB default budget on a small volume was accepted without a word: the disk then fills before
    the budget evicts and saves are dropped. The start-up line says so (from a new user's trial)."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with DiskTier(tmp_path / "big", policy=Policy(budget_nbytes=free + (1 << 50))) as disk:
        assert "WARNING: more than the" in disk.describe() and "this file system has" in disk.describe()
    with DiskTier(tmp_path / "small", policy=Policy(budget_nbytes=64 << 20)) as disk:
        assert "WARNING" not in disk.describe()
