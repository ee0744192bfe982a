"""The record tiers' write-behind queue: callers queue without waiting, one thread handles items in batches.

The disk writer (a batch: one append, one fdatasync, one LMDB commit) and the remote writer (a batch: one
pipelined round trip) share it. Bounds are the owner's (it knows what an item costs); this class only
queues, batches, runs the handler on its thread and lets callers wait for what they queued.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from tierkv.cpus import spread_here

log = logging.getLogger("tierkv.batching")

__all__ = ["BatchQueue"]

T = TypeVar("T")


class BatchQueue(Generic[T]):
    def __init__(
        self,
        name: str,
        handle: Callable[[list[T]], None],
        *,
        item_nbytes: Callable[[T], int],
        batch_nbytes: int,
        batch_items: int = 1 << 30,
        idle_s: float | None = None,
        on_idle: Callable[[], None] | None = None,
        on_start: Callable[[], None] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        """``handle(batch)`` runs on the thread for up to ``batch_items`` items or ``batch_nbytes`` bytes
        (whichever comes first, at least one item); ``on_idle`` runs after ``idle_s`` without items;
        ``on_start`` first, on the thread (its scheduling priority, say); ``on_stop`` last, on ``stop``."""
        self._handle, self._item_nbytes = handle, item_nbytes
        self.batch_nbytes, self.batch_items = batch_nbytes, batch_items
        self._idle_s, self._on_idle, self._on_start, self._on_stop = idle_s, on_idle, on_start, on_stop
        self._queue: queue.Queue[T | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def pending(self) -> int:
        """Items queued and not yet handled."""
        return self._queue.unfinished_tasks

    @property
    def waiting(self) -> bool:
        """Whether items are queued that no batch has taken yet (a handler may leave work for the next)."""
        return not self._queue.empty()

    def put(self, item: T) -> None:
        self._queue.put(item)

    def join(self, timeout_s: float) -> bool:
        """Wait until every item queued so far is handled; False after ``timeout_s`` or if the thread died."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0 or not self.thread.is_alive():
                    return False
                self._queue.all_tasks_done.wait(min(left, 1.0))
        return True

    def stop(self, timeout_s: float) -> bool:
        """Handle what is queued, then end the thread; False if it is still busy after ``timeout_s``."""
        self._queue.put(None)
        self.thread.join(timeout=timeout_s)
        return not self.thread.is_alive()

    def _loop(self) -> None:
        spread_here()
        if self._on_start is not None:
            self._on_start()
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                if self._on_idle is not None:
                    self._run(self._on_idle)
                continue
            if item is None:
                if self._on_stop is not None:
                    self._run(self._on_stop)
                self._queue.task_done()
                return
            batch = [item]
            nbytes = self._item_nbytes(item)
            while nbytes < self.batch_nbytes and len(batch) < self.batch_items:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # handled on the next turn, after this batch
                    self._queue.task_done()
                    break
                batch.append(nxt)
                nbytes += self._item_nbytes(nxt)
            try:
                self._run(functools.partial(self._handle, batch))
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # the owner guards its own steps; anything else must not end the thread
            log.exception("%s: a batch failed", self.thread.name)
