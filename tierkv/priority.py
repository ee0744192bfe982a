"""Thread priorities: background work (the disk writer, sweeps, populating a new host tier) runs only on
CPU that inference leaves idle, except while it holds a lock others wait on."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["WRITER_NICE", "idle_priority", "normal_priority"]

WRITER_NICE = 19  # where SCHED_IDLE is refused: the lowest priority


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
