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
import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from tierkv.cpus import spread_here
from tierkv.keys import BlockChain

log = logging.getLogger("vllm.tierkv")

__all__ = ["LATER", "LOOKUP_GIVE_UP_S", "AfterWork", "Lookups", "Recently"]

LOOKUP_GIVE_UP_S = 10.0  # a lookup still running after this counts as a miss (the request is computed)
LATER = object()  # a lookup that has not answered yet: vLLM is told to ask again
AFTER_EVERY_S = 1.0  # ``after``'s work for one key at most this often (a hot prefix: at every request)
MAX_AFTER_PENDING = 256  # plain refreshes waiting beyond this are dropped (counted): a burst stays bounded
# Work that carries a request's pin or retention, which nothing else gives the blocks vLLM holds: dropped
# only past this many waiting (counted, and a warning)
MAX_CONTROLS_PENDING = 4096
MAX_AFTER_KEYS = 4096  # keys remembered for AFTER_EVERY_S (least recent forgotten first)
CLOSE_WAIT_S = 10.0  # at close, queued pins and retentions are given for at most this long
CLOSE_GRACE_S = 5.0  # and a piece of work still running is waited for this much longer


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


class AfterWork:
    """Work a lookup's answer need not wait for (keeping what vLLM holds recent, and giving it the request's
    pin or retention), on one thread of its own, so that no lookup waits behind it. A plain refresh
    (``control`` False) is skipped when its ``key`` (a prefix) was queued less than ``AFTER_EVERY_S`` ago,
    and dropped when ``MAX_AFTER_PENDING`` wait; work that carries a control is never skipped, runs before
    any refresh, and is dropped only past ``MAX_CONTROLS_PENDING`` (with a warning). A failure is logged
    once per kind; all of it counted by ``count``."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._cond = threading.Condition()
        self._controls: collections.deque[Callable[[], None]] = collections.deque()
        self._refreshes: collections.deque[Callable[[], None]] = collections.deque()
        self._done = Recently(AFTER_EVERY_S, MAX_AFTER_KEYS)
        self._running = False
        self._closing = False
        self._deadline = math.inf
        self._wait_s = CLOSE_WAIT_S
        self._warned = False
        self._thread: threading.Thread | None = None  # started with the first work
        self._failures: dict[str, int] = {}

    def put(self, key: Hashable | None, work: Callable[[], None], control: bool) -> None:
        now = time.monotonic()
        with self._cond:
            if self._closing:
                return
            if control:
                if len(self._controls) >= MAX_CONTROLS_PENDING:
                    self._count("after_control_dropped")
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "tierkv: %d pins or retentions of prefixes vLLM holds are waiting: one more was "
                            "dropped (counted as after_control_dropped; said once)",
                            MAX_CONTROLS_PENDING,
                        )
                    return
                self._controls.append(work)
            else:
                if key is not None and self._done.fresh(key, now):
                    return
                if len(self._refreshes) >= MAX_AFTER_PENDING:
                    self._count("after_dropped")
                    return
                if key is not None:
                    self._done.mark(key, now)
                self._refreshes.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-keep", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        spread_here()
        while True:
            with self._cond:
                while not self._closing and not self._controls and not self._refreshes:
                    self._cond.wait()
                if self._closing:
                    self._refreshes.clear()  # (a store about to close: nobody reads what they refresh)
                    if self._controls and time.monotonic() > self._deadline:
                        self._drop_controls()
                    if not self._controls:
                        self._cond.notify_all()
                        return
                queue = self._controls if self._controls else self._refreshes
                work = queue.popleft()
                self._running = True
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - logged once per kind, counted: the engine goes on
                kind = f"after:{type(exc).__name__}"
                self._count(kind)
                self._failures[kind] = self._failures.get(kind, 0) + 1
                if self._failures[kind] == 1:
                    log.warning(
                        "tierkv: keeping a prefix vLLM holds recent failed (%s: %s)", type(exc).__name__, exc
                    )
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def settle(self, timeout_s: float) -> None:
        """Wait until what was queued so far has run (TimeoutError past ``timeout_s``)."""
        with self._cond:
            idle = lambda: not (self._controls or self._refreshes or self._running)  # noqa: E731
            if not self._cond.wait_for(idle, timeout_s):
                raise TimeoutError("work queued after the lookups did not run in time")

    def _drop_controls(self) -> None:
        """Under the lock: the controls still queued at the stop's deadline."""
        for _ in self._controls:
            self._count("after_control_dropped")
        log.warning(
            "tierkv: %d pins or retentions of prefixes vLLM holds not given: the stop's %.0f s for them ran out",
            len(self._controls),
            self._wait_s,
        )
        self._controls.clear()

    def close(self, wait_s: float) -> None:
        """Queued controls are done for at most ``wait_s``, queued refreshes dropped; returns once the
        thread has ended, or ``CLOSE_GRACE_S`` past the deadline (work stuck in the store, a stalled disk:
        the thread is a daemon, and the store it uses answers it with errors once closed)."""
        with self._cond:
            self._closing = True
            self._wait_s = wait_s
            self._deadline = time.monotonic() + wait_s
            thread = self._thread
            self._cond.notify_all()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(wait_s + CLOSE_GRACE_S)
        if thread.is_alive():
            with self._cond:
                if self._controls:
                    self._drop_controls()
            log.warning("tierkv: work on the prefixes vLLM holds still running at the stop: left behind")


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
        self._count_lock = threading.Lock()
        self._after = AfterWork(self._count)

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

    def after(self, key: Hashable | None, work: Callable[[], None], *, control: bool = False) -> None:
        """``work``, which a lookup's answer need not wait for, on a thread of its own (``AfterWork``)."""
        self._after.put(key, work, control)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until what was queued so far has run, ``after``'s work included."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result(timeout=timeout_s)
        self._after.settle(timeout_s)

    def _count(self, what: str) -> None:
        with self._count_lock:  # (from the scheduler's, the lookup's and the keep thread)
            self.errors[what] = self.errors.get(what, 0) + 1

    def close(self) -> None:
        """Before the store they use goes: wait for the running lookup (queued ones never start: nobody
        waits for their answer), and ``after``'s work that carries a request's pin or retention (a pin
        asked just before a stop is kept) for at most ``CLOSE_WAIT_S``; plain refreshes still queued are
        dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
        self._after.close(CLOSE_WAIT_S)
        if self.errors:  # since start
            log.info("tierkv connector (scheduler): lookups not answered at once: %s", self.errors)
