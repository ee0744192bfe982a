"""Power cuts, not only SIGKILL: SIGKILL keeps the page cache, so it cannot see a missing or misordered sync.

The harness records, at the file layer, every write, sync, rename, unlink and hole punch the store makes
to its segment files, and a snapshot of the index file after each LMDB commit (the store's index commits
are synchronous: a commit that returned is durable, one in flight leaves the previous state). From the
log it builds crash states in the CrashMonkey / ALICE manner: cut the log at each point, keep the last
committed index and, of the segment operations not yet made durable by a sync, none, all, an in-order
prefix, or a random subset. For each state the store must open, its totals must equal a full scan, every
indexed record must verify (with correct ordering none can be damaged), every block served must be one
that was saved, and every prefix whose flush returned before the cut must be there whole.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import threading
from pathlib import Path

import pytest
import torch

from tierkv import TieredStore, native
from tierkv.tiers.disk import index as index_mod
from tierkv.tiers.disk import segment_writer as segment_writer_mod
from tierkv.tiers.disk import segments as segments_mod

from helpers import make_kv

TTL_S = 100.0


@dataclasses.dataclass
class Op:
    kind: str  # write | sync | dirsync | create | rename | unlink | punch | commit | flushed | gone | clock
    path: str = ""
    offset: int = 0
    data: bytes = b""
    nbytes: int = 0
    dest: str = ""
    value: float = 0.0
    prompt: int = -1


class RecordingOS:
    """Stands in for ``os`` inside ``tierkv.tiers.disk.segments`` and ``segment_writer``: records what
    reaches the file layer."""

    def __init__(self, log: list[Op]) -> None:
        self._log = log

    def __getattr__(self, name: str):
        return getattr(os, name)

    @staticmethod
    def _path(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def open(self, path, flags, mode=0o777, **kw):
        fd = os.open(path, flags, mode, **kw)
        if flags & os.O_CREAT:
            self._log.append(Op("create", self._path(fd)))
        return fd

    def pwritev(self, fd, buffers, offset):
        data = b"".join(bytes(b) for b in buffers)
        n = os.pwritev(fd, buffers, offset)
        self._log.append(Op("write", self._path(fd), offset, data[:n]))
        return n

    def fdatasync(self, fd):
        os.fdatasync(fd)
        self._log.append(Op("sync", self._path(fd)))

    def fsync(self, fd):
        os.fsync(fd)
        path = self._path(fd)
        self._log.append(Op("dirsync" if os.path.isdir(path) else "sync", path))

    def rename(self, src, dst):
        os.rename(src, dst)
        self._log.append(Op("rename", str(src), dest=str(dst)))

    def unlink(self, path):
        os.unlink(path)
        self._log.append(Op("unlink", str(path)))


class RecordingNative:
    """Stands in for ``tierkv.native`` inside ``segment_writer``: the native writer's own writes and syncs,
    as it logged them (``trace_writes``), in order, each write's bytes read back from the file."""

    def __init__(self, log: list[Op]) -> None:
        self._log = log
        self.direct_runs = 0  # runs written through an O_DIRECT descriptor
        # One run at a time: the native trace is one buffer that each run's start clears, and the disk
        # writer's two appending threads may run two at once (each into its own file range; a batch is
        # still indexed only after its own run's sync, which the log keeps in order).
        self._one_run = threading.Lock()

    def enabled(self) -> bool:
        return native.enabled()

    def module(self) -> RecordingNative:
        return self

    def write_run(self, fd, offset, records, sync, idle, direct_fd=-1, expect_nbytes=-1):
        with self._one_run:
            return self._write_run(fd, offset, records, sync, idle, direct_fd, expect_nbytes)

    def _write_run(self, fd, offset, records, sync, idle, direct_fd, expect_nbytes):
        nat = native.module()
        self.direct_runs += direct_fd >= 0
        nat.trace_writes(True)
        try:
            return nat.write_run(fd, offset, records, sync, idle, direct_fd, expect_nbytes)
        finally:
            events = nat.trace_writes(False)
            path = RecordingOS._path(fd)
            rfd = os.open(path, os.O_RDONLY)  # the writer's own is write-only
            try:
                for kind, efd, off, n in events:
                    assert efd in (fd, direct_fd)  # the segment's own, or its O_DIRECT one
                    if kind == "write":
                        self._log.append(Op("write", path, off, os.pread(rfd, n, off)))
                    elif kind == "allocate":
                        self._log.append(Op("extend", path, off, nbytes=n))
                    elif kind == "punch":  # a failed run's space given back
                        self._log.append(Op("punch", path, off, nbytes=n))
                    else:
                        self._log.append(Op("sync", path))
            finally:
                os.close(rfd)


