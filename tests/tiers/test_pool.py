import os
import sys

import pytest
import torch

from tierkv.keys import BlockChain, BlockKey
from tierkv.layout import KVSpec
from tierkv.metrics import Counters
from tierkv.tiers.base import BlockWrite
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.pool import BlockPool
from tierkv.tiers.target import Stagers

from helpers import make_kv, resident_nbytes


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 32)


def _block(v: float) -> torch.Tensor:
    return torch.full((2, 2, 4, 1, 2), v, dtype=torch.float32)  # 128 bytes


def test_put_read_roundtrip_and_slots_preallocated() -> None:
    host = HostTier(1024, pin=False)
    assert host.put(_key(1), _block(1.5)) is not None
    assert host.num_slots == 8 and host.slot_nbytes == 128
    with host.read([_key(1), _key(2)]) as views:
        assert views[1] is None
        assert torch.equal(views[0].view(torch.float32).view(2, 2, 4, 1, 2), _block(1.5))


def test_lru_eviction_order() -> None:
    host = HostTier(3 * 128, pin=False)
    for i in range(3):
        host.put(_key(i), _block(i))
    with host.read([_key(0)]):  # touch 0: now 1 is the least recently used
        pass
    host.put(_key(3), _block(3))
    host.put(_key(4), _block(4))
    assert host.contains([_key(i) for i in range(5)]) == [True, False, False, True, True]
    assert host.counters.snapshot()["host"]["evictions"] == 2


def test_referenced_slots_are_never_evicted() -> None:
    host = HostTier(2 * 128, pin=False)
    held = host.put(_key(0), _block(0), hold=True)
    host.put(_key(1), _block(1))
    host.put(_key(2), _block(2))  # evicts 1, not the held 0
    assert host.contains([_key(0), _key(1), _key(2)]) == [True, False, True]
    with host.read([_key(2)]):
        assert host.put(_key(3), _block(3)) is None  # every slot is referenced
    host.release(held)
    assert host.put(_key(3), _block(3)) is not None


def test_block_of_another_size_is_refused() -> None:
    host = HostTier(1024, pin=False)
    host.put(_key(0), _block(0))
    assert host.put(_key(1), torch.zeros(3, dtype=torch.float32)) is None


def test_zero_capacity_keeps_nothing() -> None:
    host = HostTier(64, pin=False)
    assert host.put(_key(0), _block(0)) is None
    assert len(host) == 0


def test_put_many_writes_new_blocks_in_one_indexed_copy_and_touches_known_ones() -> None:
    host = HostTier(4 * 128, pin=False)
    host.put(_key(1), _block(-1))  # already there: kept as is, only touched
    host.put(_key(9), _block(9))
    stack = torch.stack([_block(v) for v in (0, 1, 2)])
    assert host.put_many([_key(0), _key(1), _key(2)], stack) == 2
    host.put(_key(3), _block(3))  # the pool is full: evicts 9, the least recently used
    assert host.contains([_key(i) for i in (0, 1, 2, 3, 9)]) == [True, True, True, True, False]
    with host.read([_key(0), _key(1), _key(2)]) as views:
        got = [v.view(torch.float32).view(2, 2, 4, 1, 2) for v in views]
    assert (
        torch.equal(got[0], _block(0)) and torch.equal(got[1], _block(-1)) and torch.equal(got[2], _block(2))
    )


def test_a_block_purged_while_it_is_copied_in_is_not_published_and_its_slot_comes_back() -> None:
    """``live`` is asked again under the lock as the block would be published (a purge may have cleared
    the pool while it was copied in): then it is refused, nobody finds it, and its slot is free again."""
    host = HostTier(2 * 128, pin=False)
    answers = iter([True, False])  # live when put starts, purged by the time it would publish
    assert host.put(_key(1), _block(1), live=lambda: next(answers)) is None
    assert host.contains([_key(1)]) == [False]
    assert host.put(_key(2), _block(2)) is not None and host.put(_key(3), _block(3)) is not None
    assert host.contains([_key(2), _key(3)]) == [True, True]  # both slots usable: none leaked
    assert host.put(_key(4), _block(4), live=lambda: False) is None  # purged before: not even copied
    assert host.contains([_key(2), _key(3), _key(4)]) == [True, True, False]  # nothing evicted for it
    stack = torch.stack([_block(v) for v in (5, 6)])
    assert host.put_many([_key(5), _key(6)], stack, live=lambda k: k != _key(5)) == 1
    assert host.contains([_key(5), _key(6)]) == [False, True]


