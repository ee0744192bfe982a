"""No wrong KV under faults (issue 23), on real LMDB files and real tiers: a disk read error ends the prefix
and purges the record, a purge is a barrier for blocks still on their way, and ``invalidate`` removes
blocks a caller learnt may be wrong from every tier."""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time

import pytest
import torch

from tierkv import Namespace, TieredStore
from tierkv.keys import BlockChain

from helpers import make_kv

B = 16  # the ``ns`` fixture's block tokens


@pytest.mark.parametrize("codec_", ["raw", "zstd"])
def test_a_disk_read_error_ends_the_prefix_is_counted_purged_and_logged_once(
    tmp_path, ns, read_faults, data_path, caplog, codec_: str
) -> None:
    toks = list(range(6 * B))
    kv = make_kv(ns, 6 * B)
    chain = BlockChain.of(ns, toks)
    with TieredStore.open(tmp_path, host_bytes=0, codec_=codec_) as store:
        store.save(ns, toks, kv)
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=0, codec_=codec_) as store, caplog.at_level(logging.WARNING):
        read_faults.fail(store, chain, [3])
        hit, got = store.restore(ns, toks)  # was: OSError out of restore (a 500)
        assert hit.num_tokens == 3 * B and got is not None and torch.equal(got, kv[:, :, : 3 * B])
        store.flush()  # the purge is queued to the disk writer
        disk = store.stats()["disk"]
        assert disk["read_errors"] == 1 and disk["corrupt_blocks"] == 0
        read_faults.clear()  # the fault is gone: the record is not (purged, only if still indexed there)
        assert store.lookup(ns, toks).num_tokens == 3 * B
        assert store.tier("disk").probe(chain, range(6)) == [True] * 3 + [False] + [True] * 2

        # A second failing record, of another prompt: counted, purged, not logged again.
        other = list(range(1000, 1000 + 4 * B))
        other_kv = make_kv(ns, 4 * B, seed=5)
        store.save(ns, other, other_kv)
        store.flush()
        read_faults.fail(store, BlockChain.of(ns, other), [0])
        hit, got = store.restore(ns, other)
        assert hit.num_tokens == 0 and got is None
        store.flush()
        hit, got = store.restore(ns, other)  # purged: a plain miss, nothing read
        assert hit.num_tokens == 0 and got is None
        read_faults.clear()
        assert store.stats()["disk"]["read_errors"] == 2
        logged = [r for r in caplog.records if "read error" in r.getMessage()]
        assert len(logged) == 1, [r.getMessage() for r in logged]

        store.save(ns, toks, kv)  # recomputed and saved again
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["disk"] == 6 * B and torch.equal(got, kv)


def _other(ns: Namespace) -> Namespace:
    return dataclasses.replace(ns, tenant_salt="tenant-b")


def _stall_writer(store: TieredStore, monkeypatch, gate: threading.Event) -> None:
    """The disk writer waits on ``gate`` before each batch: what is saved meanwhile is queued, and the host
    slots it was copied into are held for it."""
    writer = store.tier("disk").writer
    write_batch = writer._write_batch
    monkeypatch.setattr(writer, "_write_batch", lambda items: (gate.wait(30), write_batch(items)))


def _stall_drain(store: TieredStore, monkeypatch, gate: threading.Event) -> None:
    """The staging ring's consumer waits on ``gate``: blocks saved meanwhile stay in the ring (made before
    the first save, which creates the ring with this consumer)."""
    drain = store.writes._drain
    monkeypatch.setattr(store.writes, "_drain", lambda slot, p: (gate.wait(30), drain(slot, p)))


def _nothing_anywhere(store: TieredStore, ns: Namespace, prompts: list[list[int]]) -> None:
    for toks in prompts:
        hit = store.lookup(ns, toks)
        assert hit.num_tokens == 0 and set(hit.by_tier.values()) == {0}, hit
        chain = BlockChain.of(ns, toks)
        for tier in store.tiers:  # not just the prefix: no block of it in any tier
            assert not any(tier.probe(chain, range(len(chain)))), tier.name