@dataclasses.dataclass
class FileState:
    durable: bytearray | None  # content a power cut keeps (as of its last sync)
    pending: list[Op]  # writes and punches since its last sync, in order
    exists: bool  # in the directory as the running system sees it
    durably_named: bool  # in the directory as of its last fsync


def _apply(content: bytearray, op: Op) -> None:
    if op.kind == "write":
        end = op.offset + len(op.data)
        if len(content) < end:
            content.extend(bytes(end - len(content)))
        content[op.offset : end] = op.data
    elif op.kind == "extend":  # fallocate: the file is at least this long, zeros where nothing was written
        end = op.offset + op.nbytes
        if len(content) < end:
            content.extend(bytes(end - len(content)))
    elif op.kind == "punch":  # reads as zeros, the size is kept
        end = min(len(content), op.offset + op.nbytes)
        content[op.offset : end] = bytes(max(0, end - op.offset))


def crash_state(
    log: list[Op], cut: int, policy: str, rng: random.Random, base_index: bytes
) -> tuple[bytes, dict[str, bytes]]:
    """(index file, segment files) after a power cut at ``cut``. ``policy``: of what no sync made durable,
    ``synced`` keeps nothing, ``all`` everything, ``prefix`` the first k operations of each file,
    ``subset`` a random subset (reordered writes); directory changes not fsync'ed are lost under
    ``synced`` and kept otherwise."""
    files: dict[str, FileState] = {}
    index = base_index
    for op in log[:cut]:
        if op.kind == "commit":
            index = op.data
        elif op.kind == "create":
            files[op.path] = FileState(None, [], True, False)
        elif op.kind in ("write", "punch", "extend"):
            files[op.path].pending.append(op)
        elif op.kind == "sync":
            f = files[op.path]
            content = f.durable if f.durable is not None else bytearray()
            for p in f.pending:
                _apply(content, p)
            f.durable, f.pending = content, []
        elif op.kind == "rename":
            f = files.pop(op.path)
            files[op.dest] = FileState(f.durable, f.pending, True, False)
        elif op.kind == "unlink":
            files[op.path].exists = False
        elif op.kind == "dirsync":
            for path, f in list(files.items()):
                if os.path.dirname(path) == op.path.rstrip("/"):
                    f.durably_named = f.exists
                    if not f.exists:
                        del files[path]
    out: dict[str, bytes] = {}
    for path, f in files.items():
        if not (f.durably_named if policy == "synced" else f.exists):
            continue
        content = bytearray(f.durable or b"")
        if policy == "all":
            keep = f.pending
        elif policy == "prefix":
            keep = f.pending[: rng.randint(0, len(f.pending))]
        elif policy == "subset":
            keep = [p for p in f.pending if rng.random() < 0.5]
        else:
            keep = []
        for p in keep:
            _apply(content, p)
        out[path] = bytes(content)
    return index, out


