"""Admission: a tier that takes a block only once enough requests contained it (``--remote-admit-after``).

A wrapper around another tier (the remote one: shared by every worker, so a block seen once is rarely
worth the network and the space). It counts requests per block in a bounded map; saves reach the inner
tier only for admitted blocks, and a block that reaches the count while cached locally is written then.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierkv.keys import BlockChain, BlockKey, NamespaceDigest
from tierkv.tiers.base import BlockWrite, Tier

if TYPE_CHECKING:
    from tierkv.tiers.target import Target

__all__ = ["Admission"]

MAX_TRACKED_KEYS = 65536  # sightings kept (least recently seen forgotten first)


class Admission(Tier):
    def __init__(self, inner: Tier, admit_after: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.admit_after = admit_after
        self._seen: collections.OrderedDict[BlockKey, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    def sightings(self, key: BlockKey) -> int:
        return self._seen.get(key, 0)

    def admitted(self, key: BlockKey) -> bool:
        return self.sightings(key) >= self.admit_after

    def requested(self, chain: BlockChain) -> None:
        with self._lock:
            for key in chain.keys:
                count = self._seen.pop(key, 0) + 1
                self._seen[key] = count
            while len(self._seen) > MAX_TRACKED_KEYS:
                self._seen.popitem(last=False)
        self.inner.requested(chain)

    def needs(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        inner = self.inner.needs(chain, idx)
        return [n and self.admitted(chain.keys[i]) for i, n in zip(idx, inner)]

    def served_above(self, chain: BlockChain, idx: Sequence[int]) -> list[int]:
        """Blocks cached locally that this request admitted (they reached the count just now)."""
        wanted = self.inner.needs(chain, idx)
        due = [i for i, w in zip(idx, wanted) if w and self.sightings(chain.keys[i]) == self.admit_after]
        return sorted(set(self.inner.served_above(chain, idx)) | set(due))

    def probe(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        return self.inner.probe(chain, idx)

    def read_into(self, chain: BlockChain, first: int, count: int, target: Target) -> int:
        return self.inner.read_into(chain, first, count, target)

    def write(self, block: BlockWrite) -> bool:
        return self.inner.write(block)

    def drop(self, ns: NamespaceDigest | None) -> int:
        return self.inner.drop(ns)

    def invalidate(self, ns: NamespaceDigest, keys: Sequence[BlockKey]) -> list[bool]:
        return self.inner.invalidate(ns, keys)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def describe(self) -> str:
        return f"{self.inner.describe()} (admit after {self.admit_after} requests)"

    def flush(self) -> object:
        return self.inner.flush()

    def close(self) -> None:
        self.inner.close()