def test_put_many_stops_when_every_slot_is_referenced() -> None:
    host = HostTier(2 * 128, pin=False)
    held = host.put(_key(0), _block(0), hold=True)
    assert host.put_many([_key(1), _key(2), _key(3)], torch.stack([_block(v) for v in (1, 2, 3)])) == 1
    assert host.contains([_key(1), _key(2), _key(3)]) == [True, False, False]
    with host.read([_key(1)]) as (view,):  # a later block of the batch did not take its slot
        assert torch.equal(view.view(torch.float32).view(2, 2, 4, 1, 2), _block(1))
    host.release(held)


# ---------------------------------------------------------------- retention, references, the Tier calls


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ttl_is_sliding_and_an_expired_block_frees_its_slot() -> None:
    clock = Clock()
    host = HostTier(4 * 128, pin=False, ttl_s=10, clock=clock)
    host.put(_key(0), _block(0))
    host.put(_key(1), _block(1))
    clock.now += 6
    with host.read([_key(0)]):  # a hit refreshes block 0's TTL, not block 1's
        pass
    clock.now += 6
    assert host.contains([_key(0), _key(1)]) == [True, False]
    assert len(host) == 1 and host.counters.snapshot()["host"]["expirations"] == 1
    clock.now += 11
    with host.read([_key(0)]) as views:
        assert views == [None]
    assert len(host) == 0


def test_max_age_counts_from_the_blocks_creation_even_when_read() -> None:
    clock = Clock()
    host = HostTier(4 * 128, pin=False, max_age_s=10, clock=clock)
    host.put(_key(0), _block(0), created_s=clock.now - 8)  # restored from a record 8 s old
    host.put(_key(1), _block(1))
    assert host.created_s(_key(0)) == clock.now - 8
    clock.now += 3
    with host.read([_key(0), _key(1)]):
        pass
    assert host.contains([_key(0), _key(1)]) == [False, True]


def test_an_expired_slot_still_being_read_is_not_reused() -> None:
    clock = Clock()
    host = HostTier(128, pin=False, ttl_s=10, clock=clock)  # one slot
    host.put(_key(0), _block(7))
    with host.read([_key(0)]) as (view,):
        clock.now += 20
        assert host.contains([_key(0)]) == [False]  # a miss for new requests
        assert host.put(_key(1), _block(1)) is None  # but its slot is still being read
        assert torch.equal(view.view(torch.float32).view(2, 2, 4, 1, 2), _block(7))
    assert host.put(_key(1), _block(1)) is not None  # released: now it can go
    assert host.contains([_key(0), _key(1)]) == [False, True]


def test_retain_and_release_count_references() -> None:
    host = HostTier(128, pin=False)
    slot = host.put(_key(0), _block(0), hold=True)
    host.retain(slot)  # a second writer reads the same slot
    host.release(slot)
    assert host.put(_key(1), _block(1)) is None  # still held by the other writer
    host.release(slot)
    assert host.put(_key(1), _block(1)) is not None
    with pytest.raises(AssertionError, match="released more often"):
        host.release(slot)