def record_workload(root: Path, ns, monkeypatch) -> tuple[list[Op], bytes]:
    """Saves, flushes, an expiry and re-save, a budget eviction, purges and a compaction, recorded."""
    log: list[Op] = []
    now = [1000.0]
    recording = RecordingOS(log)
    monkeypatch.setattr(segments_mod, "os", recording)
    monkeypatch.setattr(segment_writer_mod, "os", recording)
    recording_native = RecordingNative(log)
    monkeypatch.setattr(segment_writer_mod, "native", recording_native)
    real_punch = segments_mod.punch_hole

    def punch(fd: int, offset: int, nbytes: int) -> bool:
        ok = real_punch(fd, offset, nbytes)
        log.append(Op("punch", RecordingOS._path(fd), offset, nbytes=nbytes))
        return ok

    monkeypatch.setattr(segments_mod, "punch_hole", punch)
    real_write = index_mod.Index.write

    def write(self, fn):
        result = real_write(self, fn)
        log.append(Op("commit", data=(self.path / "index" / "data.mdb").read_bytes()))
        return result

    store = TieredStore.open(
        root,
        host_bytes=0,
        ttl_s=TTL_S,
        clock=lambda: now[0],
        batch_nbytes=12 * 1024,
        segment_nbytes=64 * 1024,
        map_nbytes=1 << 20,
    )
    store.flush()
    base_index = (root / "index" / "data.mdb").read_bytes()
    monkeypatch.setattr(index_mod.Index, "write", write)
    with store:
        for p in range(8):
            store.save(ns, [p * 1000 + t for t in range(48)], make_kv(ns, 48, seed=p))
            if p % 2:
                store.flush()
                log += [Op("flushed", prompt=q) for q in range(p + 1)]
        now[0] += TTL_S + 1  # everything expires; prompts 0-3 are saved again and replace their records
        log.append(Op("clock", value=now[0]))
        log += [Op("gone", prompt=q) for q in range(8)]
        for p in range(4):
            store.save(ns, [p * 1000 + t for t in range(48)], make_kv(ns, 48, seed=p))
        store.flush()
        log += [Op("flushed", prompt=q) for q in range(4)]
        store.tier("disk").expire()  # sweeps 4-7
        log += [Op("gone", prompt=q) for q in range(4)]  # a budget evicts some blocks of 0-3
        store.tier("disk").enforce_budget(store.tier("disk").usage()["live_nbytes"] - 6 * 4096)
        store.tier("disk").compact()
        for p in range(8, 11):
            store.save(ns, [p * 1000 + t for t in range(48)], make_kv(ns, 48, seed=p))
        assert store.flush() == 0  # nothing was lost: every flushed prompt must survive
        log += [Op("flushed", prompt=q) for q in range(8, 11)]
        if native.enabled() and store.tier("disk").segments.direct_writes:
            assert recording_native.direct_runs  # the O_DIRECT writer is what the cuts replay
    monkeypatch.undo()
    return log, base_index


def check_state(
    root: Path, ns, index: bytes, segs: dict[str, bytes], src_root: Path, log: list[Op], cut: int
) -> None:
    shutil.rmtree(root, ignore_errors=True)
    (root / "index").mkdir(parents=True, mode=0o700)
    (root / "segments").mkdir(mode=0o700)
    (root / "index" / "data.mdb").write_bytes(index)
    for path, content in segs.items():
        rel = Path(path).relative_to(src_root)
        (root / rel).write_bytes(content)
    now = 1000.0
    durable: set[int] = set()
    for op in log[:cut]:
        if op.kind == "clock":
            now = op.value
        elif op.kind == "flushed":
            durable.add(op.prompt)
        elif op.kind == "gone":
            durable.discard(op.prompt)
    with TieredStore.open(root, host_bytes=0, clock=lambda: now) as store:
        disk = store.tier("disk")
        by_ns: dict[bytes, list[int]] = {}
        for _, e in disk.snapshot_entries():
            row = by_ns.setdefault(e.ns_digest, [0, 0])
            row[0] += 1
            row[1] += e.footprint
        assert disk.totals() == {k: tuple(v) for k, v in by_ns.items()}, f"cut {cut}: totals"
        for p in range(11):
            toks = [p * 1000 + t for t in range(48)]
            n, kv = store.load(ns, toks)
            if n:
                assert torch.equal(kv, make_kv(ns, 48, seed=p)[:, :, :n]), f"cut {cut}: prompt {p} wrong KV"
            if p in durable:
                assert n == 48, f"cut {cut}: prompt {p} was flushed, {n} of 48 tokens survived"
        assert store.lookup(ns, [999_000 + t for t in range(48)]).num_tokens == 0  # never saved: never served
        assert store.stats()["disk"]["corrupt_blocks"] == 0, f"cut {cut}: an indexed record is damaged"
        assert disk.check().corrupt == 0, f"cut {cut}: an indexed record is damaged"
        store.save(ns, [7 * 1000 + t for t in range(48)], make_kv(ns, 48, seed=7))  # and it takes writes
        store.flush()
        assert store.lookup(ns, [7 * 1000 + t for t in range(48)]).num_tokens == 48


