"""The scheduler side's lookups, off vLLM's scheduler loop: a lookup reads the index (a cold page, a slow
disk, a remote tier), and vLLM's scheduler must not wait on I/O.

Each lookup runs on the connector's one lookup thread; an answer within ``wait_s`` (a warm index:
microseconds) is used at once, one still reading answers ``LATER`` (vLLM asks again at its next step, as its
connector API allows) and one still running after ``LOOKUP_GIVE_UP_S`` is a miss. A lookup that fails is a
miss too, never an exception in vLLM's loop, and lookups then pause (doubling from 1 s to a minute) so a
failing disk costs the scheduler nothing per request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from tierkv.cpus import spread_here
from tierkv.keys import BlockChain

log = logging.getLogger("vllm.tierkv")

__all__ = ["LATER", "LOOKUP_GIVE_UP_S", "Lookups", "Recently"]

LOOKUP_GIVE_UP_S = 10.0  # a lookup still running after this counts as a miss (the request is computed)
LATER = object()  # a lookup that has not answered yet: vLLM is told to ask again
AFTER_EVERY_S = 1.0  # ``after``'s work for one key at most this often (a hot prefix: at every request)
MAX_AFTER_PENDING = 256  # ``after``'s work waiting beyond this is dropped (counted): a burst stays bounded
MAX_AFTER_KEYS = 4096  # keys remembered for AFTER_EVERY_S (least recent forgotten first)


class Looking(Protocol):
    """A request's lookup state (the scheduler side's per-request record)."""

    chain: BlockChain
    local_tokens: int
    lookup: concurrent.futures.Future[Any] | None
    lookup_since: float


class Recently:
    """Keys marked within ``every_s`` (the ``max_keys`` most recent remembered): work done for a key
    (a prefix) at most that often."""

    def __init__(self, every_s: float, max_keys: int) -> None:
        self.every_s, self.max_keys = every_s, max_keys
        self._at: collections.OrderedDict[Hashable, float] = collections.OrderedDict()

    def fresh(self, key: Hashable, now: float) -> bool:
        last = self._at.get(key)
        return last is not None and now - last < self.every_s

    def mark(self, key: Hashable, now: float) -> None:
        self._at[key] = now
        self._at.move_to_end(key)
        while len(self._at) > self.max_keys:
            self._at.popitem(last=False)


class Lookups:
    def __init__(
        self,
        lookup: Callable[[Any], Any],
        wait_s: float,
        on_slow: Callable[[str], None],
    ) -> None:
        """``lookup(r)``: the store's for request ``r`` (its hit, or None); ``on_slow(outcome)``: a lookup deferred or
        given up (the metrics)."""
        self._lookup, self.wait_s, self._on_slow = lookup, wait_s, on_slow
        self.errors: dict[str, int] = {}  # deferred, given up, skipped while paused, failures by kind
        self.paused_until = 0.0
        self._backoff_s = 0.0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first lookup
        # ``after``'s thread, its queue's length and when each key's work was last queued
        self._after: concurrent.futures.ThreadPoolExecutor | None = None
        self._after_lock = threading.Lock()
        self._after_pending = 0
        self._after_done = Recently(AFTER_EVERY_S, MAX_AFTER_KEYS)

    def soon(self, r: Looking) -> Any:
        """``r``'s hit (or None, a miss), or ``LATER``: its lookup is still reading."""
        if r.lookup is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tierkv-lookup", initializer=spread_here
                )
            r.lookup, r.lookup_since = self._pool.submit(self._guarded, r), time.monotonic()
            wait_s = self.wait_s
        else:
            wait_s = 0.0
        try:
            hit = r.lookup.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            outcome = "deferred" if time.monotonic() - r.lookup_since < LOOKUP_GIVE_UP_S else "given_up"
            self._count(outcome)
            self._on_slow(outcome)
            if outcome == "deferred":
                return LATER
            hit = None
        r.lookup = None
        return hit

    def _guarded(self, r: Looking) -> Any:
        """The store's lookup, or None on a failure (LMDB's reader table full, a store that cannot reopen
        after a map resize, EIO): each kind logged once, then a pause."""
        now = time.monotonic()
        if now < self.paused_until:
            self._count("skipped")
            return None
        try:
            hit = self._lookup(r)
        except Exception as exc:
            kind = type(exc).__name__
            self._count(kind)
            if self.errors[kind] == 1:
                log.warning("tierkv: a lookup failed (%s: %s); it counts as a miss", kind, exc)
            self._backoff_s = min(60.0, max(1.0, 2 * self._backoff_s))
            self.paused_until = now + self._backoff_s
            return None
        self._backoff_s = 0.0
        return hit

    def after(self, key: Hashable | None, work: Callable[[], None]) -> None:
        """``work``, which a lookup's answer need not wait for, on a thread of its own (no lookup waits
        behind it): skipped when ``key`` (None: never) was done less than ``AFTER_EVERY_S`` ago, and when
        ``MAX_AFTER_PENDING`` are already waiting. A failure is logged once per kind and counted."""
        now = time.monotonic()
        with self._after_lock:
            if key is not None and self._after_done.fresh(key, now):
                return
            if self._after_pending >= MAX_AFTER_PENDING:
                self._count("after_dropped")
                return
            if key is not None:
                self._after_done.mark(key, now)
            if self._after is None:
                self._after = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="tierkv-keep", initializer=spread_here
                )
            self._after_pending += 1
            self._after.submit(self._quietly, work)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until what was queued so far has run, ``after``'s work included."""
        for pool in (self._pool, self._after):
            if pool is not None:
                pool.submit(lambda: None).result(timeout=timeout_s)

    def _quietly(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:
            kind = f"after:{type(exc).__name__}"
            self._count(kind)
            if self.errors[kind] == 1:
                log.warning(
                    "tierkv: keeping a prefix vLLM holds recent failed (%s: %s)", type(exc).__name__, exc
                )
        finally:
            with self._after_lock:
                self._after_pending -= 1

    def _count(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def close(self) -> None:
        """Before the store they use goes: wait for the running lookup (queued ones never start: nobody
        waits for their answer) and for all ``after`` work (a pin asked just before a stop is kept; at
        most ``MAX_AFTER_PENDING`` of it, each an index read and some hashing)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._after is not None:
            self._after.shutdown(wait=True)
        self._pool = self._after = None
        if self.errors:  # since start
            log.info("tierkv connector (scheduler): lookups not answered at once: %s", self.errors)
