"""Thread priorities for background work: the disk writer, sweeps, populating a new host tier.

Python bytecode never runs at ``SCHED_IDLE``: a thread preempted there while holding the GIL stalls every
other Python thread, the model's included, for as long as the cores stay busy (measured on 2 cores with one
busy: the main thread's p99 wait for the GIL was 371 ms beside an idle-priority thread, 14.6 ms beside a
normal one). So background threads run at nice 19 (a small share of a busy core, but never starved) and
pace themselves; they go to ``SCHED_IDLE`` only inside native calls that released the GIL
(``tierkv._native.write_run``), where being starved stalls nobody. Sections that hold what others wait for
(LMDB's write lock, the resize gate, the process's mmap lock) run at nice 0 where the process may raise a
thread's priority again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator

__all__ = ["BACKGROUND_NICE", "background_priority", "can_raise_priority", "native_idle", "normal_priority"]


def _background_nice() -> int:
    """TIERKV_BACKGROUND_NICE (0 to 19, default 19); anything else is ignored with a warning."""
    raw = os.environ.get("TIERKV_BACKGROUND_NICE", "19")
    try:
        value = int(raw)
        if 0 <= value <= 19:
            return value
    except ValueError:
        pass
    logging.getLogger("tierkv").warning("TIERKV_BACKGROUND_NICE=%r is not a nice value 0..19: using 19", raw)
    return 19


BACKGROUND_NICE = _background_nice()

_priority = threading.local()  # .background: this thread runs at BACKGROUND_NICE outside its sections


@functools.cache
def can_raise_priority() -> bool:
    """Whether a thread may lower its nice value again. Tried, once, on a throwaway thread (at nice 19 for
    a moment, never idle): what capabilities and RLIMIT_NICE say is not enough (CAP_SYS_NICE inside a
    user namespace is checked against the initial one). Without it a background thread holds its locks
    at nice 19."""
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
            os.setpriority(os.PRIO_PROCESS, tid, 0)
            result.append(True)
        except (OSError, AttributeError):
            result.append(False)

    thread = threading.Thread(target=probe, name="tierkv-priority-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])


@functools.cache
def native_idle() -> bool:
    """Whether a native call may run its byte work at SCHED_IDLE and come back before taking the GIL:
    probed by the native module on a pthread of its own, without the GIL (no Python runs idle)."""
    from tierkv import native

    return native.enabled() and bool(native.module().can_leave_idle())


def background_priority() -> None:
    """The calling thread from now on: nice 19 (on Linux, a thread id's nice is that thread's own)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        _priority.background = True


@contextlib.contextmanager
def normal_priority() -> Iterator[bool]:
    """A background thread holding LMDB's write lock (or a place in the resize gate, or the mmap lock)
    would make the model's thread and other processes wait for a thread that gets a small share of a busy
    core: such sections run at nice 0. Yields whether the thread runs at normal priority inside."""
    if not getattr(_priority, "background", False):
        yield True
        return
    if not can_raise_priority():
        yield False
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 0)
    except OSError:
        yield False
        return
    _priority.background = False
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
        _priority.background = True
