"""The read mode of what the page cache lacks, where nobody chose it: O_DIRECT or buffered, whichever the
restores measured faster on this disk (tierkv/tiers/disk/read_modes.py)."""

from __future__ import annotations

import errno
import json
import os
import stat
import time

import pytest
import torch

from tierkv import Namespace, TieredStore, native
from tierkv.tiers.disk import read_modes
from tierkv.tiers.disk.files import accepts_direct_io
from tierkv.tiers.disk.read_modes import EXPLORE_EVERY, MIN_SAMPLE_NBYTES, MIN_SAMPLES, ReadModes

from helpers import make_kv, uncache

MiB = 1 << 20
# 2 MiB records: 24 of them are a 48 MiB run, well past the smallest sample
BIG = Namespace("read-modes", "r", "float32", 4, 8, 128, block_tokens=128)


def test_both_modes_are_measured_first_then_the_faster_reads_and_the_other_now_and_then() -> None:
    modes = ReadModes(None, fixed=None)
    order = []
    for _ in range(2 * MIN_SAMPLES):
        direct = modes.direct()
        order.append(direct)
        modes.observe(direct, 64 * MiB, 64 * MiB, 0.1 if direct else 0.05)  # buffered twice as fast
    assert order == [True, False] * MIN_SAMPLES
    chosen = []
    for _ in range(2 * EXPLORE_EVERY):
        direct = modes.direct()
        chosen.append(direct)
        modes.observe(direct, 64 * MiB, 64 * MiB, 0.1 if direct else 0.05)
    assert chosen.count(True) == 2  # one run in EXPLORE_EVERY keeps O_DIRECT's speed current
    assert modes.medians() == {"direct": pytest.approx(640 * MiB), "buffered": pytest.approx(1280 * MiB)}


def test_o_direct_is_kept_unless_buffered_is_clearly_faster() -> None:
    modes = ReadModes(None, fixed=None)
    for _ in range(MIN_SAMPLES):
        modes.observe(True, 64 * MiB, 64 * MiB, 0.100)
        modes.observe(False, 64 * MiB, 64 * MiB, 0.095)  # 5% faster: within the margin
    assert modes.direct()
    modes = ReadModes(None, fixed=None)
    for _ in range(MIN_SAMPLES):
        modes.observe(True, 64 * MiB, 64 * MiB, 0.05)  # O_DIRECT faster
        modes.observe(False, 64 * MiB, 64 * MiB, 0.10)
    assert all(modes.direct() for _ in range(10))


def test_small_or_mostly_cached_runs_are_not_samples_and_a_chosen_mode_is_never_measured() -> None:
    modes = ReadModes(None, fixed=None)
    modes.observe(True, MIN_SAMPLE_NBYTES - 1, MIN_SAMPLE_NBYTES - 1, 0.01)  # too small to say
    modes.observe(True, 16 * MiB, 64 * MiB, 0.01)  # three quarters from the page cache
    modes.observe(True, 16 * MiB, 16 * MiB, 0.0)  # no time measured
    assert modes.medians() == {"direct": None, "buffered": None}
    for fixed in (True, False):
        chosen = ReadModes(None, fixed=fixed)
        for _ in range(10):
            chosen.observe(not fixed, 64 * MiB, 64 * MiB, 0.001)
        assert chosen.direct() is fixed and chosen.medians() == {"direct": None, "buffered": None}


