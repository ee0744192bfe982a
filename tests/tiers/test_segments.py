"""The disk tier's segment files (tiers/disk/segments.py, segment_writer.py) on real files: appends,
reads, scatter reads, hole punching, the read-descriptor cache, writer locks and temp-file cleanup."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import time

import pytest

from tierkv.tiers.disk import segments as seg_mod
from tierkv.tiers.disk.segment_writer import SegmentWriter
from tierkv.tiers.disk.segments import ALIGN, SegmentDir, aligned


@pytest.fixture
def segdir(tmp_path):
    d = SegmentDir(tmp_path / "segments", read_threads=2)
    yield d
    d.close()


def _write(segdir: SegmentDir, seg_id: int, records: list[list[bytes]], sync: bool = False) -> list[int]:
    w = SegmentWriter(segdir, seg_id, sync=sync)
    try:
        return w.append(records)
    finally:
        w.close()


def test_appended_records_read_back_exactly_in_any_order(segdir) -> None:
    a, b, c = os.urandom(100) + os.urandom(23), os.urandom(5000), os.urandom(ALIGN)
    w = SegmentWriter(segdir, 7, sync=True)
    offsets = w.append([[a[:100], memoryview(a[100:])], [b], [c]])  # a record is a list of buffers
    assert offsets == [0, ALIGN, ALIGN + aligned(5000)]  # each record starts on a page
    more = w.append([[b"tail"]])  # a second batch goes on where the first ended
    assert more == [ALIGN + aligned(5000) + ALIGN] and w.end == more[0] + ALIGN
    w.close()
    assert segdir.list_ids() == [7] and segdir.file(7).stat().st_size == w.end
    locations = [(7, offsets[2], len(c)), (7, offsets[0], len(a)), (7, more[0], 4), (7, offsets[1], len(b))]
    with segdir.read_lock:
        got = [bytes(v) for v in segdir.read(locations)]
    assert got == [c, a, b"tail", b]


def test_read_of_a_missing_segment_is_zeros(segdir) -> None:
    _write(segdir, 1, [[b"x" * 10]])
    with segdir.read_lock:
        got = [bytes(v) for v in segdir.read([(1, 0, 10), (2, 0, 10)])]
    assert got == [b"x" * 10, bytes(10)]  # fails verification downstream, never raises


def test_readv_scatters_into_views_and_reports_what_verify_rejected(segdir) -> None:
    recs = [os.urandom(300), os.urandom(ALIGN + 17), os.urandom(64)]
    offsets = _write(segdir, 3, [[r] for r in recs])
    other = os.urandom(200)
    (other_off,) = _write(segdir, 4, [[other]])
    # Each record split over several destinations (the restore path's prefix + one row per layer).
    dests = [[bytearray(n) for n in (10, len(r) - 10)] for r in recs] + [[bytearray(50), bytearray(150)]]
    requests = [(3, off, len(r), [memoryview(d) for d in ds]) for off, r, ds in zip(offsets, recs, dests)]
    requests.append((4, other_off, len(other), [memoryview(d) for d in dests[3]]))
    seen = []

    def verify(i: int) -> bool:
        seen.append(i)
        return i != 1

    assert segdir.readv(requests, verify) == [True, False, True, True]
    assert sorted(seen) == [0, 1, 2, 3]
    for ds, r in zip(dests, [*recs, other]):
        assert b"".join(ds) == r  # adjacent records read in one preadv, the page padding skipped


def test_readv_of_a_missing_segment_is_not_ok(segdir) -> None:
    dest = bytearray(8)
    assert segdir.readv([(9, 0, 8, [memoryview(dest)])], lambda i: True) == [False]


def _allocated(segdir: SegmentDir, seg_id: int) -> int:
    return segdir.file(seg_id).stat().st_blocks * 512


def _punch_supported(path) -> bool:
    probe = path / "probe"
    probe.write_bytes(os.urandom(2 * ALIGN))
    fd = os.open(probe, os.O_WRONLY)
    try:
        return seg_mod.punch_hole(fd, 0, ALIGN)
    finally:
        os.close(fd)
        probe.unlink()


def test_release_punches_dead_records_and_unlinks_emptied_segments(segdir, tmp_path) -> None:
    if not _punch_supported(tmp_path):
        pytest.skip("this file system cannot punch holes (see the unsupported case below)")
    recs = [os.urandom(64 << 10) for _ in range(3)]
    offsets = _write(segdir, 5, [[r] for r in recs], sync=True)
    before = _allocated(segdir, 5)
    assert before >= 3 * (64 << 10)
    freed = segdir.release([(5, offsets[1], len(recs[1]), False)])  # not emptied: the file stays
    assert freed == 64 << 10  # the bytes given back
    after = _allocated(segdir, 5)
    assert before - after >= 64 << 10 and after >= 2 * (64 << 10)  # the dead record's pages, not the others'
    with segdir.read_lock:
        got = [bytes(v) for v in segdir.read([(5, off, len(r)) for off, r in zip(offsets, recs)])]
    assert got == [recs[0], bytes(len(recs[1])), recs[2]]  # the neighbours are untouched
    assert segdir.counters.snapshot().get("disk", {}).get("punch_unsupported", 0) == 0
    freed += segdir.release([(5, offsets[0], len(recs[0]), False), (5, offsets[2], len(recs[2]), True)])
    assert not segdir.file(5).exists() and segdir.list_ids() == []
    assert freed == before  # all the file held: its records punched, then what was left unlinked
    assert segdir.release([]) == 0


class _NoPunchLibc:
    """A file system without PUNCH_HOLE (tmpfs before 3.5, some network file systems): fallocate fails."""

    def fallocate(self, fd: int, mode: int, offset: int, nbytes: int) -> int:
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1


def test_release_counts_punch_unsupported_and_still_unlinks(segdir, monkeypatch) -> None:
    offsets = _write(segdir, 6, [[os.urandom(ALIGN)] for _ in range(3)])
    monkeypatch.setattr(seg_mod, "_libc", _NoPunchLibc())
    held = _allocated(segdir, 6)
    assert segdir.release([(6, offsets[0], ALIGN, False), (6, offsets[1], ALIGN, False)]) == 0  # none back
    assert segdir.counters.snapshot()["disk"]["punch_unsupported"] == 2
    assert segdir.file(6).exists()
    # an emptied segment goes all the same, and with it all it held
    assert segdir.release([(6, offsets[2], ALIGN, True)]) == held >= 3 * ALIGN
    assert not segdir.file(6).exists()
    assert segdir.counters.snapshot()["disk"]["punch_unsupported"] == 3


def test_release_of_a_hole_in_an_already_unlinked_segment_is_not_punch_unsupported(segdir) -> None:
    offsets = _write(segdir, 8, [[os.urandom(ALIGN)] for _ in range(2)])
    segdir.unlink(8)  # another process freed the segment's last record and unlinked it meanwhile
    assert segdir.release([(8, offsets[0], ALIGN, False)]) == 0
    assert segdir.counters.snapshot().get("disk", {}).get("punch_unsupported", 0) == 0


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_read_descriptor_cache_stays_bounded_over_many_segments(segdir) -> None:
    n = seg_mod.MAX_READ_FDS + 44  # one descriptor per segment read this way: past the bound
    for seg_id in range(1, n + 1):
        _write(segdir, seg_id, [[seg_id.to_bytes(4, "little")]])
    fds0 = _fd_count()
    with segdir.read_lock:
        for seg_id in range(1, n + 1):
            got = bytes(segdir.read([(seg_id, 0, 4)])[0])  # views live until the next read: none kept
            assert int.from_bytes(got, "little") == seg_id
            assert segdir.open_fds() <= seg_mod.MAX_READ_FDS
    assert segdir.open_fds() == seg_mod.MAX_READ_FDS
    # The evicted descriptors were really closed (a little slack for other threads of the test process).
    assert _fd_count() - fds0 <= seg_mod.MAX_READ_FDS + 8
    with segdir.read_lock:  # an evicted segment is simply opened again
        assert bytes(segdir.read([(1, 0, 4)])[0]) == (1).to_bytes(4, "little")
    segdir.close()
    assert _fd_count() <= fds0 + 8


def test_a_descriptor_evicted_while_in_use_is_closed_after_its_read(segdir, monkeypatch) -> None:
    monkeypatch.setattr(seg_mod, "MAX_READ_FDS", 2)
    for seg_id in range(1, 5):
        _write(segdir, seg_id, [[b"abcd"]])
    with segdir._read_fd(1) as fd:
        with segdir.read_lock:
            for seg_id in (2, 3, 4):  # pushes segment 1 out of the cache while its read is in flight
                segdir.read([(seg_id, 0, 4)])
        assert segdir.open_fds() == 3  # two cached, one retired but still in use
        assert os.pread(fd, 4, 0) == b"abcd"  # not closed (nor its number reused) under the read
        assert _fd_path(fd) == str(segdir.file(1))
    assert segdir.open_fds() == 2
    assert _fd_path(fd) != str(segdir.file(1))  # closed once its read ended


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def test_forget_removed_drops_descriptors_of_unlinked_segments(segdir) -> None:
    for seg_id in (1, 2):
        _write(segdir, seg_id, [[b"abcd"]])
    with segdir.read_lock:
        segdir.read([(1, 0, 4), (2, 0, 4)])
    os.unlink(segdir.file(1))  # as another process's sweep does
    assert segdir.forget_removed() == 1
    assert segdir.open_fds() == 1


def test_is_active_while_a_writer_holds_the_segment(segdir) -> None:
    w = SegmentWriter(segdir, 11, sync=False)
    w.append([[b"live"]])
    assert segdir.is_active(11)
    assert segdir.is_active(11)  # the probe took no lock of its own that outlives it
    w.close()
    assert not segdir.is_active(11)
    assert not segdir.is_active(12)  # no such file


def test_remove_stale_temp_files_removes_only_old_unlocked_ones(segdir) -> None:
    def temp(seg_id: int, age_s: float):
        p = segdir.path / f"{seg_id:010d}.seg{seg_mod._TEMP}999-{seg_id}"
        p.write_bytes(b"partial")
        t = time.time() - age_s
        os.utime(p, (t, t))
        return p

    old, fresh, old_locked = temp(1, 3600), temp(2, 5), temp(3, 3600)
    _write(segdir, 4, [[b"named"]])
    os.utime(segdir.file(4), (time.time() - 3600,) * 2)
    fd = os.open(old_locked, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live creator between its open and its rename
    try:
        assert segdir.remove_stale_temp_files(min_age_s=600) == 1
    finally:
        os.close(fd)
    assert not old.exists() and fresh.exists() and old_locked.exists() and segdir.file(4).exists()
    assert segdir.remove_stale_temp_files(min_age_s=1) == 2  # past the age, once nobody holds them
    assert not fresh.exists() and not old_locked.exists() and segdir.file(4).exists()


def test_readv_returns_only_once_every_read_ended_even_after_one_failed(segdir, monkeypatch) -> None:
    """One group's transient error (no descriptors, say) makes the restore a miss; it must not leave
    another group still writing into the caller's buffer (which the next restore may take) or still
    calling ``after`` (a promotion behind a purge's fence, which waits only for the restore)."""
    import threading

    from tierkv.tiers.disk.files import TransientReadError

    (a,) = _write(segdir, 1, [[os.urandom(64)]])
    (b,) = _write(segdir, 2, [[os.urandom(64)]])
    ended = threading.Event()
    real = SegmentDir._readv_one

    def readv_one(self, seg_id, offset, views, sequential):
        if seg_id == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        time.sleep(0.3)  # the other group, still reading when the first fails
        got = real(self, seg_id, offset, views, sequential)
        ended.set()
        return got

    monkeypatch.setattr(SegmentDir, "_readv_one", readv_one)
    dest = [bytearray(64), bytearray(64)]
    requests = [(1, a, 64, [memoryview(dest[0])]), (2, b, 64, [memoryview(dest[1])])]
    with pytest.raises(TransientReadError):
        segdir.readv(requests, lambda i: True)
    assert ended.is_set()  # the slow group ended before readv raised


@pytest.mark.parametrize("err", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_file_system_refusing_o_direct_at_open_is_told_apart_from_a_failure(
    tmp_path, monkeypatch, err
) -> None:
    """``accepts_direct_io``: an open with O_DIRECT refused (EINVAL from Linux's own file systems,
    EOPNOTSUPP from some others) says no, and leaves no probe file; any other error cannot tell."""
    from tierkv.tiers.disk import files

    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            if flags & os.O_CREAT:
                os.close(real_open(path, flags & ~os.O_DIRECT, *args))  # created, then the flag refused
            raise OSError(fake_err, os.strerror(fake_err))
        return real_open(path, flags, *args)

    monkeypatch.setattr(files.os, "open", refusing)
    fake_err = err
    assert files.accepts_direct_io(tmp_path) is False and not list(tmp_path.iterdir())
    fake_err = errno.EACCES
    assert files.accepts_direct_io(tmp_path) is None