def run_power_cuts(tmp_path: Path, ns, monkeypatch, samples_per_cut: int, every: int = 1) -> dict[str, int]:
    src = tmp_path / "src"
    log, base_index = record_workload(src, ns, monkeypatch)
    rng = random.Random(7)
    counts = {
        "ops": len(log),
        "states": 0,
        "commits": sum(op.kind == "commit" for op in log),
        "syncs": sum(op.kind in ("sync", "dirsync") for op in log),
    }
    for cut in range(0, len(log) + 1, every):
        if log[cut - 1].kind in ("flushed", "gone", "clock") and cut:
            continue  # markers change nothing on disk
        for policy in ("synced", "all", "prefix", *["subset"] * samples_per_cut):
            index, segs = crash_state(log, cut, policy, rng, base_index)
            check_state(tmp_path / "crash", ns, index, segs, src, log, cut)
            counts["states"] += 1
    return counts


@pytest.mark.slow  # a crash variant (30 s for both paths): .ci/run runs it beside the test command
def test_power_cuts_at_every_point_of_a_workload(tmp_path, ns, monkeypatch, data_path) -> None:
    # The native writer (the default) at every point; the Python one, the fallback, at every third (the
    # test command must stay under 10 minutes; --runslow's many-subsets variant covers both at every point).
    every = 1 if data_path == "native" else 3
    counts = run_power_cuts(tmp_path, ns, monkeypatch, samples_per_cut=1, every=every)
    assert counts["commits"] >= 10 and counts["syncs"] >= 5
    assert counts["states"] >= 4 * 40 // every
    print(f"power-cut states checked: {counts}")


@pytest.mark.slow
def test_power_cuts_many_random_subsets(tmp_path, ns, monkeypatch, data_path) -> None:
    counts = run_power_cuts(tmp_path, ns, monkeypatch, samples_per_cut=12)
    print(f"power-cut states checked: {counts}")


def test_the_harness_catches_a_missing_sync(tmp_path, ns, monkeypatch, data_path) -> None:
    """Without the segment's fdatasync before the index commit, some crash state serves damaged records:
    the harness would see it (so its passing above means something)."""
    monkeypatch.setattr(
        segment_writer_mod.SegmentWriter, "__init__", _no_sync_init(segment_writer_mod.SegmentWriter.__init__)
    )
    src = tmp_path / "src"
    log, base_index = record_workload(src, ns, monkeypatch)
    assert not any(op.kind == "sync" for op in log)
    failures = 0
    for cut in range(0, len(log) + 1, 3):
        index, segs = crash_state(log, cut, "synced", random.Random(0), base_index)
        try:
            check_state(tmp_path / "crash", ns, index, segs, src, log, cut)
        except AssertionError:
            failures += 1
    assert failures > 0


def _no_sync_init(init):
    def wrapped(self, segments, seg_id, sync):
        init(self, segments, seg_id, sync)
        self.sync = False  # appends are no longer fdatasync'ed

    return wrapped
