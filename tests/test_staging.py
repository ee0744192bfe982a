import threading
import time

import pytest
import torch

from tierkv.staging import IllegalTransition, SlotState, StagingRing


def test_blocks_drain_in_submission_order_with_their_data() -> None:
    got = []
    ring = StagingRing(
        3, 64, on_ready=lambda slot, meta: got.append((meta, slot[:16].view(torch.float32).clone()))
    )
    blocks = [torch.full((4,), float(i)) for i in range(10)]
    for i, b in enumerate(blocks):
        assert ring.submit(b, i)
    ring.flush()
    assert [m for m, _ in got] == list(range(10))
    assert all(torch.equal(t, blocks[m]) for m, t in got)
    assert all(s is SlotState.FREE for s in ring.state)
    ring.close()


def test_a_full_ring_waits_then_drops_and_counts() -> None:
    release = threading.Event()
    ring = StagingRing(2, 16, on_ready=lambda slot, meta: release.wait(5), wait_s=0.05)
    assert ring.submit(torch.zeros(4), 0) and ring.submit(torch.zeros(4), 1)
    assert not ring.submit(torch.zeros(4), 2)  # both slots busy past wait_s
    assert ring.counters.snapshot()["staging"]["dropped_saves"] == 1
    release.set()
    ring.flush()
    assert ring.submit(torch.zeros(4), 3)
    ring.close()


def test_the_source_may_change_once_submit_returns() -> None:
    got = []
    ring = StagingRing(4, 64, on_ready=lambda slot, meta: got.append(slot[:16].view(torch.float32).clone()))
    src = torch.arange(4, dtype=torch.float32)
    ring.submit(src, None)
    src.fill_(-1)  # the model's cache moves on
    ring.flush()
    assert torch.equal(got[0], torch.arange(4, dtype=torch.float32))
    ring.close()


def test_illegal_transition_names_the_current_state() -> None:
    ring = StagingRing(1, 16, on_ready=lambda slot, meta: None)
    with pytest.raises(IllegalTransition, match="it is free"):
        ring._move(0, SlotState.COPYING, SlotState.READY)
    with pytest.raises(ValueError, match="does not fit"):
        ring.submit(torch.zeros(100), None)
    ring.close()


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [8, 2])  # 2: most blocks wait in the pending queue, issued by the drain
def test_cuda_copy_reads_finished_kv_while_the_compute_stream_keeps_writing(slots: int) -> None:
    """The vLLM 45704 case: the copy must wait for the kernel that produced the block."""
    got = []
    ring = StagingRing(
        slots,
        4 << 20,
        device="cuda",
        pending_nbytes=100 << 20,
        on_ready=lambda slot, meta: got.append((meta, slot[: 4 << 20].view(torch.float32).clone())),
    )
    for i in range(20):
        a = torch.randn(1024, 1024, device="cuda")
        block = (a @ a.T @ a @ a.T).mul_(0).add_(i)  # a long producer kernel still queued at submit time
        assert ring.submit(block, i, keep_reference=True)  # the copy must wait for it, not read stale bytes
        del block  # freed at once: record_stream keeps its memory until the copy is done
        torch.empty(1024, 1024, device="cuda").fill_(-1)  # likely reuses that memory on the compute stream
    ring.flush()
    assert [m for m, _ in got] == list(range(20))
    assert all(bool((t == m).all()) for m, t in got)
    ring.close()


def test_kept_blocks_wait_for_a_slot_instead_of_the_caller_and_keep_their_order() -> None:
    """Model KV (never written again) queues while the slots drain: submit returns at once, nothing drops."""
    release = threading.Event()
    got = []

    def slow_consumer(slot, meta):
        release.wait(5)
        got.append((meta, slot[:16].view(torch.float32).clone()))

    ring = StagingRing(2, 64, on_ready=slow_consumer, wait_s=0.0, pending_nbytes=5 * 16)
    blocks = [torch.full((4,), float(i)) for i in range(8)]
    t0 = time.monotonic()
    accepted = [ring.submit(b, i, keep_reference=True) for i, b in enumerate(blocks)]
    assert time.monotonic() - t0 < 1.0  # did not wait for the stalled consumer
    assert accepted == [True] * 7 + [False]  # 2 slots + 5 pending (80 bytes); the 8th is over the bound
    assert ring.counters.snapshot()["staging"]["dropped_saves"] == 1
    assert not ring.submit(torch.zeros(4), 99)  # a block the ring may not keep cannot wait: dropped
    release.set()
    ring.flush()
    assert [m for m, _ in got] == list(range(7))
    assert all(torch.equal(t, blocks[m]) for m, t in got)
    assert all(s is SlotState.FREE for s in ring.state) and ring._pending_held == 0
    ring.close()