def test_the_samples_are_kept_in_the_cache_directory_and_a_bad_file_is_ignored(tmp_path) -> None:
    path = tmp_path / read_modes.FILE
    modes = ReadModes(path, fixed=None)
    modes.save()
    assert not path.exists()  # nothing measured: nothing written
    for _ in range(MIN_SAMPLES):
        modes.observe(True, 64 * MiB, 64 * MiB, 0.2)
        modes.observe(False, 64 * MiB, 64 * MiB, 0.1)
    modes.save()
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed into place
    again = ReadModes(path, fixed=None)
    assert again.medians() == modes.medians() and not again.direct()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # as the store's other files
    bodies = [
        "{not json",
        '["direct"]',
        '{"direct": [1e9, "fast", null, -5, true, 1e999], "buffered": 7}',
        '{"direct": [1e9, %s]}' % ("9" * 400),  # past a float: OverflowError
        "[" * 100_000,  # RecursionError in the parser
        '{"direct": [1e9], "pad": "%s"}' % ("x" * (read_modes.MAX_FILE_NBYTES + 1)),  # too big to be ours
    ]
    for body in bodies:
        path.write_text(body)
        got = ReadModes(path, fixed=None).medians()  # the store opens whatever the file holds
        assert got["buffered"] is None and got["direct"] in (None, 1e9)  # only a good value survives
    path.unlink()
    os.mkfifo(path)  # would block an open for reading forever
    assert ReadModes(path, fixed=None).medians() == {"direct": None, "buffered": None}
    path.unlink()
    path.write_text('{"direct": [1e9]}')
    fixed = ReadModes(path, fixed=True)
    fixed.save()
    assert json.loads(path.read_text()) == {"direct": [1e9]}  # left as it was


def test_a_run_beside_another_is_no_sample_and_samples_are_kept_before_close(tmp_path) -> None:
    path = tmp_path / read_modes.FILE
    modes = ReadModes(path, fixed=None)
    a = modes.begin()
    b = modes.begin()  # two restores at once share the disk: neither says what it serves alone
    modes.end(b, True, 64 * MiB, 64 * MiB, 0.1)
    modes.end(a, True, 64 * MiB, 64 * MiB, 0.1)
    assert modes.medians()["direct"] is None
    for _ in range(read_modes.KEPT - 1):
        modes.end(modes.begin(), False, 64 * MiB, 64 * MiB, 0.1)
    assert not path.exists()
    modes.end(modes.begin(), False, 64 * MiB, 64 * MiB, 0.1)  # the KEPT-th: written without a close
    assert len(json.loads(path.read_text())["buffered"]) == read_modes.KEPT


def test_a_temporary_file_left_by_a_dead_writer_is_removed_at_open(tmp_path) -> None:
    old, fresh = tmp_path / f".{read_modes.FILE}.dead.tmp", tmp_path / f".{read_modes.FILE}.live.tmp"
    for p in (old, fresh):
        p.write_text("{")
    past = time.time() - 2 * read_modes.STALE_TMP_S
    os.utime(old, (past, past))
    ReadModes(tmp_path / read_modes.FILE, fixed=None)
    assert not old.exists() and fresh.exists()  # a live writer's is left alone


def _saved(path, monkeypatch, seed: int) -> tuple[list[int], torch.Tensor]:
    """A 48 MiB prompt saved into a fresh store at ``path`` (the read mode left to measurement): its tokens
    and KV. Skips where the default cannot measure (no cachestat(2): it reads buffered)."""
    from tierkv.tiers.disk.files import has_cachestat

    if not has_cachestat():
        pytest.skip("no cachestat(2) here (before Linux 6.5, or refused): the default reads buffered")
    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    toks = list(range(24 * BIG.block_tokens))
    kv = make_kv(BIG, len(toks), seed=seed)
    with TieredStore.open(path, host_bytes=0) as store:
        store.save(BIG, toks, kv)
    return toks, kv


def _mode_of_one_cold_restore(path, toks, kv) -> str:
    """Restore ``toks`` with the page cache dropped, in a fresh store on ``path`` (the default read mode):
    which way its bytes came from the disk."""
    uncache(path)
    with native.use(True), TieredStore.open(path, host_bytes=0) as store:
        hit, got = store.restore(BIG, toks)
        stats = store.stats()["disk"]
        line = store._durable().read_path()
    assert hit.num_tokens == len(toks) and torch.equal(got, kv)
    assert stats["read_cached_nbytes"] + stats["read_direct_nbytes"] + stats["read_blocking_nbytes"] > 0
    assert "whichever this disk serves faster" in line
    if stats["read_direct_nbytes"] and not stats["read_blocking_nbytes"]:
        return "direct"
    assert not stats["read_direct_nbytes"] and stats["read_blocking_nbytes"] >= MIN_SAMPLE_NBYTES
    return "buffered"