@pytest.mark.parametrize("scope", ["all", "namespace"])
def test_purge_leaves_nothing_of_what_it_named_in_flight_or_stored(tmp_path, ns, monkeypatch, scope) -> None:
    """Blocks of the purged namespace on disk, queued for a stalled disk writer (their host slots held
    for it) and still in the staging ring: after purge and flush none is in any tier, nor on disk after a
    reopen; the other namespace's blocks are all there (when only one namespace was purged)."""
    b = _other(ns)
    n_blocks = 16
    prompts = {
        (key, j): [j * 100_000 + (ord(key) << 8) + t for t in range(n_blocks * B)]
        for key in "ab"
        for j in range(3)
    }
    kvs = {k: make_kv(ns, n_blocks * B, seed=seed) for seed, k in enumerate(prompts)}
    spaces = {"a": ns, "b": b}
    writer_gate, drain_gate = threading.Event(), threading.Event()
    try:
        with TieredStore.open(
            tmp_path, host_bytes=4 * 6 * n_blocks * kvs["a", 0][:, :, :B].numel() * 2, staging=True
        ) as store:
            _stall_drain(store, monkeypatch, drain_gate)
            drain_gate.set()
            for key in "ab":  # on disk
                store.save(spaces[key], prompts[key, 0], kvs[key, 0])
            store.flush()
            _stall_writer(store, monkeypatch, writer_gate)
            for key in "ab":  # queued for the disk writer, in held host slots
                store.save(spaces[key], prompts[key, 1], kvs[key, 1])
            store.writes.flush()
            drain_gate.clear()
            for key in "ab":  # in the staging ring
                store.save(spaces[key], prompts[key, 2], kvs[key, 2])
            assert store.tier("host").contains(BlockChain.of(ns, prompts["a", 1]).keys)[0]

            if scope == "all":
                store.purge(purge_all=True)
            else:
                store.purge(ns.digest.hex()[:8])
            writer_gate.set()
            drain_gate.set()
            store.flush()
            purged = "ab" if scope == "all" else "a"
            for key in purged:
                _nothing_anywhere(store, spaces[key], [prompts[key, j] for j in range(3)])
            assert store.tier("host")._held == 0
        with TieredStore.open(tmp_path, host_bytes=0) as store:
            totals = store.tier("disk").totals()
            assert set(totals) == ({b.digest} if scope == "namespace" else set())
            for key in purged:
                _nothing_anywhere(store, spaces[key], [prompts[key, j] for j in range(3)])
            if scope == "namespace":
                assert totals[b.digest][0] == 3 * n_blocks
                for j in range(3):
                    hit, got = store.restore(b, prompts["b", j])
                    assert hit.by_tier["disk"] == n_blocks * B and torch.equal(got, kvs["b", j])
    finally:
        writer_gate.set()
        drain_gate.set()


def test_a_namespace_with_nothing_on_disk_yet_can_be_purged(tmp_path, ns, monkeypatch) -> None:
    """Its blocks are all on their way (the disk writer stalled): the prefix is still found, and purged."""
    toks = list(range(8 * B))
    gate = threading.Event()
    try:
        with TieredStore.open(tmp_path, host_bytes=2**22) as store:
            _stall_writer(store, monkeypatch, gate)
            store.save(ns, toks, make_kv(ns, 8 * B))
            out = store.purge(ns.digest.hex()[:8])
            assert out["purged"] == 0  # nothing was on disk yet
            gate.set()
            store.flush()
            _nothing_anywhere(store, ns, [toks])
        with TieredStore.open(tmp_path, host_bytes=0) as store:
            _nothing_anywhere(store, ns, [toks])
    finally:
        gate.set()


