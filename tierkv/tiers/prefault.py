"""Fault a new host pool's pages in behind the caller's back, so that neither the allocation nor the first
saves and restores pay for them.

A fresh ``torch.empty`` of a few GiB is only address space: each first write to a 4 KiB page faults. Zeroing
the whole pool at allocation moved that cost to the first save or restore (0.2 to 0.5 s for 1 to 2 GiB on
the request path). ``MADV_POPULATE_WRITE`` (Linux 5.14) maps the pages writable without writing them, so a
background thread can populate the pool while other threads already copy blocks into it: the contents
are never touched. Where the kernel lacks it, pages fault on first write, one block at a time.

The thread runs at nice 19 and paces itself (a pause as long as each call: at most half a core): populating
1 GiB is about 0.5 s of CPU on the 2-core development machine, and a restore right after start-up read
480 MiB at 0.61 GB/s while it ran beside it at normal priority and unpaced, against 0.97 to 1.04 GB/s once
it was done. Each madvise call holds the process's mmap lock, so it runs at nice 0 where the process may
raise a thread's priority (an allocator's mmap or munmap waits for it). Never at SCHED_IDLE: see
``priority.py``.

No ``MADV_HUGEPAGE``. Measured on the 2-core development VM (2026-12-05, fresh processes, alternated):
populating a 960 MiB host tier took 1.8 s with huge pages against 0.25 s without (medians of 6; 0.14 s in
2 of the 6), though in memory the process had used before it took 139 against 216 ms per 0.9 GiB. A fresh
huge page is a free 2 MiB block, and the VM's free page reporting (virtio-balloon, blocks of order 9 and
up) has handed those back to the host, which faults each in again; small pages come from blocks already
split, still backed. Host-tier restores gained 4% (13.5 against 13.0
GB/s). And where ``defrag`` is ``madvise`` an advised fault compacts memory on the spot, under the mmap
lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator

import torch

from tierkv.cpus import spread_here
from tierkv.priority import background_priority, normal_priority

log = logging.getLogger(__name__)

__all__ = ["Populator", "foreground", "populate_in_background"]

MADV_POPULATE_WRITE = 23  # linux/mman.h
# One madvise call: it holds the process's mmap lock (read), so keep it short (about 2 ms of CPU): an
# allocator waiting to map memory must not wait long for it.
CHUNK_NBYTES = 4 << 20
MAX_RETRIES = 100  # EINTR or EAGAIN from one populate call, per pool: then its pages fault on first use


def _madvise() -> object | None:
    if not os.uname().sysname == "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _pause(stop: threading.Event, seconds: float) -> None:
    stop.wait(seconds)


# Restores and prefills on CPU in progress in this process: a paced populator waits while there are any (a
# server's first cold restores ran at 1.1 against 1.6-1.9 GB/s beside one; its first forward after a
# restart, 9 tokens after 2,864 restored: 136-159 ms beside one, 133-141 with the pause). They are short;
# population can wait.
_foreground = 0
_foreground_lock = threading.Lock()
_YIELD_S = 0.005
_YIELD_MAX_S = 0.1  # per chunk at most: a server always restoring is still populated (40 MB/s)
# A restore's promotion may fault this much past the populated pages on its own path (a small restore
# right after start-up is promoted as before; a large one stops there: ``Populator.ready``).
FAULT_AHEAD_NBYTES = 64 << 20


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Around a restore or a prefill: paced populators wait until it is done."""
    global _foreground
    with _foreground_lock:
        _foreground += 1
    try:
        yield
    finally:
        with _foreground_lock:
            _foreground -= 1


def _yield(stop: threading.Event) -> None:
    deadline = time.monotonic() + _YIELD_MAX_S
    while _foreground > 0 and not stop.is_set() and time.monotonic() < deadline:
        stop.wait(_YIELD_S)