def test_a_store_measures_both_modes_on_its_disk_and_a_restarted_one_reads_the_faster_way(
    tmp_path, monkeypatch
) -> None:
    """Real cold restores of 48 MiB in fresh stores on one directory: the first ones take turns (O_DIRECT
    first), each a sample kept in the directory at close; once both are measured, a new process's first
    restore reads the way the samples say is faster, bit for bit the same KV either way."""
    toks, kv = _saved(tmp_path, monkeypatch, seed=5)
    if accepts_direct_io(tmp_path / "segments") is False:
        pytest.skip("this file system refuses O_DIRECT: buffered only")
    modes = [_mode_of_one_cold_restore(tmp_path, toks, kv) for _ in range(2 * MIN_SAMPLES)]
    assert modes == ["direct", "buffered"] * MIN_SAMPLES
    kept = json.loads((tmp_path / read_modes.FILE).read_text())
    assert len(kept["direct"]) == len(kept["buffered"]) == MIN_SAMPLES
    for faster in ("direct", "buffered"):  # as if the disk had measured so
        slower = "buffered" if faster == "direct" else "direct"
        body = {faster: [2e9] * MIN_SAMPLES, slower: [0.5e9] * MIN_SAMPLES}
        (tmp_path / read_modes.FILE).write_text(json.dumps(body))
        with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:  # what /metrics shows
            disk = store.stats()["disk"]
        assert disk["cold_reads_direct"] == (faster == "direct")
        assert disk[f"cold_read_{faster}_Bps"] == 2e9 and disk[f"cold_read_{slower}_Bps"] == 0.5e9
        assert _mode_of_one_cold_restore(tmp_path, toks, kv) == faster


def test_the_read_mode_shows_measuring_until_both_modes_have_samples(tmp_path) -> None:
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
        disk, line = store.stats()["disk"], store._durable().read_path()
    if "whichever this disk serves faster" not in line:
        pytest.skip(f"no measured read mode here: {line}")
    assert disk["cold_reads_direct"] == -1 and disk["cold_read_direct_Bps"] == 0
    assert f"(measuring: O_DIRECT 0, buffered 0 of {MIN_SAMPLES} cold restores each)" in line


def test_a_mode_asked_for_is_kept_and_measures_nothing(tmp_path, monkeypatch) -> None:
    toks, kv = _saved(tmp_path, monkeypatch, seed=6)
    monkeypatch.setenv("TIERKV_DIRECT_READS", "0")
    for _ in range(2):
        uncache(tmp_path)
        with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
            hit, _ = store.restore(BIG, toks)
            assert hit.num_tokens == len(toks)
            assert store.stats()["disk"]["read_direct_nbytes"] == 0
            assert store.stats()["disk"]["cold_reads_direct"] == 0
            assert "buffered with readahead (set: TIERKV_DIRECT_READS=0)" in store._durable().read_path()
    assert not (tmp_path / read_modes.FILE).exists()


def test_a_warm_buffered_restore_is_no_sample(tmp_path, monkeypatch) -> None:
    """Buffered, what the page cache held before the run counts as cached, not as the disk's speed: warm
    re-reads once fed buffered memory-copy speeds, which locked the choice in."""
    toks, kv = _saved(tmp_path, monkeypatch, seed=9)
    kept = {"direct": [0.5e9] * MIN_SAMPLES, "buffered": [2e9] * MIN_SAMPLES}  # buffered chosen
    (tmp_path / read_modes.FILE).write_text(json.dumps(kept))
    for _ in range(3):  # the first reads from the disk (a sample), the others from the page cache
        with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
            hit, got = store.restore(BIG, toks)
            stats = store.stats()["disk"]
        assert hit.num_tokens == len(toks) and torch.equal(got, kv)
        assert stats["read_direct_nbytes"] == 0
    assert stats["read_cached_nbytes"] >= 24 * (2 << 20) and stats["read_blocking_nbytes"] == 0
    assert len(json.loads((tmp_path / read_modes.FILE).read_text())["buffered"]) <= MIN_SAMPLES + 1