def test_purge_waits_for_a_restore_in_progress_and_drops_what_it_promoted(tmp_path, ns, monkeypatch) -> None:
    """A restore that read a block before the purge and copies it into the host tier after it (a slow
    reading thread): the purge waits for it, then clears what it promoted; its write-back is dropped."""
    toks = list(range(4 * B))
    kv = make_kv(ns, 4 * B)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=2**22) as store:
        disk = store.tier("disk")
        read_into = disk.read_into
        reading, go_on = threading.Event(), threading.Event()

        def slow_read(*args: object) -> int:
            got = read_into(*args)
            reading.set()
            go_on.wait(30)
            return got

        monkeypatch.setattr(disk, "read_into", slow_read)
        result: list[object] = []
        restore = threading.Thread(target=lambda: result.append(store.restore(ns, toks)))
        restore.start()
        assert reading.wait(30)
        purge = threading.Thread(target=lambda: store.purge(purge_all=True))
        purge.start()
        deadline = time.monotonic() + 30
        while store.lookup(ns, toks).num_tokens and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.lookup(ns, toks).num_tokens == 0  # the purge is under way: what it names is a miss
        purge.join(0.3)
        assert purge.is_alive()  # waiting for the restore that began before it
        go_on.set()
        restore.join(30)
        purge.join(30)
        assert not purge.is_alive() and result[0][0].num_tokens == 4 * B
        store.flush()
        _nothing_anywhere(store, ns, [toks])


@pytest.mark.parametrize("removal", ["purge", "invalidate", "invalidate-first-two"])
def test_a_restore_the_fence_gave_up_waiting_for_promotes_nothing_it_removed(
    tmp_path, ns, monkeypatch, data_path, removal: str
) -> None:
    """A restore stuck between reading its blocks and promoting them, past ``FENCE_WAIT_S``: the purge (or
    invalidation) goes on without it; when the restore resumes it still returns the KV it read, but puts
    none of what was removed back into the host tier (checked as a block is published), nor writes it
    back; the blocks an invalidation left alone are still promoted."""
    import tierkv.generations
    import tierkv.restores

    toks = list(range(4 * B))
    kv = make_kv(ns, 4 * B)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    monkeypatch.setattr(tierkv.generations, "FENCE_WAIT_S", 0.2)
    stalled, go_on = threading.Event(), threading.Event()

    class Stalled:
        """The restore's promoter, held before it copies anything."""

        def __init__(self, promote) -> None:
            self.promote = promote

        def __call__(self, i, block) -> None:
            stalled.set()
            go_on.wait(30)
            self.promote(i, block)

        def run(self, buf, idx, base) -> None:
            stalled.set()
            go_on.wait(30)
            self.promote.run(buf, idx, base)

    real = tierkv.restores.promoter
    monkeypatch.setattr(
        tierkv.restores, "promoter", lambda *a, **k: None if (p := real(*a, **k)) is None else Stalled(p)
    )
    with TieredStore.open(tmp_path, host_bytes=2**22) as store:
        result: list[object] = []
        restore = threading.Thread(target=lambda: result.append(store.restore(ns, toks)))
        restore.start()
        try:
            assert stalled.wait(30)
            if removal == "purge":
                store.purge(purge_all=True)  # gives up waiting for the restore after 0.2 s
            elif removal == "invalidate":
                assert store.invalidate(ns, toks, range(4)) == 4
            else:
                assert store.invalidate(ns, toks, [0, 1]) == 2
        finally:
            go_on.set()
            restore.join(30)
        hit, got = result[0]
        assert hit.num_tokens == 4 * B and torch.equal(got, kv)  # what it read is still the right KV
        store.flush()
        if removal != "invalidate-first-two":
            _nothing_anywhere(store, ns, [toks])
        else:
            chain = BlockChain.of(ns, toks)
            assert store.tier("host").probe(chain, range(4)) == [False, False, True, True]
            assert store.tier("disk").probe(chain, range(4)) == [False, False, True, True]
    if removal != "invalidate-first-two":
        with TieredStore.open(tmp_path, host_bytes=0) as store:
            _nothing_anywhere(store, ns, [toks])


