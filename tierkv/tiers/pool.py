"""A preallocated pool of fixed-size block slots with LRU eviction: the memory tiers' common core.

One allocation when the first block arrives (its size fixes the slot size), on the pool's device (host RAM,
pinned when CUDA is present so uploads are DMA; or GPU memory); no allocation per block afterwards. Slots
being read or waiting for a writer hold a reference and are never evicted. A block removed (a purge, an
invalidation) while its slot is held is gone at once, its slot freed when the last reference is released.
``host.HostTier`` and ``gpu.GpuTier`` are this class on their device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from tierkv.keys import BlockChain, BlockKey, NamespaceDigest
from tierkv.layout import KVSpec
from tierkv.metrics import Counters
from tierkv.tenancy import Quota
from tierkv.tiers.base import BlockWrite, Tier
from tierkv.tiers.pool_puts import PoolPuts
from tierkv.tiers.pool_tenants import PoolTenants
from tierkv.tiers.prefault import Populator, populate_in_background
from tierkv.tiers.slot_copies import copy_out
from tierkv.tiers.target import Target
from tierkv.units import format_size

__all__ = ["BlockPool", "MAX_HELD_FRACTION"]

log = logging.getLogger("tierkv.pool")

# Writers (disk, remote) may hold at most this share of the slots: past it they get their own copy, so a
# writer that falls behind under sustained load never leaves the tier without slots for new blocks.
MAX_HELD_FRACTION = 0.5


class BlockPool(PoolPuts, Tier):
    memory = True
    direct = False  # saves copy blocks in on the compute stream (only from its device), not written behind

    def __init__(
        self,
        capacity_nbytes: int,
        *,
        name: str,
        device: torch.device | str = "cpu",
        pin: bool = False,
        counters: Counters | None = None,
        ttl_s: float | None = None,
        max_age_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``ttl_s`` (sliding) and ``max_age_s`` (from the block's creation): the store's retention, applied
        here too: a block past either is a miss in memory as on disk (a promise, not a disk setting)."""
        self.name = name  # the tier's name in counters and logs
        self.ttl_s = ttl_s
        self.max_age_s = max_age_s
        self.clock = clock
        self._atime: dict[BlockKey, float] = {}  # last put or read, for the TTL
        self._ctime: dict[BlockKey, float] = {}  # the block's creation (first save), for the max age
        self.device = torch.device(device)
        if (
            self.device.type == "cuda" and self.device.index is None
        ):  # "cuda" -> "cuda:N": compared to tensors'
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.capacity_nbytes = capacity_nbytes
        self.pin = pin and self.device.type == "cpu"
        self.counters = counters or Counters()
        self.slot_nbytes = 0
        self.num_slots = 0
        self._pool: torch.Tensor | None = None
        self._prefault: Populator | None = None
        self._closed = False
        self._lru: OrderedDict[BlockKey, int] = OrderedDict()  # key -> slot, least recently used first
        self._refs: list[int] = []
        self._held = 0  # slots with a reference: never evicted
        self._dead: set[int] = set()  # held slots whose block was removed: freed on their last release
        self._free: list[int] = []
        # Blocks waiting for a slower tier (write-back, see write_behind.py): evicted only when no clean
        # block can make room (then the slower tier loses them, and the write-behind counts it).
        self._dirty: set[BlockKey] = set()
        # Whose block each slot holds, and the tenants' quotas: a slot to take goes first to a block of a
        # tenant above its quota.
        self._tenants = PoolTenants()
        self._lock = threading.Lock()

    def _allocate(self, slot_nbytes: int, paced: bool = True) -> None:
        self.slot_nbytes = slot_nbytes
        self.num_slots = self.capacity_nbytes // slot_nbytes
        t0 = time.perf_counter()
        self._pool = torch.empty(
            (self.num_slots, slot_nbytes), dtype=torch.uint8, device=self.device, pin_memory=self.pin
        )
        # Its pages are faulted in by a background thread (never zeroed on the request path: a slot is
        # only read after a block was copied into it).
        self._prefault = None if self._closed else populate_in_background(self._pool, self.name, paced)
        log.info(
            "%s tier: %d slots of %d bytes (%.1f MiB on %s%s) in %.2f s",
            self.name,
            self.num_slots,
            slot_nbytes,
            self.num_slots * slot_nbytes / 2**20,
            self.device,
            ", pinned" if self.pin else "",
            time.perf_counter() - t0,
        )
        self._refs = [0] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))

    def close(self) -> None:
        """Stop populating the pool's pages (a daemon thread left running at exit is killed mid-call)."""
        with self._lock:
            self._closed = True  # a later first put allocates without starting one
            populator = self._prefault
        if populator is not None:
            populator.stop()

    def reserve(self, slot_nbytes: int, *, populate_now: bool = False) -> None:
        """Allocate the pool for blocks of ``slot_nbytes`` now (a server does this at start-up).
        ``populate_now``: fault its pages in before returning, at full speed, rather than behind at a
        paced nice 19: an engine whose own threads keep every core busy (vLLM-CPU's OpenMP threads spin)
        leaves a paced populator crawling through the first requests' prefills, its madvise calls holding
        the process's mmap lock (SmolLM2 in vLLM, 2K-token prefills: 8.75 s with a 4 GiB host tier being
        populated, 5.97 s with 256 MiB)."""
        with self._lock:
            if self._pool is None and self.capacity_nbytes >= slot_nbytes:
                self._allocate(slot_nbytes, paced=not populate_now)
            populator = self._prefault if populate_now else None
        if populator is not None:
            t0 = time.perf_counter()
            populator.join()
            log.info("%s tier: pages populated in %.2f s", self.name, time.perf_counter() - t0)

    def _populated(self, slot: int) -> bool:
        """Whether a restore may promote into ``slot`` now (``Populator.ready``: free slots are taken
        lowest first, the order the populator goes in). Caller holds the lock."""
        populator, pool = self._prefault, self._pool
        return (
            populator is None
            or pool is None
            or populator.ready(pool.data_ptr() + (slot + 1) * self.slot_nbytes)
        )

    @property
    def used_nbytes(self) -> int:
        return len(self._lru) * self.slot_nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def _slot(self, key: BlockKey, now: float) -> int | None:
        """The slot of ``key``, None if absent or idle past the TTL (then freed unless in use).
        Caller holds the lock."""
        slot = self._lru.get(key)
        if slot is None or not self._expired(key, now):
            return slot
        if self._refs[slot] == 0:
            del self._lru[key]
            self._forget(key)
            self._free.append(slot)
            self.counters.add(self.name, "expirations")
        return None

    def _expired(self, key: BlockKey, now: float) -> bool:
        if self.ttl_s is not None and now - self._atime.get(key, now) > self.ttl_s:
            return True
        return self.max_age_s is not None and now - self._ctime.get(key, now) > self.max_age_s

    def _forget(self, key: BlockKey) -> None:
        self._atime.pop(key, None)
        self._ctime.pop(key, None)
        self._dirty.discard(key)
        self._tenants.forget(key)

    def created_s(self, key: BlockKey) -> float:
        """When the block was first saved (as its record says), for a rewrite that keeps its age."""
        with self._lock:
            return self._ctime.get(key, self.clock())

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        now = self.clock()
        with self._lock:
            return [self._slot(k, now) is not None for k in keys]

    def _fits(self, nbytes: int) -> bool:
        """Whether blocks of ``nbytes`` fit the slots (the first one allocates the pool); under the lock."""
        if self._pool is None:
            if self.capacity_nbytes < nbytes:
                return False
            self._allocate(nbytes)
        return nbytes == self.slot_nbytes

    def _refresh(self, key: BlockKey, now: float, created_s: float | None) -> int | None:
        """The slot of a held ``key``, made recent (its age kept); None when not held (an expired one is
        freed, unless in use: then kept, same bytes). Under the lock."""
        self._slot(key, now)
        slot = self._lru.get(key)
        if slot is not None:
            self._atime[key] = now
            self._ctime.setdefault(key, now if created_s is None else created_s)
            self._recent(key)
        return slot

    def _publish(
        self, key: BlockKey, slot: int, now: float, created_s: float | None, tenant: bytes | None = None
    ) -> None:
        """A new block in ``slot``: from now on readers find it. Under the lock."""
        self._lru[key] = slot
        self._atime[key] = now
        self._ctime[key] = now if created_s is None else created_s
        if tenant is not None:
            self._tenants.add(key, tenant)

    def _ref(self, slot: int) -> None:
        self._held += self._refs[slot] == 0
        self._refs[slot] += 1

    def _unref(self, slot: int) -> None:
        assert self._refs[slot] > 0, f"slot {slot} released more often than held"
        self._refs[slot] -= 1
        self._held -= self._refs[slot] == 0
        if self._refs[slot] == 0 and slot in self._dead:
            self._dead.discard(slot)
            self._free.append(slot)

    def _remove(self, key: BlockKey) -> bool:
        """Remove ``key``'s block now; a held slot is freed on its last release. Caller holds the lock."""
        slot = self._lru.pop(key, None)
        if slot is None:
            return False
        self._forget(key)
        if self._refs[slot]:
            self._dead.add(slot)
        else:
            self._free.append(slot)
        return True

    def can_hold(self) -> bool:
        """Whether a writer may hold one more slot (see ``MAX_HELD_FRACTION``)."""
        return self.hold_room() > 0

    def hold_room(self) -> int:
        """How many more slots writers may hold now (see ``MAX_HELD_FRACTION``)."""
        with self._lock:
            if self._pool is None:
                return self.num_slots or 1 << 30
            return max(0, math.ceil(self.num_slots * MAX_HELD_FRACTION - self._held))

    def _take_slot(self, tenant: bytes | None, incoming: int = 1, populated_only: bool = False) -> int | None:
        """A free slot, else the slot of a block evicted for it (``tenant``: whose block it is for;
        ``incoming``: how many of its blocks want a slot now, this one and those taken unpublished). With
        ``populated_only``, None rather than a free slot whose pages are still to be populated (an
        evicted block's slot was written: populated)."""
        if self._free:
            if populated_only and not self._populated(self._free[-1]):
                return None
            return self._free.pop()
        # For a quota: a clean block, none in use (a block waiting for a slower tier is never lost to one)
        victim = (
            self._tenants.victim(
                tenant,
                self.slot_nbytes,
                lambda k: self._refs[self._lru[k]] == 0 and k not in self._dirty,
                incoming,
            )
            if self._tenants.quota_nbytes
            else None
        )
        if victim is None:
            for key, slot in self._lru.items():  # least recently used first, clean before dirty
                if self._refs[slot] == 0:
                    if key not in self._dirty:
                        victim = key
                        break
                    if victim is None:
                        victim = key
        if victim is None:
            return None
        slot = self._lru.pop(victim)
        self._forget(victim)
        self.counters.add(self.name, "evictions")
        return slot

    def _recent(self, key: BlockKey) -> None:
        """``key`` was just used: the most recent, in the pool's order and its tenant's. Under the lock."""
        self._lru.move_to_end(key)
        self._tenants.recent(key)

    def set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        """Tenants' quotas in this pool: ``host_nbytes`` for the host tier (a GPU pool takes none)."""
        if self.device.type != "cpu":
            return
        with self._lock:
            self._tenants.set_quotas(quotas)

    def tenant_usage(self) -> dict[bytes, dict[str, int]]:
        with self._lock:
            return {t: {f"{self.name}_nbytes": n} for t, n in self._tenants.usage(self.slot_nbytes).items()}

    def mark_dirty(self, key: BlockKey) -> bool:
        """``key``'s block waits for a slower tier: evict clean blocks first. False if it is not here."""
        with self._lock:
            if key not in self._lru:
                return False
            self._dirty.add(key)
            return True

    def hold(self, key: BlockKey) -> torch.Tensor | None:
        """The slot of ``key`` (uint8 view), referenced until ``release``, and no longer dirty (its
        writer has it); None if the block is not here (or past its TTL)."""
        with self._lock:
            slot = self._slot(key, self.clock()) if self._pool is not None else None
            if slot is None or self._pool is None:
                return None
            self._dirty.discard(key)
            self._ref(slot)
            return self._pool[slot]

    def retain(self, view: torch.Tensor) -> None:
        """One more reference to a slot already held (a second writer reads it)."""
        assert self._pool is not None
        slot = (view.data_ptr() - self._pool.data_ptr()) // self.slot_nbytes
        with self._lock:
            assert self._refs[slot] > 0, f"slot {slot} retained without being held"
            self._refs[slot] += 1

    def release(self, view: torch.Tensor) -> None:
        assert self._pool is not None
        slot = (view.data_ptr() - self._pool.data_ptr()) // self.slot_nbytes
        with self._lock:
            self._unref(slot)

    @contextlib.contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[torch.Tensor | None]]:
        """Hold the slots of ``keys`` for reading: one uint8 view per key, None where absent."""
        views: list[torch.Tensor | None] = []
        now = self.clock()
        with self._lock:
            for key in keys:
                slot = self._slot(key, now) if self._pool is not None else None
                if slot is None or self._pool is None:
                    views.append(None)
                    continue
                self._atime[key] = now
                self._recent(key)
                self._ref(slot)
                views.append(self._pool[slot])
        try:
            yield views
        finally:
            for v in views:
                if v is not None:
                    self.release(v)

    def clear(self) -> int:
        """Remove every block, held ones too (a reader or writer holding one keeps its bytes until it
        releases the slot, but nobody finds the block any more). Returns how many."""
        with self._lock:
            return sum(self._remove(key) for key in list(self._lru))

    def discard(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Remove these blocks, held ones too (as ``clear``); per key whether it was here."""
        with self._lock:
            return [self._remove(key) for key in keys]

    # ---------------------------------------------------------------- the Tier calls

    def probe(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        return self.contains([chain.keys[i] for i in idx])

    def served_above(self, chain: BlockChain, idx: Sequence[int]) -> list[int]:
        """Served from above (a faster tier, or the engine's own cache): a hit keeps them recent here."""
        now = self.clock()
        with self._lock:
            for i in idx:
                key = chain.keys[i]
                if self._pool is not None and self._slot(key, now) is not None:
                    self._atime[key] = now
                    self._recent(key)
        return []

    def read_into(self, chain: BlockChain, first: int, count: int, target: Target) -> int:
        """Slots are copied (asynchronously on a GPU) and stay held until the restore is over."""
        keys = chain.keys[first : first + count]
        views = target.hold(self.read(keys))
        n = next((j for j, v in enumerate(views) if v is None), len(views))
        if n:
            copy_out(target, views[:n], first, self.device, self.slot_nbytes)
        with self._lock:
            now = self.clock()
            target.created_s.update((first + j, self._ctime.get(keys[j], now)) for j in range(n))
        self.counters.add(self.name, "bytes_read", n * self.slot_nbytes)  # counted where it happens
        return n

    def write(self, block: BlockWrite) -> bool:
        spec = KVSpec.of(block.ns)
        kv = block.payload.view(spec.dtype).view(spec.block_shape)
        if (
            self.put(block.key, kv, created_s=block.created_s, tenant=block.ns.tenant_id, live=block.live)
            is None
        ):
            return False  # the caller keeps what ``block.release`` frees (the Tier contract)
        block.done()
        return True

    def drop(self, ns: NamespaceDigest | None) -> int:
        """A pool keeps no namespace index: a purge of any namespace clears it whole."""
        return self.clear()

    def invalidate(self, ns: NamespaceDigest, keys: Sequence[BlockKey]) -> list[bool]:
        return self.discard(keys)

    def stats(self) -> dict[str, int]:
        return {"used_nbytes": self.used_nbytes, "capacity_nbytes": self.capacity_nbytes, "blocks": len(self)}

    def describe(self) -> str:
        return f"{self.name} {format_size(self.capacity_nbytes)}"