class Populator:
    """The populating thread of one pool; ``stop`` ends it between two calls (a pool being closed: a
    daemon thread still running when the interpreter exits is killed wherever it is)."""

    def __init__(self, start: int, end: int, name: str, pool: torch.Tensor, paced: bool = True) -> None:
        self._stop = threading.Event()
        self.end = end  # pages in [end - left_nbytes, end) are not populated yet
        self.left_nbytes = end - start  # (the thread lowers it as it goes; 0 at its end)
        self.thread = threading.Thread(
            target=_populate,
            args=(start, end, name, pool, self._stop, paced, self),
            name=f"tierkv-{name}-prefault",
            daemon=True,
        )
        self.thread.start()

    def ready(self, end: int) -> bool:
        """Whether a restore may write the pages below address ``end`` now: populated, at most
        ``FAULT_AHEAD_NBYTES`` past those that are, or the thread is over (what is left faults on first
        use). A large copy into the rest would fault their pages on the request path beside this thread
        (a fresh process's first cold restore of 480 MiB: 1.05 GB/s promoting while a 960 MiB tier was
        populated behind, 1.47 once populated, 1.88 without a host tier; 4 alternated runs, 2026-12-05)."""
        left = self.left_nbytes
        return left == 0 or end <= self.end - left + FAULT_AHEAD_NBYTES

    def join(self, timeout_s: float | None = None) -> None:
        self.thread.join(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)


def _populate(
    start: int,
    end: int,
    name: str,
    pool: torch.Tensor,
    stop: threading.Event,
    paced: bool = True,
    progress: Populator | None = None,
) -> None:
    """``pool`` is only held: its memory stays mapped while the thread works on its addresses. Unpaced: at
    normal priority and without pauses (a caller waiting for it, before any request)."""
    try:
        _populate_range(start, end, name, stop, paced, progress)
    finally:
        if progress is not None:
            progress.left_nbytes = 0  # done, stopped, or unsupported: its pages fault on first use


def _populate_range(
    start: int, end: int, name: str, stop: threading.Event, paced: bool, progress: Populator | None
) -> None:
    fn = _madvise()
    if fn is None:
        return
    spread_here()
    if paced:
        background_priority()
    t0 = time.perf_counter()
    addr, retries = start, 0
    while addr < end and not stop.is_set():
        n = min(CHUNK_NBYTES, end - addr)
        if paced:
            _yield(stop)
            if stop.is_set():
                break
        with normal_priority():
            call_s = time.perf_counter()
            rc = fn(ctypes.c_void_p(addr), ctypes.c_size_t(n), MADV_POPULATE_WRITE)  # type: ignore[operator]
            call_s = time.perf_counter() - call_s
        if rc != 0 and ctypes.get_errno() in (errno.EINTR, errno.EAGAIN) and retries < MAX_RETRIES:
            retries += 1  # a signal arrived, or the kernel asked to come back: the same chunk again
            continue
        if rc != 0:
            err = ctypes.get_errno()
            log.debug(
                "%s tier: no MADV_POPULATE_WRITE (%s); pages fault on first use", name, os.strerror(err)
            )
            return
        if paced:
            _pause(stop, call_s)  # at most half a core
        addr += n
        if progress is not None:
            progress.left_nbytes = end - addr
    log.debug("%s tier: %.1f MiB populated in %.2f s", name, (end - start) / 2**20, time.perf_counter() - t0)


def populate_in_background(pool: torch.Tensor, name: str, paced: bool = True) -> Populator | None:
    """Start populating ``pool``'s pages (a CPU tensor, not pinned: pinned memory is populated by its
    allocator); returns its populator, or None when there is nothing to do. ``paced=False``: as fast as
    it can, for a caller that waits for it (``join``)."""
    if pool.device.type != "cpu" or pool.is_pinned():
        return None
    page = mmap.PAGESIZE
    start = -(-pool.data_ptr() // page) * page  # whole pages inside the pool only
    end = (pool.data_ptr() + pool.numel() * pool.element_size()) // page * page
    if end <= start:
        return None
    return Populator(start, end, name, pool, paced)
