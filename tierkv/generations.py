"""Purges and invalidations against blocks on their way (``Generations``).

Every block on its way carries the generation it was saved in (or, written back by a restore, the one the
restore began in). A purge or an invalidation starts a new generation; a block of what it named from an
older one is dropped wherever it is when it arrives: leaving the staging ring, entering a memory tier, or
committing to a record tier (the disk writer checks inside the transaction that would index it).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from tierkv.keys import BlockChain, BlockKey, NamespaceDigest

__all__ = ["FENCE_WAIT_S", "MAX_NAMED", "Generations"]

log = logging.getLogger("tierkv.store")

FENCE_WAIT_S = 120.0  # a purge waits at most this long for the restores that began before it
MAX_NAMED = 65536  # purged namespaces and invalidated keys remembered; past it, older saves all drop


@dataclasses.dataclass(frozen=True)
class _Fence:
    """A purge or invalidation in progress: ``ns`` None and no ``keys`` is everything."""

    ns: NamespaceDigest | None
    keys: frozenset[bytes]

    def usable(self, chain: BlockChain) -> int:
        """How many leading blocks of ``chain`` it leaves alone."""
        if self.ns is not None and self.ns != chain.ns.digest:
            return len(chain)
        if not self.keys:
            return 0
        return next((i for i, k in enumerate(chain.keys) if k in self.keys), len(chain))


class Generations:
    """Which blocks on their way may still be stored, and which restores a purge must wait for.

    ``fence`` (a purge or an invalidation) starts a new generation: a block saved in an older one, of
    the namespace or key it names, is no longer ``live``. While the fence is up, restores and lookups see
    what it names as a miss (they would copy it from one tier into another behind the purge), and it
    first waits for the restores that began before it (they may still be copying what they read). So
    once the caller has removed what it named from every tier, nothing brings it back.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._gen = 0
        self._all = 0  # the generation of the last purge of everything (and the floor, see _name)
        self._named: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # ns digest or key
        self._fences: list[_Fence] = []
        self._readers: collections.Counter[int] = collections.Counter()  # restores by starting generation
        self._local = threading.local()  # the generation of the restore running on this thread
        # Namespaces saved lately (bounded): a purge by digest prefix finds one with nothing on disk yet.
        self._seen: collections.OrderedDict[NamespaceDigest, None] = collections.OrderedDict()

    def saw(self, ns: NamespaceDigest) -> None:
        with self._cv:
            self._seen.pop(ns, None)
            self._seen[ns] = None
            while len(self._seen) > MAX_NAMED:
                self._seen.popitem(last=False)

    def seen(self) -> list[NamespaceDigest]:
        """Namespaces saved lately, oldest first."""
        with self._cv:
            return list(self._seen)

    @property
    def current(self) -> int:
        """The generation a block handed on now belongs to (a restore's own, on its thread)."""
        gen = getattr(self._local, "gen", None)
        if gen is not None:
            return int(gen)
        with self._cv:
            return self._gen

    def live(self, ns: bytes, key: bytes, gen: int) -> bool:
        """Whether a block saved in generation ``gen`` may still be stored."""
        with self._cv:
            return gen >= max(self._all, self._named.get(ns, 0), self._named.get(key, 0))

    def liveness(self, ns: bytes) -> Callable[[bytes], bool]:
        """``live`` for blocks of ``ns`` handed on now, by key: a memory tier checks it as it publishes a
        block, so a restore still copying after a fence gave up waiting for it (``FENCE_WAIT_S``) cannot
        bring back what the purge removed. Of the generation ``current`` says: inside ``reading``, on the
        restore's thread, the restore's own (what it read may be purged since)."""
        gen = self.current
        return functools.partial(self.live, ns, gen=gen)

    def usable(self, chain: BlockChain) -> int:
        """How many leading blocks of ``chain`` no fence in progress names."""
        with self._cv:
            return min((f.usable(chain) for f in self._fences), default=len(chain))

    @contextlib.contextmanager
    def reading(self, chain: BlockChain) -> Iterator[int]:
        """A restore of ``chain``: yields how many leading blocks it may read. Fences wait for it, and what
        it writes back on this thread is of the generation it began in."""
        with self._cv:
            n = min((f.usable(chain) for f in self._fences), default=len(chain))
            gen = self._gen
            self._readers[gen] += 1
        self._local.gen = gen
        try:
            yield n
        finally:
            self._local.gen = None
            with self._cv:
                self._readers[gen] -= 1
                if not self._readers[gen]:
                    del self._readers[gen]
                self._cv.notify_all()

    @contextlib.contextmanager
    def fence(self, ns: NamespaceDigest | None, keys: Sequence[BlockKey] = ()) -> Iterator[int]:
        """Start a new generation for namespace ``ns`` (None: every namespace) or only its ``keys``, and
        wait for the restores that began before; the caller removes what it names from every tier inside."""
        fence = _Fence(ns, frozenset(keys))
        with self._cv:
            self._gen += 1
            gen = self._gen
            if ns is None and not keys:
                self._all = gen
            names: list[bytes] = list(keys) if keys else [ns] if ns is not None else []
            for name in names:
                self._name(name, gen)
            self._fences.append(fence)
            deadline = time.monotonic() + FENCE_WAIT_S
            while any(g < gen for g in self._readers):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("a purge waited %.1f s for restores begun before it; going on", FENCE_WAIT_S)
                    break
                self._cv.wait(left)
        try:
            yield gen
        finally:
            with self._cv:
                self._fences.remove(fence)

    def _name(self, name: bytes, gen: int) -> None:
        """Remember that ``name`` was purged in ``gen`` (bounded: the oldest forgotten raise the floor, so
        what they named stays dropped, with every block saved before them)."""
        self._named.pop(name, None)
        self._named[name] = gen
        while len(self._named) > MAX_NAMED:
            self._all = max(self._all, self._named.popitem(last=False)[1])
