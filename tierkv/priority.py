"""Thread priorities: background work (the disk writer, sweeps, populating a new host tier) runs only on
CPU that inference leaves idle, except while it holds a lock others wait on."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import resource
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["WRITER_NICE", "can_leave_idle", "idle_priority", "normal_priority"]

WRITER_NICE = 19  # where SCHED_IDLE is refused: the lowest priority
CAP_SYS_NICE = 23  # linux/capability.h


_priority = threading.local()  # .idle: this thread runs at idle priority outside transactions


@functools.cache
def can_leave_idle() -> bool:
    """Whether a thread may go back from SCHED_IDLE to normal priority (``normal_priority``): it needs
    CAP_SYS_NICE or an RLIMIT_NICE of 20 (unprivileged containers have neither). Without it, a thread
    that went idle would hold locks at idle priority for good."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if soft == resource.RLIM_INFINITY or soft >= 20:
            return True
    except (AttributeError, OSError, ValueError):
        pass
    try:
        m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", Path("/proc/self/status").read_text(), re.M)
        return m is not None and bool(int(m.group(1), 16) >> CAP_SYS_NICE & 1)
    except OSError:
        return False


def idle_priority() -> None:
    """Run the calling thread only on otherwise idle CPU (SCHED_IDLE) where it can come back for its
    transactions, else at the lowest nice."""
    tid = threading.get_native_id()
    try:
        if not can_leave_idle():
            raise PermissionError("SCHED_IDLE could not be left")
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        _priority.idle = True
    except (OSError, AttributeError):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)


@contextlib.contextmanager
def normal_priority() -> Iterator[bool]:
    """An idle-priority thread holding LMDB's write lock (or a place in the resize gate, or the mmap lock)
    would make the model thread and other processes wait for CPU nobody gives it: such sections run at
    normal priority. Yields whether the thread runs at normal priority inside."""
    if not getattr(_priority, "idle", False):
        yield True
        return
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # not permitted here: stay idle
        yield False
        return
    _priority.idle = False
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        _priority.idle = True
