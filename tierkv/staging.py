"""The staging ring: finished KV blocks leave the device through pinned slots without stalling the model.

Each slot moves through explicit states::

    FREE --submit--> COPYING --(copy done: CUDA event)--> READY --drain thread--> DRAINING --> FREE

``submit`` records an event on the compute stream and starts a device-to-host copy on a dedicated
stream that first waits for that event, so the copy reads finished KV (the missing fence behind vLLM
issue 45704 restored stale KV); it records a CUDA event for the copy and returns at once. The drain
thread waits for the oldest slot's event and hands the slot to ``on_ready`` (which copies what it keeps:
the host tier, the disk queue), then frees it. When every slot is busy, a block the caller will not write
again (``keep_reference``: model KV) waits in a queue bounded by ``pending_nbytes`` and is copied when a
slot frees, so the inference thread does not wait for the drain; past that bound, or for other blocks,
``submit`` waits at most ``wait_s`` in all per call and then drops each block that finds no room (a
future miss, counted). Slots drain in submission order.

Without CUDA the same class runs on CPU tensors: plain memory, synchronous copies, no events, so every
path runs in CI. An illegal transition raises with the slot's current state.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierkv.cpus import spread_here
from tierkv.metrics import Counters

__all__ = ["IllegalTransition", "SlotState", "StagingRing"]

log = logging.getLogger("tierkv.staging")


class SlotState(enum.Enum):
    FREE = "free"
    COPYING = "copying"
    READY = "ready"
    DRAINING = "draining"


class IllegalTransition(RuntimeError):
    pass


class StagingRing:
    def __init__(
        self,
        num_slots: int,
        slot_nbytes: int,
        *,
        device: torch.device | str = "cpu",
        on_ready: Callable[[torch.Tensor, Any], None],
        wait_s: float = 0.005,
        pending_nbytes: int = 0,
        counters: Counters | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.on_ready = on_ready
        self.wait_s = wait_s
        self.pending_nbytes = pending_nbytes
        self.counters = counters or Counters()
        t0 = time.perf_counter()
        # One allocation, at start-up: pinning tens of GiB takes seconds, never on the hot path.
        self.slots = torch.empty((num_slots, slot_nbytes), dtype=torch.uint8, pin_memory=self.cuda)
        log.info(
            "staging ring: %d slots of %d bytes%s in %.2f s",
            num_slots,
            slot_nbytes,
            " (pinned)" if self.cuda else "",
            time.perf_counter() - t0,
        )
        self.state = [SlotState.FREE] * num_slots
        self._free: deque[int] = deque(range(num_slots))  # the FREE slots, oldest freed first
        self._events: list[Any] = [None] * num_slots
        self._meta: list[Any] = [None] * num_slots
        self._issued = [False] * num_slots  # the slot's copy has been started (and its event recorded)
        self._order: list[int] = []  # slots in submission order: drained in that order
        self._pending: deque[tuple[torch.Tensor, Any, Any]] = deque()  # (block, meta, ready event)
        self._pending_held = 0  # bytes of the pending blocks
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._drain_loop, name="tierkv-staging-drain", daemon=True)
        self._thread.start()

    def _move(self, slot: int, from_: SlotState, to: SlotState) -> None:
        if self.state[slot] is not from_:
            raise IllegalTransition(
                f"slot {slot}: {from_.value} -> {to.value} asked, but it is {self.state[slot].value}"
            )
        self.state[slot] = to

    def _claim(self, slot: int, meta: Any) -> None:
        """FREE -> COPYING and a place in the drain order (under the lock; the copy is started after)."""
        self._move(slot, SlotState.FREE, SlotState.COPYING)
        if self._free[0] == slot:  # submit's case; the drain thread re-claims the slot it just freed
            self._free.popleft()
        else:
            self._free.remove(slot)
        self._meta[slot] = meta
        self._issued[slot] = False
        self._order.append(slot)

    def submit(self, block: torch.Tensor, meta: Any, *, keep_reference: bool = False) -> bool:
        """Start copying ``block`` (on its device) into a free slot; False (counted) if it was dropped.

        The block may be freed at once (its memory is kept until the copy is done), but not written to
        before ``on_ready`` saw it: finished KV blocks are never written again by a model. With
        ``keep_reference`` the ring may hold the block until a slot frees (up to ``pending_nbytes``).
        """
        return self.submit_many([block], [meta], keep_reference=keep_reference)[0]

    def submit_many(
        self, blocks: Sequence[torch.Tensor], metas: Sequence[Any], *, keep_reference: bool = False
    ) -> list[bool]:
        """``submit`` for several blocks of one device: one fence, one lock round and
        one batch of copies with one completion event, instead of one each. The call waits for room at most
        ``wait_s`` in all (a drain that frees a slot now and then must not make each block wait anew);
        past that, a block that finds no room at once is dropped. Returns, per block, whether it was
        accepted."""
        for block in blocks:
            if block.numel() * block.element_size() > self.slots.shape[1]:
                raise ValueError(
                    f"block of {block.numel() * block.element_size()} bytes does not fit a "
                    f"{self.slots.shape[1]}-byte slot"
                )
        ready = None
        if self.cuda and blocks:  # the fence: whatever the compute stream queued up to here is in the blocks
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(blocks[0].device))
        accepted = [False] * len(blocks)
        n = 0
        deadline: float | None = None
        while n < len(blocks):
            batch: list[tuple[int, torch.Tensor]] = []
            with self._cv:
                while n < len(blocks) and not self._closed:
                    slot = self._free_slot()
                    nbytes = blocks[n].numel() * blocks[n].element_size()
                    if slot is not None:
                        self._claim(slot, metas[n])
                        batch.append((slot, blocks[n]))
                    elif keep_reference and self._pending_held + nbytes <= self.pending_nbytes:
                        self._pending.append((blocks[n], metas[n], ready))
                        self._pending_held += nbytes
                    else:
                        break
                    accepted[n] = True
                    n += 1
            self._issue(batch, ready)  # before any wait: the drain thread needs these to free slots
            if n == len(blocks) or self._closed:
                break
            if deadline is None:  # one wait per call: a save of 256 blocks once waited for each
                deadline = time.monotonic() + self.wait_s
            nbytes = blocks[n].numel() * blocks[n].element_size()
            with self._cv:
                while (
                    not self._closed
                    and self._free_slot() is None
                    and not (keep_reference and self._pending_held + nbytes <= self.pending_nbytes)
                ):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:  # past the call's deadline: block n is dropped, the next ones
                        self.counters.add("staging", "dropped_saves")  # get in only where room is now
                        n += 1
                        break
                    self._cv.wait(remaining)
        return accepted

    def _free_slot(self) -> int | None:
        """A free slot a new block may take: none while blocks are pending (they never get overtaken)."""
        if self._pending:
            return None
        return self._free[0] if self._free else None

    def _issue(self, batch: Sequence[tuple[int, torch.Tensor]], ready: Any) -> None:
        """Start the copies of ``(slot, block)`` pairs into their claimed slots (from ``submit_many`` or the
        drain thread), then let the drain thread see them."""
        if not batch:
            return
        try:
            dsts = [
                self.slots[slot, : b.numel() * b.element_size()].view(b.dtype).view(b.shape)
                for slot, b in batch
            ]
            if self.cuda:
                stream = self._stream
                assert stream is not None
                with (
                    torch.cuda.device(self.device),
                    torch.cuda.stream(stream),
                ):  # any thread, the ring's device
                    stream.wait_event(ready)
                    for dst, (_, block) in zip(dsts, batch):
                        dst.copy_(block, non_blocking=True)
                    event = torch.cuda.Event()  # one for the batch: its copies finish in stream order
                    event.record(stream)
                for slot, block in batch:
                    block.record_stream(stream)  # the allocator must not reuse block's memory mid-copy
                    self._events[slot] = event
            else:
                for dst, (_, block) in zip(dsts, batch):
                    dst.copy_(block)
        except BaseException:
            self._abandon([slot for slot, _ in batch])
            raise
        self.counters.add("staging", "blocks_written", len(batch))
        self.counters.add("staging", "bytes_written", sum(b.numel() * b.element_size() for _, b in batch))
        with self._cv:
            for slot, _ in batch:
                self._issued[slot] = True
            self._cv.notify_all()

    def _abandon(self, slots: Sequence[int]) -> None:
        """Free claimed slots without handing them on: their copies failed, their bytes are not KV."""
        with self._cv:
            for slot in slots:
                if slot in self._order:
                    self._order.remove(slot)
                self.state[slot] = SlotState.FREE  # from COPYING: the one transition outside the cycle
                self._free.append(slot)
                self._meta[slot] = self._events[slot] = None
                self._issued[slot] = False
            self.counters.add("staging", "write_errors", len(slots))
            self._cv.notify_all()

    def _drain_loop(self) -> None:
        spread_here()
        while True:
            with self._cv:
                while not (self._order and self._issued[self._order[0]]):
                    if self._closed and not self._order:
                        return
                    self._cv.wait(0.05)
                slot = self._order[0]
            event = self._events[slot]
            try:
                if event is not None and not event.query():
                    event.synchronize()  # the oldest copy first: order is kept
            except Exception:  # the copy failed on the device: its slot holds no KV
                log.exception("staging ring: a device-to-host copy failed")
                self._abandon([slot])
                continue
            with self._cv:
                self._move(slot, SlotState.COPYING, SlotState.READY)
                self._move(slot, SlotState.READY, SlotState.DRAINING)
                self._order.pop(0)
                meta, self._meta[slot], self._events[slot] = self._meta[slot], None, None
            try:
                self.on_ready(self.slots[slot], meta)
            except Exception:  # a failing consumer loses a save, never the ring
                log.exception("staging ring: on_ready failed")
                self.counters.add("staging", "write_errors")
            nxt = None
            with self._cv:
                self._move(slot, SlotState.DRAINING, SlotState.FREE)
                self._free.append(slot)
                if self._pending:  # the oldest waiting block takes the slot just freed
                    block, meta, ready = self._pending.popleft()
                    self._pending_held -= block.numel() * block.element_size()
                    self._claim(slot, meta)
                    nxt = (slot, block, ready)
                self._cv.notify_all()
            if nxt is not None:
                try:
                    self._issue([nxt[:2]], nxt[2])
                except Exception:  # abandoned and counted by _issue; the ring goes on
                    log.exception("staging ring: starting a pending copy failed")

    def flush(self) -> None:
        """Wait until every submitted block was handed to ``on_ready``."""
        with self._cv:
            while self._pending or len(self._free) < len(self.state):
                self._cv.wait(0.05)

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
