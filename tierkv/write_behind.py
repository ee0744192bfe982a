"""The write-behind: saved blocks reach the tiers without the inference thread waiting for them.

Blocks on a GPU enter that GPU's memory tier by a device copy, on the compute stream. Every other tier is
written behind: blocks leave the device through the staging ring (pinned slots, a side stream fenced on
the compute stream), whose drain thread hands each block here; CPU blocks come straight here (the
caller may reuse its buffer once ``save`` returns). Here each block is copied into the CPU memory tiers
that need it and queued for the record tiers (disk, remote) that need it, which encode it on their own
writer threads, straight from a held host slot when there is one (else from a private copy).

The ring drains into this module only; nothing here calls back into the store.

Purges and invalidations (``generations.Generations``, re-exported here): every block on its way carries
the generation it was saved in (or, written back by a restore, the one the restore began in). A purge or an invalidation starts a new
generation; a block of what it named from an older one is dropped wherever it is when it arrives: leaving
the ring, entering a memory tier, or committing to a record tier (the disk writer checks inside the
transaction that would index it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from tierkv import codec
from tierkv.generations import FENCE_WAIT_S, Generations
from tierkv.keys import BlockChain, BlockKey
from tierkv.layout import KVSpec
from tierkv.metrics import Counters
from tierkv.private_copies import PrivateCopies
from tierkv.staging import StagingRing
from tierkv.tiers.base import BlockWrite, Tier
from tierkv.tiers.pool import BlockPool

__all__ = ["FENCE_WAIT_S", "Generations", "WriteBehind"]

log = logging.getLogger("tierkv.store")


@dataclasses.dataclass(frozen=True)
class _Pending:
    """Block ``i`` of ``chain`` on its way to ``dests`` (the staging ring carries it as metadata), saved in
    generation ``gen``."""

    chain: BlockChain
    i: int
    dests: tuple[Tier, ...]
    created_s: float
    gen: int


class WriteBehind:
    def __init__(
        self,
        tiers: list[Tier],
        *,
        codec_: codec.Codec,
        clock: Callable[[], float],
        counters: Counters,
        staging: bool | None,
        staging_nbytes: int,
        staging_wait_s: float,
    ) -> None:
        """``tiers``: the store's list (fastest first), shared: a tier added later is seen here too.
        ``staging``: blocks go through the staging ring; None (default) when they are on a CUDA device,
        True also on CPU (the same code path, synchronous copies). ``staging_nbytes``: the ring's pinned
        memory, and as much again of GPU blocks waiting for a slot; past that each block waits at most
        ``staging_wait_s`` for a slot, then is dropped (counted)."""
        self.tiers = tiers
        self.codec, self.clock, self.counters = codec_, clock, counters
        self.staging, self.staging_nbytes, self.staging_wait_s = staging, staging_nbytes, staging_wait_s
        self._ring: StagingRing | None = None
        self._ring_lock = threading.Lock()
        self.gens = Generations()
        self.copies = PrivateCopies()  # the record tiers' private copies of saved blocks
        # Held from a block's liveness check to its copy into the memory tiers, and by a purge clearing
        # them: a block found live is in the tiers before the clear, or is found dead after it.
        self.gate = threading.Lock()
        # Write-back: per record tier, blocks its queue had no room for, waiting dirty in a host pool (key ->
        # the save and the pool), oldest first; ``refill`` queues them as room comes back.
        self._backlog: dict[Tier, collections.OrderedDict[BlockKey, tuple[_Pending, BlockPool]]] = {}
        self._backlog_lock = threading.Lock()

    def save(
        self,
        chain: BlockChain,
        start: int,
        blocks: Sequence[torch.Tensor],
        stacked: torch.Tensor | None = None,
        memory_only: bool = False,
    ) -> int:
        """``blocks`` are blocks ``start..`` of ``chain`` (``stacked``: the same as one contiguous tensor,
        if they are); ``memory_only``: into the memory tiers only, never a record tier. Returns how many
        were handed on to the tiers written behind."""
        if not blocks:
            return 0
        self.gens.saw(chain.ns.digest)
        device = blocks[0].device
        keys = chain.keys[start:]
        live = self.gens.liveness(chain.ns.digest)  # a purge racing this save: not published after it
        for pool in self._device_pools(device):  # device copies, on the compute stream
            if stacked is not None:
                pool.put_many(keys, stacked, tenant=chain.ns.tenant_id, live=live)
            else:
                for key, block in zip(keys, blocks):
                    pool.put(key, block, tenant=chain.ns.tenant_id, live=functools.partial(live, key))
        idx = list(range(start, start + len(blocks)))
        behind = [t for t in self.tiers if self._behind(t) and (isinstance(t, BlockPool) or not memory_only)]
        dests = self._dests(chain, idx, behind)
        return self._submit(chain, idx, lambda i: blocks[i - start], dests)

    def write_back(
        self,
        chain: BlockChain,
        wants: dict[Tier, list[int]],
        block: Callable[[int], torch.Tensor],
        created_s: dict[int, float],
    ) -> None:
        """Write blocks of ``chain`` (restored ones, ``block(i)`` their KV) to the tiers that want them.

        Each block is copied to private CPU memory before this returns, never through the staging ring: a
        restore's destination is the caller's, who may write it again as soon as ``restore`` returns (the
        ring's rule, KV nobody writes again, holds for model KV only)."""
        per_block: dict[int, list[Tier]] = {}
        for tier, idx in wants.items():
            for i in idx:
                per_block.setdefault(i, []).append(tier)
        now, gen = self.clock(), self.gens.current  # a restore's: what it read may be purged since
        for i in sorted(per_block):
            private = block(i).to("cpu", copy=True, memory_format=torch.contiguous_format)
            self._keep(
                private, _Pending(chain, i, tuple(per_block[i]), created_s.get(i, now), gen), owned=True
            )

    def _device_pools(self, device: torch.device) -> list[BlockPool]:
        """Memory tiers written by a device copy: the direct ones on the blocks' device."""
        return [t for t in self.tiers if isinstance(t, BlockPool) and t.direct and t.device == device]

    @staticmethod
    def _behind(tier: Tier) -> bool:
        """Written behind: every tier but the direct pools (a GPU pool takes only its device's blocks)."""
        return not (isinstance(tier, BlockPool) and tier.direct)

    @staticmethod
    def _dests(chain: BlockChain, idx: list[int], tiers: list[Tier]) -> list[tuple[Tier, ...]]:
        """Per block, the tiers among ``tiers`` that need it (not held, not already queued)."""
        needs = [t.needs(chain, idx) for t in tiers]
        return (
            [tuple(t for t, n in zip(tiers, col) if n) for col in zip(*needs)] if tiers else [() for _ in idx]
        )

    def _submit(
        self,
        chain: BlockChain,
        idx: list[int],
        block: Callable[[int], torch.Tensor],
        dests: list[tuple[Tier, ...]],
    ) -> int:
        todo = [(i, d) for i, d in zip(idx, dests) if d]
        if not todo:
            return 0
        now, gen = self.clock(), self.gens.current
        pending = [_Pending(chain, i, d, now, gen) for i, d in todo]
        device = block(todo[0][0]).device
        ring = self._ring_for(KVSpec.of(chain.ns), device)
        if ring is not None:
            # Model KV on a GPU is never written again: the ring may hold it while its slots are busy.
            accepted = ring.submit_many(
                [block(i) for i, _ in todo], pending, keep_reference=device.type == "cuda"
            )
            return sum(accepted)
        if device.type != "cpu":
            for (i, _), p in zip(todo, pending):
                self._keep(block(i).cpu(), p)
            return len(todo)
        # Copies made at once for the whole save, each in one native call where the blocks allow it: into
        # the CPU memory tiers (their slots), and private ones for blocks only record tiers take.
        put: dict[int, set[BlockPool]] = {}
        pools = {t for _, d in todo for t in d if isinstance(t, BlockPool) and t.device.type == "cpu"}
        # A record tier full: each block is put and marked dirty at once, in _keep (no batch put).
        for pool in () if self._writing_back(todo, chain) else pools:
            want = [(i, p) for (i, d), p in zip(todo, pending) if pool in d]
            keys = [chain.keys[i] for i, _ in want]
            live = functools.partial(self.gens.live, chain.ns.digest, gen=gen)  # _keep's, per key
            for (i, _), ok in zip(
                want,
                pool.put_blocks(
                    keys, [block(i) for i, _ in want], created_s=now, tenant=chain.ns.tenant_id, live=live
                ),
            ):
                if ok:
                    put.setdefault(i, set()).add(pool)
        # Private copies for blocks only record tiers take, and for those past the slots writers may hold
        # in a CPU pool (``MAX_HELD_FRACTION``): a guess, either way safe (a copy a held slot makes
        # unneeded goes back).
        room = min((pool.hold_room() for pool in pools), default=0)
        private = []
        for i, d in todo:
            if not any(not isinstance(t, BlockPool) for t in d):
                continue
            if room > 0 and any(t in pools for t in d):
                room -= 1
            else:
                private.append(i)
        made = dict(zip(private, self.copies.copy_many([block(i) for i in private])))
        for (i, _), p in zip(todo, pending):
            self._keep(block(i), p, copy=made.get(i), put=put.get(i, set()))
        return len(todo)

    def _ring_for(self, spec: KVSpec, device: torch.device) -> StagingRing | None:
        """The staging ring for blocks on ``device`` (made on first use), or None to copy directly."""
        if not (self.staging or (self.staging is None and device.type == "cuda")):
            return None
        with self._ring_lock:
            if self._ring is None:
                slots = max(2, self.staging_nbytes // spec.block_nbytes)
                self._ring = StagingRing(
                    slots,
                    spec.block_nbytes,
                    device=device,
                    on_ready=self._drain,
                    wait_s=self.staging_wait_s,
                    pending_nbytes=self.staging_nbytes,
                    counters=self.counters,
                )
            ring = self._ring
        if ring.device != device or ring.slots.shape[1] < spec.block_nbytes:
            return None  # another device or a larger block than the slots: the direct path
        return ring

    def _drain(self, slot: torch.Tensor, p: _Pending) -> None:
        """The staging ring's consumer (its drain thread): the slot is reused after this returns."""
        spec = KVSpec.of(p.chain.ns)
        self._keep(slot[: spec.block_nbytes].view(spec.dtype).view(spec.block_shape), p)

    def _writing_back(self, todo: list[tuple[int, tuple[Tier, ...]]], chain: BlockChain) -> bool:
        """Whether a record tier of these blocks has blocks waiting for room, or no room for them all:
        then each is put into the memory tiers and marked dirty under one hold of the gate, as it
        comes, so that a block waiting for a slower tier is never evicted as a clean one."""
        records = {t for _, d in todo for t in d if not isinstance(t, BlockPool) and t.writes_back}
        if not records:
            return False
        nbytes = len(todo) * (
            codec.HEADER_NBYTES + chain.block_token_nbytes + KVSpec.of(chain.ns).block_nbytes
        )
        with self._backlog_lock:
            return any(self._backlog.get(t) or not t.has_room(nbytes) for t in records)

    def _keep(
        self,
        block: torch.Tensor,
        p: _Pending,
        owned: bool = False,
        copy: torch.Tensor | None = None,
        put: set[BlockPool] | frozenset[BlockPool] = frozenset(),
    ) -> None:
        """Copy a CPU block into the memory tiers among ``p.dests`` and queue it for the record tiers
        (``owned``: ``block`` is a private copy nobody else writes, so the record tiers may read it as is;
        ``copy``: its private copy, made already by ``self.copies``, given back if no writer takes it;
        never after one did, not even on an error: then it is only garbage collected; ``put``: the memory
        tiers that took the block already, ``BlockPool.put_blocks``)."""
        key = p.chain.keys[p.i]
        live = functools.partial(self.gens.live, p.chain.ns.digest, key, p.gen)
        records = [t for t in p.dests if not isinstance(t, BlockPool)]
        nbytes = codec.HEADER_NBYTES + p.chain.block_token_nbytes + block.numel() * block.element_size()
        with self._backlog_lock:  # write-back: wait dirty in a pool, behind those already waiting
            full = [t for t in records if t.writes_back and (self._backlog.get(t) or not t.has_room(nbytes))]
        records = [t for t in records if t not in full]
        held: tuple[BlockPool, torch.Tensor] | None = None
        kept: BlockPool | None = None  # a CPU pool that took the block
        with self.gate:
            if not live():  # purged or invalidated since it was saved
                if copy is not None:
                    self.copies.give_back(copy)
                return
            for pool in (t for t in p.dests if isinstance(t, BlockPool)):
                hold = bool(records) and held is None and pool.can_hold()
                if pool in put:  # in its slot already: a reference for the writers, if they need it
                    slot = pool.hold(key) if hold else None
                    took = slot is not None or pool.contains([key])[0]
                else:
                    slot = pool.put(key, block, hold=hold, created_s=p.created_s, tenant=p.chain.ns.tenant_id)
                    took = slot is not None
                if took and pool.device.type == "cpu":
                    kept = kept or pool
                if hold and slot is not None:
                    held = (pool, slot)
            if full:
                self._defer(full, key, p, kept)
        if not records or held is not None:
            if copy is not None:
                self.copies.give_back(copy)  # unused: no writer, or a held slot serves them
        if not records:
            return
        # Without a held slot the writers share one private copy: the caller may reuse ``block`` at once.
        releases: list[Callable[[], None] | None]
        if held is not None:
            payload = held[1]
            for _ in records[1:]:  # one reference per writer, all taken before the first may release its own
                held[0].retain(held[1])
            releases = [functools.partial(held[0].release, held[1]) for _ in records]
        elif owned:
            payload, releases = block.view(-1).view(torch.uint8), [None] * len(records)
        else:  # recycled once every writer released it
            payload = copy if copy is not None else self.copies.copy(block)
            releases = list(self.copies.releases(payload, len(records)))
        for tier, release in zip(records, releases):
            write = self._block_write(p, payload, release, live)
            ok = tier.try_write(write) if tier.writes_back else tier.write(write)
            if not ok:
                write.done()
            if ok is None:  # the queue filled since: wait in the pool after all
                with self.gate:
                    self._defer([tier], key, p, kept)

    def _block_write(
        self,
        p: _Pending,
        payload: torch.Tensor,
        release: Callable[[], None] | None,
        live: Callable[[], bool],
    ) -> BlockWrite:
        chain = p.chain
        return BlockWrite(
            chain.ns,
            chain.keys[p.i],
            chain.parent(p.i),
            chain.tokens(p.i),
            p.created_s,
            payload,
            self.codec,
            release,
            live,
        )

    def _defer(self, tiers: list[Tier], key: BlockKey, p: _Pending, pool: BlockPool | None) -> None:
        """Record tiers whose queue is full: the block waits dirty in ``pool`` (caller holds the gate);
        without a pool that took it, it is dropped for them (counted)."""
        for tier in tiers:
            if pool is None or not pool.mark_dirty(key):
                self.counters.add(tier.name, "dropped_saves")
                continue
            with self._backlog_lock:
                if tier not in self._backlog:
                    self._backlog[tier] = collections.OrderedDict()
                    tier.on_room(functools.partial(self.refill, tier))
                self._backlog[tier][key] = (p, pool)

    def refill(self, tier: Tier) -> int:
        """Queue ``tier``'s waiting blocks while it has room (its writer thread calls this after each
        batch); a block that left its pool before it could be written is lost for the tier, and counted.
        Returns how many are still waiting."""
        while True:
            with self._backlog_lock:
                waiting = self._backlog.get(tier)
                if not waiting:
                    return 0
                key, (p, pool) = next(iter(waiting.items()))
                if not tier.has_room(codec.HEADER_NBYTES + p.chain.block_token_nbytes + pool.slot_nbytes):
                    return len(waiting)
                del waiting[key]
            live = functools.partial(self.gens.live, p.chain.ns.digest, p.chain.keys[p.i], p.gen)
            with self.gate:  # as in _keep: found live, it is held before a purge clears the pool
                if not live():
                    continue
                slot = pool.hold(key)
            if slot is None:  # evicted (or expired) before its turn
                self.counters.add(tier.name, "writeback_lost_blocks")
                continue
            write = self._block_write(p, slot, functools.partial(pool.release, slot), live)
            ok = tier.try_write(write)
            if not ok:
                write.done()
            if ok is None:  # full again (a saver came first): back to the head of the line
                with self._backlog_lock:
                    waiting = self._backlog[tier]
                    waiting[key] = (p, pool)
                    waiting.move_to_end(key, last=False)
                pool.mark_dirty(key)
                return len(waiting)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every block waiting for a write-back tier is queued there (``flush`` then waits for
        the queues). False if some still wait after ``timeout_s`` (a writer that makes no progress)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._backlog_lock:
                tiers = [t for t, w in self._backlog.items() if w]
            if not tiers:
                return True
            for tier in tiers:
                if self.refill(tier):
                    tier.flush()  # room comes back as its queue is written
            if time.monotonic() > deadline:
                return False

    def backlog_blocks(self) -> dict[str, int]:
        """Per record tier's name, the blocks waiting dirty in a host pool for room in its queue."""
        with self._backlog_lock:
            return {tier.name: len(waiting) for tier, waiting in self._backlog.items()}

    def flush(self) -> None:
        """Out of the staging ring: into the memory tiers and the record tiers' queues."""
        if self._ring is not None:
            self._ring.flush()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
        self.copies.close()