def test_a_restore_read_in_pieces_is_one_sample(tmp_path, monkeypatch) -> None:
    """With a host tier to promote into, a run is read in pieces (reader.PIECE_NBYTES); the restore is
    still one sample, of its whole time: a sample per piece gave O_DIRECT five per restore, and a buffered
    restore only its first piece (its readahead had warmed the rest), the slowest."""
    from tierkv.tiers.disk.reader import PIECE_NBYTES

    toks, kv = _saved(tmp_path, monkeypatch, seed=10)
    assert 24 * (2 << 20) > PIECE_NBYTES  # more than one piece
    from tierkv.tiers.disk import native_read

    calls = []
    real = native_read.read_run
    monkeypatch.setattr(native_read, "read_run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for n, mode in ((1, "direct"), (2, "buffered")):
        uncache(tmp_path)
        calls.clear()
        with native.use(True), TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
            hit, got = store.restore(BIG, toks)
            stats = store.stats()["disk"]
        assert hit.num_tokens == len(toks) and torch.equal(got, kv)
        assert (stats["read_direct_nbytes"] > 0) is (mode == "direct") and len(calls) >= 2  # in pieces
        kept = json.loads((tmp_path / read_modes.FILE).read_text())
        assert (len(kept["direct"]), len(kept["buffered"])) == ((1, 0) if n == 1 else (1, 1))


def test_a_measured_restore_out_of_descriptors_is_a_miss_and_no_sample(
    tmp_path, monkeypatch, read_faults
) -> None:
    """EMFILE while the restore measures what the page cache holds: a counted miss, as any read that fails
    for want of descriptors (it was an OSError out of the restore), no sample, and the next restore
    measured as usual (nothing left in flight)."""
    toks, kv = _saved(tmp_path, monkeypatch, seed=11)
    uncache(tmp_path)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
        modes = store._durable().segments.read_modes
        read_faults.fail_all(store, errno.EMFILE)
        hit, _ = store.restore(BIG, toks)
        read_faults.clear()
        assert hit.num_tokens == 0 and store.stats()["disk"]["transient_read_errors"] == 1
        assert modes.medians() == {"direct": None, "buffered": None} and modes._inflight == 0
        hit, got = store.restore(BIG, toks)
        assert hit.num_tokens == len(toks) and torch.equal(got, kv)
        assert modes.medians()["direct"] is not None and modes._inflight == 0


@pytest.mark.parametrize("why", ["python path", "O_DIRECT refused", "mode set"])
def test_where_nothing_is_measured_the_read_mode_shows_buffered_or_set_and_no_speeds(
    tmp_path, monkeypatch, why
) -> None:
    """The gauges say what this store does: with the Python reader, or a file system that refuses
    O_DIRECT, reads are buffered (0) and the directory's kept samples choose nothing, so none are shown; a
    mode set is that mode."""
    from tierkv.tiers.disk import segments

    (tmp_path / read_modes.FILE).write_text(json.dumps({"direct": [2e9] * 3, "buffered": [1e9] * 3}))
    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    if why == "O_DIRECT refused":
        monkeypatch.setattr(segments, "accepts_direct_io", lambda folder: False)
    kwargs = {"direct_reads": True} if why == "mode set" else {}
    with native.use(why != "python path"), TieredStore.open(tmp_path, host_bytes=0, **kwargs) as store:
        disk = store.stats()["disk"]
    expected = 1 if why == "mode set" and native.enabled() else 0
    assert disk["cold_reads_direct"] == expected
    assert disk["cold_read_direct_Bps"] == disk["cold_read_buffered_Bps"] == 0
