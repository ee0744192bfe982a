"""The write-behind (tierkv/write_behind.py) on real tiers: a host pool and a disk tier in a temp folder."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tierkv import codec
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec
from tierkv.metrics import Counters
from tierkv.tiers.base import Tier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.target import Stagers
from tierkv.write_behind import WriteBehind

from helpers import make_kv

N = 4  # blocks per prompt


def _wb(tiers: list[Tier], counters: Counters, staging: bool | None) -> WriteBehind:
    return WriteBehind(
        tiers,
        codec_=codec.Codec.RAW,
        clock=time.time,
        counters=counters,
        staging=staging,
        staging_nbytes=1 << 20,
        staging_wait_s=1.0,
    )


@pytest.fixture
def counters() -> Counters:
    return Counters()


@pytest.fixture
def host(counters) -> HostTier:
    return HostTier(1 << 20, pin=False, counters=counters)


@pytest.fixture
def disk(tmp_path, counters):
    d = DiskTier(tmp_path / "disk", sync=False, counters=counters)
    yield d
    d.close()


@pytest.fixture
def chain_kv(ns):
    toks = list(range(N * ns.block_tokens))
    return BlockChain.of(ns, toks), make_kv(ns, len(toks), seed=11)


def _blocks(ns, kv: torch.Tensor, first: int = 0) -> list[torch.Tensor]:
    B = ns.block_tokens
    return [kv[:, :, i * B : (i + 1) * B] for i in range(first, kv.shape[2] // B)]


def _read(tier: Tier, chain: BlockChain, count: int) -> torch.Tensor | None:
    """Blocks 0..count-1 as the tier serves them, None unless it holds every one."""
    spec = KVSpec.of(chain.ns)
    dest = torch.zeros(spec.shape(count * spec.block_tokens), dtype=spec.dtype)
    with Stagers().target(dest, spec) as target:
        got = tier.read_into(chain, 0, count, target)
    return dest if got == count else None


def _written(counters: Counters, name: str) -> int:
    return counters.snapshot().get(name, {}).get("blocks_written", 0)


def _flush(wb: WriteBehind, *tiers: Tier) -> None:
    wb.flush()
    for t in tiers:
        t.flush()


@pytest.mark.parametrize("staging", [None, True], ids=["direct", "staging-ring"])
def test_a_save_of_cpu_blocks_reaches_host_and_disk(ns, host, disk, counters, chain_kv, staging) -> None:
    chain, kv = chain_kv
    wb = _wb([host, disk], counters, staging)
    try:
        assert wb.save(chain, 0, _blocks(ns, kv)) == N
        _flush(wb, disk)
        assert host.probe(chain, range(N)) == [True] * N
        assert disk.probe(chain, range(N)) == [True] * N
        assert torch.equal(_read(host, chain, N), kv) and torch.equal(_read(disk, chain, N), kv)
        assert _written(counters, "host") == N and _written(counters, "disk") == N
    finally:
        wb.close()


def _stall(disk: DiskTier, ns) -> threading.Event:
    """Hold the disk writer thread inside a batch until the returned event is set: what is queued next
    is encoded only after that (the writer encodes records on its own thread)."""
    gate = threading.Event()
    entered = threading.Event()

    def record() -> list[bytes]:
        entered.set()
        gate.wait(60)
        return [b"an unrelated record"]

    assert disk.put(ns.digest, bytes(32), record, 32, time.time())
    assert entered.wait(60)
    return gate


@pytest.mark.parametrize("with_host", [True, False], ids=["held-host-slot", "private-copy"])
@pytest.mark.parametrize("staging", [None, True], ids=["direct", "staging-ring"])
def test_a_reused_source_buffer_does_not_change_what_was_saved(
    ns, host, disk, counters, chain_kv, with_host, staging
) -> None:
    chain, kv = chain_kv
    tiers: list[Tier] = [host, disk] if with_host else [disk]
    wb = _wb(tiers, counters, staging)
    gate = _stall(disk, ns)
    try:
        source = kv.clone()  # the caller's buffer
        assert wb.save(chain, 0, _blocks(ns, source)) == N
        source.fill_(0)  # reused at once, before the disk writer has encoded anything
        gate.set()
        _flush(wb, disk)
        assert torch.equal(_read(disk, chain, N), kv)
        if with_host:
            assert torch.equal(_read(host, chain, N), kv)
    finally:
        gate.set()
        wb.close()


def test_blocks_every_destination_holds_are_not_written_again(ns, host, disk, counters, chain_kv) -> None:
    chain, kv = chain_kv
    wb = _wb([host, disk], counters, None)
    first = chain.prefix(2)
    assert wb.save(first, 0, _blocks(ns, kv[:, :, : 2 * ns.block_tokens])) == 2
    _flush(wb, disk)
    assert wb.save(first, 0, _blocks(ns, kv[:, :, : 2 * ns.block_tokens])) == 0  # nothing to do
    assert wb.save(chain, 0, _blocks(ns, kv)) == N - 2  # only the new blocks
    _flush(wb, disk)
    assert _written(counters, "host") == N and _written(counters, "disk") == N
    host.clear()  # the host lost them, the disk did not: only the host is written
    assert wb.save(chain, 0, _blocks(ns, kv)) == N
    _flush(wb, disk)
    assert _written(counters, "host") == 2 * N and _written(counters, "disk") == N
    assert torch.equal(_read(host, chain, N), kv)


def test_a_block_queued_for_the_disk_is_not_queued_twice(ns, disk, counters, chain_kv) -> None:
    chain, kv = chain_kv
    wb = _wb([disk], counters, None)
    gate = _stall(disk, ns)
    try:
        assert wb.save(chain, 0, _blocks(ns, kv)) == N
        assert wb.save(chain, 0, _blocks(ns, kv)) == 0  # still in the queue: the disk does not need them
    finally:
        gate.set()
    _flush(wb, disk)
    assert _written(counters, "disk") == N + 1  # N blocks and the stalling record


def test_start_block_skips_the_blocks_before_it(ns, host, counters, chain_kv) -> None:
    chain, kv = chain_kv
    wb = _wb([host], counters, None)
    assert wb.save(chain, 2, _blocks(ns, kv, first=2)) == N - 2
    assert host.probe(chain, range(N)) == [False, False, True, True]
    with host.read([chain.keys[2]]) as (view,):
        spec = KVSpec.of(ns)
        assert torch.equal(view.view(spec.dtype).view(spec.block_shape), _blocks(ns, kv)[2])


def test_write_back_writes_only_to_the_named_tiers(ns, host, disk, counters, chain_kv) -> None:
    chain, kv = chain_kv
    wb = _wb([host, disk], counters, None)
    blocks = _blocks(ns, kv)
    wb.write_back(chain, {disk: [0, 2]}, lambda i: blocks[i], {0: 123.0})
    _flush(wb, disk)
    assert disk.probe(chain, range(N)) == [True, False, True, False]
    assert host.probe(chain, range(N)) == [False] * N and _written(counters, "host") == 0
    entries = disk.locate(chain.keys[:1])
    assert entries[0].created_s == 123.0  # a restored block keeps its age
    wb.write_back(chain, {host: [1], disk: [1, 3]}, lambda i: blocks[i], {})
    _flush(wb, disk)
    assert host.probe(chain, range(N)) == [False, True, False, False]
    assert disk.probe(chain, range(N)) == [True] * N
    assert torch.equal(_read(disk, chain, N), kv)


class _Refuser(Tier):
    """A record tier that wants every block and refuses every write (a full queue, a degraded disk)."""

    name = "refuser"

    def probe(self, chain, idx):
        return [False] * len(idx)

    def write(self, block):
        return False


class _Sink(Tier):
    """A record tier that keeps what it is given (its bytes, read when written) and releases at once."""

    name = "sink"

    def __init__(self) -> None:
        self.got: dict[bytes, bytes] = {}

    def probe(self, chain, idx):
        return [k in self.got for k in (chain.keys[i] for i in idx)]

    def write(self, block):
        self.got[block.key] = block.payload.numpy().tobytes()
        block.done()
        return True


@pytest.mark.parametrize("staging", [False, True])
def test_a_refused_first_writer_does_not_release_the_slot_the_second_reads(ns, staging) -> None:
    """Review finding: the second record tier's reference was taken after the first had already given
    its back (a refused write), so save raised or the slot was handed out unreferenced."""
    from tierkv import TieredStore

    host, sink = HostTier(1 << 20), _Sink()
    kv = make_kv(ns, N * ns.block_tokens, seed=3)
    chain = BlockChain.of(ns, list(range(N * ns.block_tokens)))
    with TieredStore([host, _Refuser(), sink], staging=staging) as store:
        assert store.save(ns, chain, kv) == N
        store.flush()
        assert host._held == 0  # every reference given back, none twice
        spec = KVSpec.of(ns)
        B = ns.block_tokens
        for i in range(N):
            want = kv[:, :, i * B : (i + 1) * B].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert sink.got[chain.keys[i]] == want and len(want) == spec.block_nbytes


def test_a_write_back_is_copied_before_restore_returns(tmp_path, ns) -> None:
    """Review finding: blocks the disk lost were written back from the caller's ``out`` after restore
    returned; a caller reusing ``out`` must not change what reaches the disk."""
    from tierkv import TieredStore

    T = N * ns.block_tokens
    kv = make_kv(ns, T, seed=4)
    toks = list(range(T))
    with TieredStore.open(tmp_path, host_bytes=1 << 20, staging=True) as store:
        store.save(ns, toks, kv)
        store.flush()
        store.tier("disk").purge_namespace(None)  # the disk lost them; the host still has them
        out = torch.empty_like(kv)
        hit, _ = store.restore(ns, toks, out=out)
        assert hit.by_tier["host"] == T
        out.zero_()  # the caller reuses its buffer at once
        store.flush()
        store.tier("host").clear()
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["disk"] == T and torch.equal(got, kv)


def _burst(store, ns, prompts: int, blocks: int, seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    B = ns.block_tokens
    out = []
    for p in range(prompts):
        toks = [p * 100_000 + t for t in range(blocks * B)]
        kv = make_kv(ns, blocks * B, seed=seed + p)
        store.save(ns, toks, kv)
        out.append((toks, kv))
    return out


def test_a_burst_larger_than_the_disk_queue_loses_nothing_the_host_tier_holds(tmp_path, ns) -> None:
    """The host tier is write-back: a block the disk writer's queue has no room for waits there (dirty)
    and is written once there is room; flush() waits for all of it. Nothing is dropped or lost."""
    from tierkv import TieredStore

    block_nbytes = KVSpec.of(ns).block_nbytes
    with TieredStore.open(tmp_path, host_bytes=400 * block_nbytes, queue_nbytes=8 * block_nbytes) as store:
        saved = _burst(store, ns, prompts=10, blocks=30)  # 300 blocks through a queue of 8
        lost = store.flush()
        stats = store.stats()["disk"]
        assert lost == 0 and stats["dropped_saves"] == 0 and stats["writeback_lost_blocks"] == 0
        assert stats["blocks_written"] == 300
    with TieredStore.open(tmp_path, host_bytes=0) as store:  # after a restart: all of it on disk
        for toks, kv in saved:
            hit, got = store.restore(ns, toks)
            assert hit.by_tier["disk"] == len(toks) and torch.equal(got, kv)


def test_a_dirty_block_that_must_leave_the_host_tier_is_counted_lost_and_flush_says_so(tmp_path, ns) -> None:
    from tierkv import TieredStore

    block_nbytes = KVSpec.of(ns).block_nbytes
    with TieredStore.open(tmp_path, host_bytes=40 * block_nbytes, queue_nbytes=4 * block_nbytes) as store:
        gate = threading.Event()
        writer = store.tier("disk").writer
        handle = writer._handle
        writer._batches._handle = lambda items: (gate.wait(30), handle(items))  # the disk stalls
        try:
            _burst(store, ns, prompts=4, blocks=30)  # 120 blocks: the host tier holds 40
        finally:
            gate.set()
        lost = store.flush()
        stats = store.stats()["disk"]
        assert stats["writeback_lost_blocks"] > 0
        assert (
            lost == stats["writeback_lost_blocks"] + stats["dropped_saves"] == 120 - stats["blocks_written"]
        )


def test_private_copies_are_reused_only_once_every_writer_released_them(ns) -> None:
    from tierkv.private_copies import PrivateCopies

    copies = PrivateCopies(free_max_nbytes=ns.block_tokens * 1 << 20)
    kv = make_kv(ns, ns.block_tokens)
    a = copies.copy(kv[:, :, :])
    assert torch.equal(a.view(kv.dtype).view(kv.shape), kv)
    first, second = copies.releases(a, 2)
    first()
    first()  # a writer's release counts once, however often it runs
    b = copies.copy(kv)
    assert b.data_ptr() != a.data_ptr()  # the second writer may still be reading a
    second()
    c = copies.copy(make_kv(ns, ns.block_tokens, seed=1))
    assert c.data_ptr() == a.data_ptr() and torch.equal(
        c.view(kv.dtype).view(kv.shape), make_kv(ns, ns.block_tokens, seed=1)
    )
    small = PrivateCopies(free_max_nbytes=0)  # past the bound a released copy is freed, not kept
    d = small.copy(kv)
    small.releases(d, 1)[0]()
    assert small.free_nbytes == 0
    # Another block size (another namespace saved now) takes the room of the old one.
    one = PrivateCopies(free_max_nbytes=a.numel())
    one.releases(one.copy(kv), 1)[0]()
    halves = [one.copy(kv[:, :, : ns.block_tokens // 2]) for _ in range(2)]
    for h in halves:
        one.releases(h, 1)[0]()
    assert one.free_nbytes == a.numel() and one.copy(kv).data_ptr() not in {h.data_ptr() for h in halves}
    one.close()  # closed: nothing kept, nor anything released after
    one.releases(one.copy(kv), 1)[0]()
    assert one.free_nbytes == 0


def _prompts(ns, count: int, seed: int) -> tuple[list[BlockChain], list[torch.Tensor]]:
    """``count`` distinct prompts of N blocks and their KV."""
    B = ns.block_tokens
    chains = [BlockChain.of(ns, [p * 10**6 + t for t in range(N * B)]) for p in range(count)]
    return chains, [make_kv(ns, N * B, seed=seed + p) for p in range(count)]


def test_a_copy_two_record_tiers_share_is_reused_only_after_the_slower_one_wrote_it(
    ns, disk, counters
) -> None:
    """The sink releases at once, the stalled disk writer later: until then the copy is not reused, and
    blocks saved meanwhile do not overwrite what the disk has yet to write."""
    sink = _Sink()
    wb = _wb([sink, disk], counters, None)
    gate = _stall(disk, ns)
    chains, kvs = _prompts(ns, 2, seed=20)
    try:
        assert wb.save(chains[0], 0, _blocks(ns, kvs[0])) == N
        assert wb.copies.free_nbytes == 0  # the sink has released, the disk writer not yet
        assert wb.save(chains[1], 0, _blocks(ns, kvs[1])) == N
        gate.set()
        _flush(wb, disk)
        for chain, kv in zip(chains, kvs):
            assert torch.equal(_read(disk, chain, N), kv)
    finally:
        gate.set()
        wb.close()


def test_a_save_while_the_disk_writer_still_reads_earlier_copies_gets_fresh_ones(ns, disk, counters) -> None:
    """Recycled private copies: blocks saved while the writer is stalled on earlier ones must not be
    copied into the memory the writer has yet to write (that would store one block's KV under another's
    key), and copies released after the write serve the next saves: every record reads back exact."""
    wb = _wb([disk], counters, None)
    gate = _stall(disk, ns)
    chains, kvs = _prompts(ns, 3, seed=10)
    try:
        assert wb.save(chains[0], 0, _blocks(ns, kvs[0])) == N
        assert wb.save(chains[1], 0, _blocks(ns, kvs[1])) == N  # the writer holds the first's copies
        gate.set()
        _flush(wb, disk)
        assert wb.copies.free_nbytes == 2 * N * KVSpec.of(ns).block_nbytes  # all released, all kept
        assert wb.save(chains[2], 0, _blocks(ns, kvs[2])) == N  # into recycled copies
        assert wb.copies.free_nbytes == N * KVSpec.of(ns).block_nbytes
        _flush(wb, disk)
        for chain, kv in zip(chains, kvs):
            assert torch.equal(_read(disk, chain, N), kv)
    finally:
        gate.set()
        wb.close()


def test_a_save_s_private_copies_are_made_in_one_native_call_and_match_torch_s(ns, monkeypatch) -> None:
    """Blocks of one KV tensor (in any order, strided views) are copied by one copy_blocks call; blocks
    that are not views of one tensor, or not of the canonical shape, by torch, each. Same bytes either way."""
    from tierkv import native
    from tierkv.private_copies import PrivateCopies

    if not native.enabled():
        pytest.skip(native.reason() or "no native build")
    B = ns.block_tokens
    kv = make_kv(ns, 8 * B, seed=5)
    wide = torch.zeros(kv.shape[0], 2, 10 * B, *kv.shape[3:], dtype=kv.dtype)
    wide[:, :, B : 9 * B] = kv  # a view inside a larger tensor: its rows are strided
    calls: list[int] = []
    real = native.module()

    class Counting:
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            if name == "copy_blocks":
                return lambda *a: (calls.append(len(a[3])), real.copy_blocks(*a))[1]
            return getattr(real, name)

    monkeypatch.setattr(native, "module", lambda: Counting())
    copies = PrivateCopies()
    for src, order in ((kv, [3, 0, 7, 1, 2, 6, 5, 4]), (wide[:, :, B : 9 * B], list(range(8)))):
        blocks = [src[:, :, i * B : (i + 1) * B] for i in order]
        got = copies.copy_many(blocks)
        for block, buf in zip(blocks, got):
            assert torch.equal(buf, block.contiguous().view(-1).view(torch.uint8))
    assert calls == [8, 8]
    mixed = [kv[:, :, :B], make_kv(ns, B, seed=6)]  # two tensors: torch's copies
    got = copies.copy_many(mixed)
    assert calls == [8, 8] and all(
        torch.equal(buf, b.contiguous().view(-1).view(torch.uint8)) for b, buf in zip(mixed, got)
    )


def test_prompts_saved_interleaved_are_written_each_in_one_run(tmp_path, ns) -> None:
    """Block b of every prompt saved before block b+1 of any (a server saving many prompts at once): the
    disk writer appends each prompt's blocks of a batch one after the other, so that its restore reads a
    run of adjacent records; what was queued, and a prefix two prompts share, restore exactly."""
    from tierkv import TieredStore

    B = ns.block_tokens
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        gate, busy = threading.Event(), threading.Event()
        writer = store.tier("disk").writer
        handle = writer._handle
        writer._batches._handle = lambda items: (busy.set(), gate.wait(30), handle(items))
        try:
            held = list(range(7 * 10**6, 7 * 10**6 + B))
            store.save(ns, held, make_kv(ns, B, seed=9))  # the writer's first batch, held at the gate
            assert busy.wait(30)
            shared = [10**6 + t for t in range(B)]
            prompts = [shared + [p * 100_000 + t for t in range(5 * B)] for p in range(3)]
            kvs = [make_kv(ns, 6 * B, seed=p) for p in range(3)]
            for p in range(3):  # kvs agree on the shared block: a prefix's KV is the prefix's
                kvs[p][:, :, :B] = kvs[0][:, :, :B]
            for b in range(6):
                for p in range(3):
                    store.save(ns, prompts[p][: (b + 1) * B], kvs[p][:, :, : (b + 1) * B], start_block=b)
        finally:
            gate.set()
        assert store.flush() == 0
        disk = store.tier("disk")
        for p in range(3):
            entries = disk.locate(BlockChain.of(ns, prompts[p]).keys)
            first = 0 if p == 0 else 1  # the shared block lies before the first prompt's own blocks
            for a, b in zip(entries[first:], entries[first + 1 :]):
                assert a.seg_id == b.seg_id and b.offset == a.offset + -(-a.nbytes // 4096) * 4096, p
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for toks, kv in zip(prompts, kvs):
            hit, got = store.restore(ns, toks)
            assert hit.by_tier["disk"] == 6 * B and torch.equal(got, kv)


def _put(key: bytes, parent: bytes | None, evict: bool = True):  # type: ignore[no-untyped-def]
    from tierkv.tiers.disk.writer import Put

    return Put(b"ns", key, list, 1, 0.0, None, parent=parent, evict=evict)


def test_by_chain_puts_each_block_after_its_parent_and_keeps_the_rest_in_order() -> None:
    """Two prompts interleaved, a third forking from the first's second block, a block whose parent is
    not in the batch: each chain's blocks together, chains in the order they began; the shared block
    continues the first chain to extend it (here the fork), the other's later blocks a chain of their
    own after it; nothing lost or duplicated."""
    from tierkv.tiers.disk.batch_order import by_chain

    queued = [
        _put(b"a0", None),
        _put(b"b0", None),
        _put(b"a1", b"a0"),
        _put(b"b1", b"b0"),
        _put(b"c2", b"a1"),  # forks from a's second block
        _put(b"a2", b"a1"),
        _put(b"x5", b"x4"),  # its parent was written in an earlier batch
        _put(b"b2", b"b1"),
        _put(b"c3", b"c2"),
    ]
    got = [p.key for p in by_chain(queued)]
    assert got == [b"a0", b"a1", b"c2", b"c3", b"b0", b"b1", b"b2", b"a2", b"x5"]
    assert sorted(got) == sorted(p.key for p in queued)
    at = {k: i for i, k in enumerate(got)}
    assert all(at[p.parent] < at[p.key] for p in queued if p.parent in at)


def test_by_chain_keeps_an_import_s_order() -> None:
    """An import queues records most recently used first and must not evict to fit them: its order is
    what decides which records a tight budget keeps, so its batches are appended as queued."""
    from tierkv.tiers.disk.batch_order import by_chain

    queued = [_put(b"a0", None, evict=False), _put(b"b0", None, evict=False), _put(b"a1", b"a0", evict=False)]
    assert [p.key for p in by_chain(queued)] == [b"a0", b"b0", b"a1"]
