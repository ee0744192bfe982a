"""A store's calls while it is open: ``close`` waits for those running, and refuses new ones; a store the
program never closed is closed at its exit.

A save returns before its blocks are on disk (the write-behind), so a close that ran beside a save could
flush before that save queued its blocks, which were then lost although the save had returned; and a
store used after its close answered with LMDB's own errors, or from memory as if nothing had happened.
Now a call made after ``close`` began raises ``StoreClosedError``, and ``close`` flushes only once the
calls in flight have returned (at most ``CLOSE_WAIT_S``: a restore from a stalled disk does not hold a
shutdown for ever). A call made from inside another on the same thread (a restore's refresh, a purge's
gc) is part of it, and a close from inside a call (a signal handler's) waits for the other threads' only.

A program that never closes its store lost what was still queued for the disk at exit, silently (an
engine's loop that ends with the interpreter). ``at_exit`` closes every store this process opened, did
not close and still references (a store dropped unclosed is left to the garbage collector, as before),
and says so once: ``with TieredStore.open(...)`` is the way. A store an owner such as the vLLM connector
closes itself is closed there too, without the advice.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from tierkv.errors import StoreClosedError

log = logging.getLogger("tierkv")

__all__ = ["CLOSE_WAIT_S", "OpenCalls", "while_open"]

CLOSE_WAIT_S = 30.0  # close waits this long at most for the calls in flight

F = TypeVar("F", bound=Callable[..., Any])

# id -> a store this process opened and has not closed (weakly: a store dropped unclosed is collected)
_unclosed: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_unclosed_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child owns none of its parent's stores (their threads did not fork), and the lock may
    have been held by a parent thread at the fork."""
    global _unclosed_lock
    _unclosed_lock = threading.Lock()
    _unclosed.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class OpenCalls:
    """The calls into one store in flight, and whether it is closing."""

    def __init__(self, owner: Any, durable: bool) -> None:
        """``owner``: the store (closed at exit if nobody did; said if ``durable``: it has a disk tier)."""
        self._cond = threading.Condition()
        self._calls = 0
        self._depth = threading.local()  # this thread's calls in flight (a call inside a call)
        self.closed = False
        self._done = threading.Event()  # set once the first close has closed everything
        self._pid = os.getpid()
        self._durable = durable
        self.owner_closes = False  # set by an owner that closes the store itself (no advice at exit)
        with _unclosed_lock:
            _unclosed[id(self)] = owner

    def enter(self) -> None:
        depth = getattr(self._depth, "n", 0)
        with self._cond:
            if self.closed and depth == 0:
                raise StoreClosedError("the store is closed (open it again to use it)")
            self._calls += 1
        self._depth.n = depth + 1

    def leave(self) -> None:
        self._depth.n -= 1
        self.release()

    def hold(self) -> None:
        """A call in flight that is no thread's (an export's chunks, drawn on any thread): ``release``."""
        with self._cond:
            if self.closed:
                raise StoreClosedError("the store is closed (open it again to use it)")
            self._calls += 1

    def release(self) -> None:
        with self._cond:
            self._calls -= 1
            self._cond.notify_all()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Refuse new calls and wait (at most ``wait_s``) for those in flight on other threads. False if a
        close began before: this one waited for it to end, and has nothing more to do."""
        with _unclosed_lock:
            _unclosed.pop(id(self), None)
        own = getattr(self._depth, "n", 0)
        with self._cond:
            first = not self.closed
            self.closed = True
            if first and not self._cond.wait_for(lambda: self._calls <= own, wait_s):
                log.warning(
                    "tierkv: closing the store with %d calls still running after %.0f s",
                    self._calls - own,
                    wait_s,
                )
        if not first:
            self._done.wait(wait_s + 60.0)  # (the first close's flush: bounded by its own timeouts)
        return first

    def closed_all(self) -> None:
        """The first close is over (tiers closed, whatever it raised): later closes return."""
        self._done.set()


def while_open(method: F) -> F:
    """A method of the store that runs only while it is open (``StoreClosedError`` once ``close`` began,
    unless called from inside another), and that ``close`` waits for."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._open_calls.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._open_calls.leave()

    return call  # type: ignore[return-value]


@atexit.register
def at_exit() -> None:
    """Close the stores this process opened and never closed (their saves flushed to disk)."""
    with _unclosed_lock:
        stores = list(_unclosed.values())
    said = False
    for store in stores:
        calls: OpenCalls = store._open_calls
        if calls._pid != os.getpid() or calls.closed:
            continue
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - at exit: the next store is still closed
            log.warning("tierkv: a store left open failed to close at exit: %s: %s", type(exc).__name__, exc)
            continue
        if calls._durable and not calls.owner_closes and not said:
            said = True
            log.warning(
                "tierkv: a store was still open at exit: closed now, its saves flushed to disk (close it, or "
                "open it with `with TieredStore.open(...)`)"
            )