def test_new_blocks_never_overtake_pending_ones() -> None:
    got = []
    gate = threading.Event()
    ring = StagingRing(
        1, 16, on_ready=lambda slot, meta: (gate.wait(5), got.append(meta)), wait_s=1.0, pending_nbytes=16
    )
    assert ring.submit(torch.zeros(4), "a", keep_reference=True)  # takes the slot
    assert ring.submit(torch.zeros(4), "b", keep_reference=True)  # pending
    waiter = threading.Thread(target=lambda: ring.submit(torch.zeros(4), "c"))  # waits (not keepable)
    waiter.start()
    time.sleep(0.1)
    gate.set()
    waiter.join()
    ring.flush()
    assert got == ["a", "b", "c"]
    ring.close()


def test_submit_many_takes_what_fits_queues_the_rest_and_drops_past_the_bound() -> None:
    release = threading.Event()
    got = []
    ring = StagingRing(
        3,
        64,
        on_ready=lambda slot, meta: (
            release.wait(5),
            got.append((meta, slot[:16].view(torch.float32).clone())),
        ),
        wait_s=0.01,
        pending_nbytes=2 * 16,
    )
    blocks = [torch.full((4,), float(i)) for i in range(7)]
    accepted = ring.submit_many(blocks, list(range(7)), keep_reference=True)
    assert accepted == [True] * 5 + [False, False]  # 3 slots + 2 pending; the last two wait, then drop
    assert ring.counters.snapshot()["staging"]["dropped_saves"] == 2
    release.set()
    ring.flush()
    assert [m for m, _ in got] == list(range(5))
    assert all(torch.equal(t, blocks[m]) for m, t in got)
    assert ring.submit_many([torch.zeros(4)] * 4, list("abcd")) == [True] * 4  # slots free again
    ring.close()


def test_a_failed_copy_frees_its_slot_and_is_never_handed_on() -> None:
    got = []
    ring = StagingRing(2, 64, on_ready=lambda slot, meta: got.append(meta), wait_s=0.01)
    with pytest.raises(NotImplementedError):
        ring.submit(torch.empty(4, device="meta"), "broken")  # a copy that cannot happen
    ring.flush()  # returns: nothing is left claimed
    assert ring.counters.snapshot()["staging"]["write_errors"] == 1
    assert ring.submit(torch.ones(4), "fine") and ring.submit(torch.ones(4), "fine too")
    ring.flush()
    assert got == ["fine", "fine too"]
    ring.close()


def test_a_full_ring_costs_a_save_one_wait_in_all() -> None:
    """A save into a stuck ring waits ``wait_s`` once, not once per block (a 256-block save once stalled
    the model thread 256 x 5 ms); each block that finds no room after that is dropped and counted."""
    release = threading.Event()
    ring = StagingRing(2, 64, on_ready=lambda slot, meta: release.wait(10), wait_s=0.2)
    blocks = [torch.full((4,), float(i)) for i in range(22)]
    t0 = time.monotonic()
    accepted = ring.submit_many(blocks, list(range(22)))
    waited_s = time.monotonic() - t0
    assert accepted == [True, True] + [False] * 20
    assert ring.counters.snapshot()["staging"]["dropped_saves"] == 20
    assert 0.2 <= waited_s < 2.0  # one wait_s; a wait per dropped block would be 4 s
    release.set()
    ring.flush()
    ring.close()


def test_a_slow_drain_does_not_restart_the_wait_for_each_block() -> None:
    """A drain that frees a slot every 50 ms: the save's waits add up to ``wait_s`` at most (it used to
    wait anew for each block: 40 x 50 ms), and the blocks it took and dropped add up to the save."""
    ring = StagingRing(2, 64, on_ready=lambda slot, meta: time.sleep(0.05), wait_s=0.2)
    blocks = [torch.full((4,), float(i)) for i in range(40)]
    t0 = time.monotonic()
    accepted = ring.submit_many(blocks, list(range(40)))
    waited_s = time.monotonic() - t0
    assert waited_s < 1.0  # about wait_s, where a wait per block was 2 s
    dropped = ring.counters.snapshot()["staging"]["dropped_saves"]
    assert 2 < sum(accepted) < 40 and dropped == 40 - sum(accepted)
    ring.flush()
    ring.close()