@pytest.mark.parametrize("path", ["native", "python"])
def test_put_blocks_holds_each_block_s_bytes_as_put_does(ns, path) -> None:
    """A save's blocks into a pool at once: views of one tensor (in any order, gathered natively) and
    blocks of several tensors (a torch copy each) land with put's bytes; a key held already stays as it
    is, a purged one (``live`` False) is not published."""
    from tierkv import native

    B = ns.block_tokens
    kv = make_kv(ns, 6 * B)
    other = make_kv(ns, B, seed=9)
    chain = BlockChain.of(ns, list(range(7 * B)))
    blocks = [kv[:, :, i * B : (i + 1) * B] for i in (4, 0, 1, 2, 3, 5)]  # positions out of order
    keys = [chain.keys[i] for i in (4, 0, 1, 2, 3, 5)]
    with native.use(path == "native"):
        pool = BlockPool(64 << 20, name="host")
        assert pool.put(keys[1], blocks[1]) is not None
        before = pool.hold(keys[1])
        assert before is not None
        first = before.clone()
        pool.release(before)
        dead = {keys[5]}
        held = pool.put_blocks(keys, blocks, live=lambda k: k not in dead)
        assert held == [True] * 5 + [False] and pool.contains(keys[5:]) == [False]
        assert pool.put_blocks([chain.keys[6], keys[0]], [other, blocks[0]]) == [True, True]
        for key, block in [*zip(keys[:5], blocks[:5]), (chain.keys[6], other)]:
            with pool.read([key]) as (got,):
                assert torch.equal(got.view(block.dtype).view(block.shape), block)
        with pool.read([keys[1]]) as (got,):
            assert torch.equal(got, first)


def test_writers_may_hold_at_most_a_share_of_the_slots() -> None:
    host = HostTier(4 * 128, pin=False)
    assert host.can_hold()  # not allocated yet
    held = [host.put(_key(i), _block(i), hold=True) for i in range(2)]
    assert not host.can_hold() and host.hold_room() == 0  # MAX_HELD_FRACTION of 4 slots
    host.release(held[0])
    assert host.can_hold() and host.hold_room() == 1
    host.release(held[1])


def test_clear_removes_held_blocks_too_and_frees_their_slots_on_release() -> None:
    """A purge must not leave a block because a writer holds its slot (it was served after purge(all)):
    the block is gone at once; its bytes stay the holder's until it releases them, then the slot is free."""
    host = HostTier(4 * 128, pin=False)
    held = host.put(_key(0), _block(0), hold=True)
    host.put(_key(1), _block(1))
    assert host.clear() == 2
    assert host.contains([_key(0), _key(1)]) == [False, False] and len(host) == 0
    assert torch.equal(held.view(torch.float32), _block(0).view(-1))  # the holder's bytes are intact
    for i in range(2, 5):  # three free slots: the held one is not among them
        host.put(_key(i), _block(i))
    assert host.put(_key(5), _block(5)) is not None and not host.contains([_key(2)])[0]  # evicts, no slot
    host.release(held)  # the dead slot is free now: the next block takes it, nothing is evicted
    host.put(_key(6), _block(6))
    assert host.contains([_key(i) for i in (3, 4, 5, 6)]) == [True] * 4 and host._held == 0


def test_discard_removes_only_the_keys_given() -> None:
    host = HostTier(4 * 128, pin=False)
    held = host.put(_key(0), _block(0), hold=True)
    host.put(_key(1), _block(1))
    assert host.discard([_key(0), _key(2)]) == [True, False]
    assert host.contains([_key(0), _key(1)]) == [False, True]
    host.put(_key(0), _block(3))  # saved again while the old slot is still held: a slot of its own
    host.release(held)
    with host.read([_key(0)]) as (view,):
        assert view is not None and torch.equal(view.view(torch.float32), _block(3).view(-1))


def test_reserve_allocates_the_pool_up_front() -> None:
    host = HostTier(4 * 128, pin=False)
    host.reserve(128)
    assert host.num_slots == 4 and host.slot_nbytes == 128 and len(host) == 0
    host.reserve(64)  # once allocated, the slot size stays
    assert host.slot_nbytes == 128
    small = HostTier(64, pin=False)
    small.reserve(128)  # too small for one block: stays off
    assert small.num_slots == 0


def _chain_and_kv(ns, n_blocks: int):
    toks = list(range(n_blocks * ns.block_tokens))
    return BlockChain.of(ns, toks), make_kv(ns, len(toks))


