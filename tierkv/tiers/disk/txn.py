"""Threads and LMDB transactions: the gate that lets a map resize wait for open transactions, and the
priority rules for background threads."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["TxnGate", "WRITER_NICE", "idle_priority", "normal_priority"]

WRITER_NICE = 19  # where SCHED_IDLE is refused: the lowest priority


class TxnGate:
    """LMDB forbids ``set_mapsize`` while any transaction of this process is open: transactions enter
    shared, a map resize waits until they have all left (exclusive). Re-entrant per thread for shared."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False
        self._local = threading.local()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._resizing:
                    self._cond.wait()
                self._active += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    if self._active == 0:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._local, "depth", 0):
            raise RuntimeError("map resize requested inside a transaction of the same thread")
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


_priority = threading.local()  # .idle: this thread runs at idle priority outside transactions


def idle_priority() -> None:
    """Run the calling thread only on otherwise idle CPU (SCHED_IDLE), else at the lowest nice."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        _priority.idle = True
    except (OSError, AttributeError):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)


@contextlib.contextmanager
def normal_priority() -> Iterator[None]:
    """An idle-priority thread holding LMDB's write lock (or a place in the resize gate) would make the
    model thread and other processes wait for CPU nobody gives it: transactions run at normal priority."""
    if not getattr(_priority, "idle", False):
        yield
        return
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # not permitted here: stay idle
        yield
        return
    _priority.idle = False
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        _priority.idle = True