def test_invalidate_removes_blocks_from_every_tier_and_cancels_their_pending_writes(
    tmp_path, ns, monkeypatch
) -> None:
    toks = list(range(8 * B))
    kv = make_kv(ns, 8 * B)
    queued = list(range(5000, 5000 + 4 * B))
    queued_kv = make_kv(ns, 4 * B, seed=3)
    chain, queued_chain = BlockChain.of(ns, toks), BlockChain.of(ns, queued)
    gate = threading.Event()
    try:
        with TieredStore.open(tmp_path, host_bytes=2**22) as store:
            host, disk = store.tier("host"), store.tier("disk")
            store.save(ns, toks, kv)
            store.flush()
            assert host.probe(chain, range(8)) == disk.probe(chain, range(8)) == [True] * 8
            _stall_writer(store, monkeypatch, gate)
            store.save(ns, queued, queued_kv)  # in the host tier, queued for the disk writer
            assert store.invalidate(ns, toks, [2, 5]) == 2
            assert store.invalidate(ns, queued_chain, [1]) == 1
            assert store.invalidate(ns, toks, [2]) == 0  # gone already
            gate.set()
            store.flush()
            for tier in (host, disk):
                assert tier.probe(chain, range(8)) == [True, True, False, True, True, False, True, True]
                assert tier.probe(queued_chain, range(4)) == [True, False, True, True]
            assert store.lookup(ns, toks).num_tokens == 2 * B
            hit, got = store.restore(ns, toks)
            assert hit.num_tokens == 2 * B and torch.equal(got, kv[:, :, : 2 * B])
        with TieredStore.open(tmp_path, host_bytes=2**22) as store:
            disk = store.tier("disk")
            assert disk.probe(chain, range(8)) == [True, True, False, True, True, False, True, True]
            assert disk.probe(queued_chain, range(4)) == [True, False, True, True]
            fixed = kv.clone()
            new = make_kv(ns, 8 * B, seed=9)
            for i in (2, 5):  # saved again, with other KV: the new KV is what is served
                fixed[:, :, i * B : (i + 1) * B] = new[:, :, i * B : (i + 1) * B]
            store.save(ns, toks, fixed)
            fixed_queued = queued_kv.clone()
            fixed_queued[:, :, B : 2 * B] = make_kv(ns, B, seed=11)
            store.save(ns, queued, fixed_queued)
            hit, got = store.restore(ns, toks)
            assert hit.num_tokens == 8 * B and torch.equal(got, fixed)
            store.flush()
        with TieredStore.open(tmp_path, host_bytes=0) as store:
            hit, got = store.restore(ns, toks)
            assert hit.by_tier["disk"] == 8 * B and torch.equal(got, fixed)
            hit, got = store.restore(ns, queued)
            assert hit.by_tier["disk"] == 4 * B and torch.equal(got, fixed_queued)
    finally:
        gate.set()


def test_invalidate_of_a_block_in_the_staging_ring_drops_it(tmp_path, ns, monkeypatch) -> None:
    toks = list(range(4 * B))
    kv = make_kv(ns, 4 * B)
    gate = threading.Event()
    try:
        with TieredStore.open(tmp_path, host_bytes=2**22, staging=True) as store:
            _stall_drain(store, monkeypatch, gate)
            store.save(ns, toks, kv)
            store.invalidate(ns, toks, [0, 3])
            gate.set()
            store.flush()
            for tier in store.tiers:
                assert tier.probe(BlockChain.of(ns, toks), range(4)) == [False, True, True, False], tier.name
    finally:
        gate.set()


def test_gc_check_purges_an_unreadable_record_and_counts_it(tmp_path, ns, read_faults) -> None:
    toks = list(range(4 * B))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, make_kv(ns, 4 * B))
        store.flush()
        read_faults.fail(store, BlockChain.of(ns, toks), [2])
        out = store.gc(check=True)  # was: OSError out of the check
        read_faults.clear()
        assert out["checked"] == 4 and out["corrupt"] == 1
        assert store.stats()["disk"]["read_errors"] == 1
        assert store.lookup(ns, toks).num_tokens == 2 * B


def test_a_read_that_fails_for_want_of_descriptors_purges_nothing(
    tmp_path, ns, read_faults, data_path
) -> None:
    """EMFILE (a process at its descriptor limit) says nothing about the records: a miss, never a purge
    (every restore would otherwise wipe the blocks it tried to read)."""
    toks = list(range(4 * B))
    kv = make_kv(ns, 4 * B)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        read_faults.fail_all(store, errno.EMFILE)
        hit, got = store.restore(ns, toks)
        assert hit.num_tokens == 0 and got is None
        store.flush()
        disk = store.stats()["disk"]
        assert disk["transient_read_errors"] == 1 and disk["read_errors"] == 0 and disk["corrupt_blocks"] == 0
        read_faults.clear()
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["disk"] == 4 * B and torch.equal(got, kv)