def _write_of(ns, chain, kv, i: int, created_s: float, release=None):
    B = ns.block_tokens
    payload = kv[:, :, i * B : (i + 1) * B].contiguous().view(-1).view(torch.uint8)
    return BlockWrite(
        ns, chain.keys[i], chain.parent(i), chain.tokens(i), created_s, payload, release=release
    )


def test_the_tier_calls_of_a_pool(ns) -> None:
    spec = KVSpec.of(ns)
    B = ns.block_tokens
    chain, kv = _chain_and_kv(ns, 4)
    host = HostTier(8 * spec.block_nbytes, pin=False)
    released: list[int] = []
    for i in (0, 1, 2):
        assert host.write(_write_of(ns, chain, kv, i, 500.0 + i, release=lambda i=i: released.append(i)))
    assert released == [0, 1, 2]  # the payload was copied: the writer's hold is let go at once
    assert host.probe(chain, [3, 0, 2]) == [False, True, True]
    assert host.needs(chain, [0, 1, 2, 3]) == [False, False, False, True]
    assert host.stats() == {
        "used_nbytes": 3 * spec.block_nbytes,
        "capacity_nbytes": 8 * spec.block_nbytes,
        "blocks": 3,
    }
    assert host.describe().startswith("host")
    dest = torch.zeros(spec.shape(4 * B), dtype=spec.dtype)
    with Stagers().target(dest, spec) as target:
        assert host.read_into(chain, 1, 3, target) == 2  # blocks 1 and 2; block 3 is not held
        assert target.created_s == {1: 501.0, 2: 502.0}  # their age goes with them
    assert torch.equal(dest[:, :, B : 3 * B], kv[:, :, B : 3 * B])
    assert not dest[:, :, :B].any()


def test_a_refused_write_leaves_the_release_to_the_caller(ns) -> None:
    spec = KVSpec.of(ns)
    chain, kv = _chain_and_kv(ns, 2)
    host = HostTier(spec.block_nbytes, pin=False)
    held = host.put(chain.keys[0], kv[:, :, : ns.block_tokens], hold=True)  # the only slot, in use
    released: list[int] = []
    assert not host.write(_write_of(ns, chain, kv, 1, 1.0, release=lambda: released.append(1)))
    host.release(held)
    assert released == []


