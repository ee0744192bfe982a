"""BatchQueue (tiers/batching.py), the disk and remote writers' queue, on its own real thread."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tierkv.tiers.batching import BatchQueue

WAIT_S = 30  # generous: a loaded 2-core machine may starve a thread for seconds


class Recorder:
    """A handler that records its batches; the first batch can be held until ``gate`` opens."""

    def __init__(self, hold_first: bool = False, fail_on: object = None) -> None:
        self.batches: list[list[object]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.hold_first = hold_first
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def __call__(self, batch: list[object]) -> None:
        self.entered.set()
        if self.hold_first and not self.batches:
            assert self.gate.wait(WAIT_S)
        with self.lock:
            self.batches.append(list(batch))
        if self.fail_on is not None and self.fail_on in batch:
            raise RuntimeError(f"handler failed on {self.fail_on}")

    @property
    def items(self) -> list[object]:
        with self.lock:
            return [x for b in self.batches for x in b]


def _held_queue(rec: Recorder, **options) -> BatchQueue:
    """A queue whose thread is inside the handler with item "first": what is put next waits in the queue."""
    q = BatchQueue("test-batches", rec, **options)
    q.put("first")
    assert rec.entered.wait(WAIT_S)
    return q


def test_batches_respect_batch_items() -> None:
    rec = Recorder(hold_first=True)
    q = _held_queue(rec, item_nbytes=lambda _: 1, batch_nbytes=1 << 20, batch_items=3)
    for i in range(8):
        q.put(i)
    assert q.pending == 9
    rec.gate.set()
    assert q.join(WAIT_S)
    assert rec.batches == [["first"], [0, 1, 2], [3, 4, 5], [6, 7]]
    assert q.pending == 0
    assert q.stop(WAIT_S)


def test_batches_respect_batch_nbytes() -> None:
    rec = Recorder(hold_first=True)
    sizes = {"first": 1, "a": 4, "b": 4, "c": 4, "d": 30, "e": 2, "f": 3, "g": 9}
    q = _held_queue(rec, item_nbytes=sizes.__getitem__, batch_nbytes=10)
    for name in "abcdefg":
        q.put(name)
    rec.gate.set()
    assert q.join(WAIT_S)
    assert q.stop(WAIT_S)
    batches = rec.batches[1:]
    assert [x for b in batches for x in b] == list("abcdefg")  # in queue order, each once
    for i, b in enumerate(batches):
        nbytes = [sizes[x] for x in b]
        assert sum(nbytes[:-1]) < 10  # a batch closes once it reaches the bound (its last item may cross it)
        if i + 1 < len(batches):
            assert sum(nbytes) >= 10  # and not before: the queue was full
    assert batches == [["a", "b", "c"], ["d"], ["e", "f", "g"]]  # an item larger than the bound is alone


def test_join_waits_for_everything_queued_before_it() -> None:
    def slow(batch: list[int]) -> None:
        time.sleep(0.02)
        done.extend(batch)

    done: list[int] = []
    q = BatchQueue("test-join", slow, item_nbytes=lambda _: 1, batch_nbytes=1 << 20, batch_items=2)
    for i in range(10):
        q.put(i)
    assert q.join(WAIT_S)
    assert done == list(range(10))  # not a prefix: every item put before join
    assert q.stop(WAIT_S)


def test_join_gives_up_after_its_timeout() -> None:
    rec = Recorder(hold_first=True)
    q = _held_queue(rec, item_nbytes=lambda _: 1, batch_nbytes=1 << 20)
    q.put("second")
    t0 = time.monotonic()
    assert not q.join(0.2)
    assert time.monotonic() - t0 < 5
    rec.gate.set()
    assert q.join(WAIT_S) and rec.items == ["first", "second"]
    assert q.stop(WAIT_S)


def test_a_handler_that_raises_does_not_kill_the_thread(caplog) -> None:
    rec = Recorder(fail_on="bad")
    q = BatchQueue("test-raise", rec, item_nbytes=lambda _: 1, batch_nbytes=1 << 20, batch_items=1)
    with caplog.at_level(logging.ERROR, logger="tierkv.batching"):
        for item in ("ok", "bad", "later", "last"):
            q.put(item)
        assert q.join(WAIT_S)
    assert rec.items == ["ok", "bad", "later", "last"] and q.alive
    assert any("test-raise" in r.getMessage() for r in caplog.records)  # logged, not swallowed silently
    q.put("after the join")
    assert q.join(WAIT_S) and rec.items[-1] == "after the join"
    assert q.stop(WAIT_S)


def test_stop_handles_what_was_queued_then_ends_the_thread() -> None:
    rec = Recorder(hold_first=True)
    q = _held_queue(rec, item_nbytes=lambda _: 1, batch_nbytes=1 << 20, batch_items=3)
    for i in range(5):
        q.put(i)
    opener = threading.Timer(0.2, rec.gate.set)  # opens while stop() is waiting: its marker is queued last
    opener.start()
    try:
        assert q.stop(WAIT_S)
    finally:
        opener.cancel()
    assert rec.items == ["first", 0, 1, 2, 3, 4]
    assert not q.alive and not q.thread.is_alive()
    assert q.pending == 0


def test_stop_gives_up_while_the_handler_is_busy() -> None:
    rec = Recorder(hold_first=True)
    q = _held_queue(rec, item_nbytes=lambda _: 1, batch_nbytes=1 << 20)
    assert not q.stop(0.2)
    assert q.alive
    rec.gate.set()
    q.thread.join(WAIT_S)
    assert not q.alive and rec.items == ["first"]


def test_on_idle_runs_when_idle_and_not_between_queued_batches() -> None:
    idle = threading.Event()
    gate = threading.Event()
    calls: list[str] = []

    def on_idle() -> None:
        calls.append("idle")
        idle.set()

    def handle(batch: list[int]) -> None:
        if batch == [0]:
            assert gate.wait(WAIT_S)  # items 1 and 2 are queued meanwhile
        calls.extend(f"batch {x}" for x in batch)

    q = BatchQueue(
        "test-idle",
        handle,
        item_nbytes=lambda _: 1,
        batch_nbytes=1 << 20,
        batch_items=1,
        idle_s=0.05,
        on_idle=on_idle,
    )
    assert idle.wait(WAIT_S)  # no item at all: idle after idle_s
    for i in range(3):
        q.put(i)
    gate.set()
    assert q.join(WAIT_S)
    first = calls.index("batch 0")
    assert calls[first : first + 3] == ["batch 0", "batch 1", "batch 2"]  # no idle call while items wait
    idle.clear()
    assert idle.wait(WAIT_S)  # and idle again once they are done
    assert q.stop(WAIT_S)


def test_on_idle_that_raises_does_not_kill_the_thread() -> None:
    runs: list[int] = []

    def on_idle() -> None:
        runs.append(1)
        raise OSError("a transient failure")

    done: list[int] = []
    q = BatchQueue(
        "test-idle-raise",
        done.extend,
        item_nbytes=lambda _: 1,
        batch_nbytes=1 << 20,
        idle_s=0.01,
        on_idle=on_idle,
    )
    deadline = time.monotonic() + WAIT_S
    while len(runs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(runs) >= 3 and q.alive
    q.put(7)
    assert q.join(WAIT_S) and done == [7]
    assert q.stop(WAIT_S)


def test_on_start_runs_first_on_the_thread() -> None:
    seen: list[object] = []
    q = BatchQueue(
        "test-start",
        lambda b: seen.extend(b),
        item_nbytes=lambda _: 1,
        batch_nbytes=1,
        on_start=lambda: seen.append(threading.current_thread().name),
    )
    q.put("item")
    assert q.join(WAIT_S) and q.stop(WAIT_S)
    assert seen == ["test-start", "item"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_join_returns_false_at_once_when_the_thread_is_gone() -> None:
    def on_start() -> None:
        raise RuntimeError("the thread dies before its loop")

    q = BatchQueue("test-dead", lambda b: None, item_nbytes=lambda _: 1, batch_nbytes=1, on_start=on_start)
    q.thread.join(WAIT_S)
    assert not q.alive
    q.put("never handled")
    t0 = time.monotonic()
    assert not q.join(WAIT_S)
    assert time.monotonic() - t0 < 5  # not the whole timeout: a dead thread handles nothing
    assert q.pending == 1


def test_waiting_says_whether_items_are_queued_that_no_batch_took() -> None:
    rec = Recorder(hold_first=True)
    q = _held_queue(rec, item_nbytes=lambda _: 1, batch_nbytes=1 << 20)
    assert not q.waiting  # "first" was taken by the batch in the handler
    q.put("second")
    assert q.waiting
    rec.gate.set()
    assert q.join(WAIT_S)
    assert not q.waiting and rec.items == ["first", "second"]
    assert q.stop(WAIT_S)


def test_on_stop_runs_last_on_the_thread_after_what_was_queued() -> None:
    seen: list[object] = []
    q = BatchQueue(
        "test-stop",
        lambda b: seen.extend(b),
        item_nbytes=lambda _: 1,
        batch_nbytes=1,
        on_stop=lambda: seen.append(("stop", threading.current_thread().name)),
    )
    q.put("item")
    assert q.stop(WAIT_S)
    assert seen == ["item", ("stop", "test-stop")]