def test_a_pool_is_named_by_its_owner(ns) -> None:
    counters = Counters()
    pool = BlockPool(2 * 128, name="l2", counters=counters)
    pool.put(_key(0), _block(0))
    pool.put(_key(1), _block(1))
    pool.put(_key(2), _block(2))
    assert counters.snapshot()["l2"]["blocks_written"] == 3 and counters.snapshot()["l2"]["evictions"] == 1
    gpu = GpuTier(2 * 128, device="cpu")  # the GPU tier's pool, on a CPU: the same code
    assert gpu.name == "gpu" and gpu.direct and gpu.device == torch.device("cpu")
    assert gpu.put(_key(0), _block(3)) is not None and gpu.contains([_key(0)]) == [True]


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_a_new_pool_is_populated_in_the_background_without_touching_its_contents() -> None:
    import mmap

    from tierkv.tiers.prefault import populate_in_background

    # Fresh pages from their own mapping: torch.empty may reuse heap memory an earlier test left resident.
    buf = mmap.mmap(-1, 256 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t[: 1 << 20] = 7  # a block already saved into the pool while the thread runs
    assert resident_nbytes(t) < 2 << 20
    thread = populate_in_background(t, "test")
    assert thread is not None
    thread.join(60)
    assert resident_nbytes(t) > 200 << 20  # its pages are resident now
    assert bool((t[: 1 << 20] == 7).all())  # and what was written is unchanged
    del t


def _spy_populate(monkeypatch, nbytes: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """Populate a fresh tensor of ``nbytes`` with a spying madvise and sleep: the calling thread's
    scheduling policy and nice value in each madvise call and at each pause, and how many chunks the range
    makes."""
    import threading

    import tierkv.tiers.prefault as prefault

    real = prefault._madvise()
    if real is None:
        pytest.skip("no madvise here")
    in_calls: list[tuple[int, int]] = []
    at_pauses: list[tuple[int, int]] = []
    advised: list[tuple[int, int, int]] = []

    def where() -> tuple[int, int]:  # 0 / the thread id: the calling thread, on Linux
        return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def spying(addr, n, advice):  # type: ignore[no-untyped-def]
        if advice == prefault.MADV_POPULATE_WRITE:
            in_calls.append(where())
        else:
            advised.append((addr.value, n.value, advice))
        return real(addr, n, advice)

    def spying_pause(stop: object, s: float) -> None:
        assert s > 0
        at_pauses.append(where())

    monkeypatch.setattr(prefault, "_madvise", lambda: spying)
    monkeypatch.setattr(prefault, "_pause", spying_pause)
    t = torch.empty(nbytes, dtype=torch.uint8)
    page = 4096
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + nbytes) // page * page
    thread = prefault.populate_in_background(t, "test")
    assert thread is not None
    thread.join(60)
    assert advised == []  # only MADV_POPULATE_WRITE: no huge-page advice (direct compaction under the lock)
    return in_calls, at_pauses, -(-(end - start) // prefault.CHUNK_NBYTES)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")
def test_populating_runs_at_nice_19_paced_and_holds_the_mmap_lock_at_normal_priority(monkeypatch) -> None:
    from tierkv.priority import can_raise_priority

    in_calls, at_pauses, chunks = _spy_populate(monkeypatch, 16 << 20)
    assert len(in_calls) == chunks == len(at_pauses)  # short madvise calls, each followed by a pause
    assert {p for p, _ in in_calls + at_pauses} == {os.SCHED_OTHER}  # never Python at SCHED_IDLE
    assert {n for _, n in at_pauses} == {19}
    # The mmap lock is held at nice 0 where the process may come back to it, else at nice 19.
    assert {n for _, n in in_calls} == ({0} if can_raise_priority() else {19})
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the caller's own thread is left as it was


def test_a_pool_reserved_to_populate_now_is_resident_when_reserve_returns(monkeypatch) -> None:
    """An engine's connector populates its host tier while the engine starts, at full speed and normal
    priority (behind, paced at nice 19, it crawled through vLLM's first prefills)."""
    import tierkv.tiers.prefault as prefault

    pauses: list[float] = []
    monkeypatch.setattr(prefault, "_pause", lambda stop, s: pauses.append(s))
    pool = BlockPool(128 << 20, name="host")
    pool.reserve(4096, populate_now=True)
    assert pool._prefault is not None and not pool._prefault.thread.is_alive()
    if prefault._madvise() is not None:
        assert pool._pool is not None and resident_nbytes(pool._pool) > 100 << 20  # before reserve returned
    assert pauses == []  # unpaced
    again = BlockPool(16 << 20, name="host")
    again.reserve(4096)  # the default: behind, paced
    assert again._prefault is not None
    again._prefault.join(60)
    assert pauses or prefault._madvise() is None


def test_a_fresh_host_pool_is_not_zeroed_on_the_first_put(monkeypatch) -> None:
    def no_zero(self: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the pool was zeroed on the request path")

    monkeypatch.setattr(torch.Tensor, "zero_", no_zero)
    pool = BlockPool(64 << 20, name="host")
    block = torch.ones(4, 1024)
    assert pool.put(_key(1), block) is not None
    assert pool._prefault is not None and pool.num_slots == (64 << 20) // block.nbytes


def test_a_put_that_must_not_wait_gives_up_while_another_thread_holds_the_pool() -> None:
    pool = BlockPool(1 << 20, name="host")
    block = torch.ones(4, 1024)
    with pool._lock:  # a large save copying under the lock, say
        assert pool.put(_key(1), block, wait=False) is None
    assert pool.put(_key(1), block, wait=False) is not None and pool.contains([_key(1)]) == [True]


@pytest.mark.parametrize("path", ["native", "python"])
def test_put_run_gathers_what_put_copies_and_keeps_what_is_held(ns, path) -> None:
    """A run of blocks of a KV tensor into a pool at once (the native gather, or put per block) holds
    each block's exact bytes, as put of the same block would (one of them held before the run); a position
    past the tensor's end is not held, on either path."""
    from tierkv import native

    B = ns.block_tokens
    kv = make_kv(ns, 6 * B)
    chain = BlockChain.of(ns, list(range(6 * B)))
    spec = KVSpec.of(ns)
    with native.use(path == "native"):
        pool = BlockPool(64 << 20, name="host")
        ref = BlockPool(64 << 20, name="ref")
        assert pool.put(chain.keys[1], kv[:, :, B : 2 * B]) is not None
        held = pool.put_run(chain.keys[1:5], kv, [1, 2, 3, 4], B, [None] * 4, wait=False)
        assert held == [True] * 4
        for i in range(1, 5):
            ref.put(chain.keys[i], kv[:, :, i * B : (i + 1) * B])
            with pool.read([chain.keys[i]]) as (got,), ref.read([chain.keys[i]]) as (want,):
                assert torch.equal(got, want)
                assert torch.equal(got.view(spec.dtype).view(spec.block_shape), kv[:, :, i * B : (i + 1) * B])
        # position 6 is past the tensor's 6 blocks: not held, on both paths; the rest of the run is
        assert pool.put_run([chain.keys[0], chain.keys[5]], kv, [0, 6], B, [None, None]) == [True, False]
        assert pool.contains([chain.keys[0], chain.keys[5]]) == [True, False]


def test_closing_a_pool_stops_populating_its_pages() -> None:
    """A daemon thread still populating when the interpreter exits is killed wherever it is: close stops
    it between two calls and waits for it."""
    pool = BlockPool(256 << 20, name="host")
    assert pool.put(_key(1), torch.ones(4, 1024)) is not None
    populator = pool._prefault
    if populator is None:
        pytest.skip("no populating thread here")
    pool.close()
    assert not populator.thread.is_alive()


def test_concurrent_puts_copy_outside_the_lock_and_leak_no_slot(monkeypatch) -> None:
    """A put copies its block outside the pool's lock (a reader or the disk writer releasing a slot must
    not wait behind a large copy) and publishes it only once complete: a reader during the copy finds no
    block, and two threads putting the same key leave one slot for it, the other slot free again."""
    import threading

    host = HostTier(4 * 128, pin=False)
    host.put(_key(9), _block(9.0))  # allocates the pool
    in_copy, go_on = threading.Event(), threading.Event()
    real_copy = torch.Tensor.copy_

    def slow_copy(self, src, *args, **kwargs):
        if threading.current_thread().name == "slow-put":
            in_copy.set()
            assert go_on.wait(5)
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", slow_copy)
    slow = threading.Thread(target=lambda: host.put(_key(1), _block(1.0)), name="slow-put")
    slow.start()
    assert in_copy.wait(5)
    assert host.contains([_key(1), _key(9)]) == [False, True]  # the lock is free; nothing half-written
    assert host.put(_key(1), _block(1.0)) is not None  # the same key from another thread, meanwhile
    go_on.set()
    slow.join()
    monkeypatch.undo()
    assert host.contains([_key(1)]) == [True] and len(host) == 2
    with host.read([_key(1)]) as views:
        assert torch.equal(views[0].view(torch.float32).view(2, 2, 4, 1, 2), _block(1.0))
    for i in range(2, 4):  # every other slot is free again: two more blocks fit without an eviction
        assert host.put(_key(i), _block(float(i))) is not None
    assert len(host) == 4 and host.counters.snapshot()["host"]["evictions"] == 0


def test_a_populate_call_interrupted_by_a_signal_is_retried(monkeypatch) -> None:
    """MADV_POPULATE_WRITE returns EINTR when a signal arrives (EAGAIN when the kernel asks to come back):
    the chunk is asked again, not the whole pool given up (its pages would then fault on the request
    path)."""
    import ctypes
    import errno

    import tierkv.tiers.prefault as prefault

    calls: list[tuple[int, int]] = []

    def flaky_madvise(addr, n, advice) -> int:
        calls.append((addr.value, n.value))
        if len(calls) in (1, 3):  # the first chunk's first try, and the second chunk's
            ctypes.set_errno(errno.EINTR if len(calls) == 1 else errno.EAGAIN)
            return -1
        return 0

    monkeypatch.setattr(prefault, "_madvise", lambda: flaky_madvise)
    pool = torch.empty(3 * prefault.CHUNK_NBYTES, dtype=torch.uint8)
    populator = prefault.populate_in_background(pool, "host", paced=False)
    assert populator is not None
    populator.join(10)
    ok = [c for i, c in enumerate(calls) if i not in (0, 2)]  # the calls that populated
    assert len(calls) == 5 and calls[0] == calls[1] and calls[2] == calls[3]  # each failed chunk again
    assert len({addr for addr, _ in ok}) == 3 and sum(n for _, n in ok) > 2 * prefault.CHUNK_NBYTES


def test_a_populator_waits_while_a_restore_runs_and_goes_on_after(monkeypatch) -> None:
    """A paced populator yields to restores in progress (``prefault.foreground``), a chunk at most every
    ``_YIELD_MAX_S``, and goes on once they are done."""
    import time

    import tierkv.tiers.prefault as prefault

    if prefault._madvise() is None:
        pytest.skip("no madvise here")
    monkeypatch.setattr(prefault, "_YIELD_MAX_S", 30.0)  # here: wait as long as the restore lasts
    t = torch.empty(64 << 20, dtype=torch.uint8)
    with prefault.foreground():
        populator = prefault.populate_in_background(t, "test")
        assert populator is not None
        time.sleep(0.2)
        assert populator.left_nbytes > (64 << 20) - 2 * prefault.CHUNK_NBYTES  # a chunk begun before at most
    populator.join(60)
    assert populator.left_nbytes == 0 and not populator.thread.is_alive()


def test_a_restore_promotes_only_into_populated_slots_and_a_prefetch_into_any(
    tmp_path, ns, monkeypatch
) -> None:
    """A server's first seconds: its host tier is populated behind; a request's restore writing into slots
    not populated yet would fault their pages on its path, so those blocks are served from disk and
    promoted once their slots are ready. A prefetch, off any request's path, promotes into any."""
    import threading

    import tierkv.tiers.prefault as prefault
    from tierkv import TieredStore

    toks = list(range(4 * ns.block_tokens))
    kv = make_kv(ns, len(toks), seed=1)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    gate = threading.Event()
    real = prefault._populate_range

    def slow(*args):  # type: ignore[no-untyped-def]
        gate.wait(60)  # the populator has not begun yet
        real(*args)

    monkeypatch.setattr(prefault, "_populate_range", slow)
    monkeypatch.setattr(prefault, "FAULT_AHEAD_NBYTES", 0)  # (a small restore faults its few slots itself)
    keys = BlockChain.of(ns, toks).keys
    try:
        with TieredStore.open(tmp_path, host_bytes=32 << 20) as store:
            store.reserve(ns)
            host = store.tier("host")
            assert host._prefault is not None and host._prefault.left_nbytes > 0
            hit, got = store.restore(ns, toks)
            assert hit.by_tier["disk"] == len(toks) and torch.equal(got, kv)
            # Not promoted into slots still to be populated (but for those in the pool's first, partial
            # page: the populator covers whole pages, and that one was the allocator's already).
            assert sum(host.contains(keys)) <= 4096 // host.slot_nbytes < len(keys)
            before, after = store.prefetch(ns, toks)
            assert before.num_tokens == after.num_tokens == after.by_tier["host"] == len(toks)
        with TieredStore.open(tmp_path, host_bytes=32 << 20) as store:
            store.reserve(ns)
            host = store.tier("host")
            gate.set()
            host._prefault.join(60)
            assert host._prefault.left_nbytes == 0
            hit, got = store.restore(ns, toks)
            assert hit.by_tier["disk"] == len(toks) and torch.equal(got, kv)
            assert all(host.contains(keys))  # promoted now
            assert store.restore(ns, toks)[0].by_tier["host"] == len(toks)
    finally:
        gate.set()
