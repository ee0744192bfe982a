"""How blocks are copied into a ``BlockPool``'s slots (``BlockPool`` inherits these): one block
(``put``), a stack of device blocks (``put_many``), a restored run promoted from a KV tensor's slabs
(``put_run``) and a save's blocks (``put_blocks``). The runs are gathered natively under the pool's lock
in sub-runs of at most ``PUT_RUN_NBYTES``; a key is published only once its slot is written, and never
one that ``live`` says was purged (checked under the lock a purge clears the pool with).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from tierkv import native
from tierkv.keys import BlockKey
from tierkv.metrics import Counters
from tierkv.tiers.slot_copies import gather_blocks, gather_run, gatherable, index_tensor, slabs
from tierkv.tiers.target import rows_scatterable

__all__ = ["PUT_RUN_NBYTES", "PoolPuts"]

# A promotion of a run copies at most this much per hold of the pool's lock (a few ms): blocking reads,
# lookups and saves never wait behind a whole restore.
PUT_RUN_NBYTES = 32 << 20


class PoolPuts:
    # ``BlockPool``'s state and slot bookkeeping, used here
    name: str
    device: torch.device
    counters: Counters
    clock: Callable[[], float]
    _pool: torch.Tensor | None
    _lock: threading.Lock
    _lru: OrderedDict[BlockKey, int]
    _refs: list[int]
    _free: list[int]

    def _fits(self, nbytes: int) -> bool:
        raise NotImplementedError

    def _slot(self, key: BlockKey, now: float) -> int | None:
        raise NotImplementedError

    def _refresh(self, key: BlockKey, now: float, created_s: float | None) -> int | None:
        raise NotImplementedError

    def _take_slot(self, tenant: bytes | None, incoming: int = 1, populated_only: bool = False) -> int | None:
        raise NotImplementedError

    def _publish(
        self, key: BlockKey, slot: int, now: float, created_s: float | None, tenant: bytes | None
    ) -> None:
        raise NotImplementedError

    def _ref(self, slot: int) -> None:
        raise NotImplementedError

    def _unref(self, slot: int) -> None:
        raise NotImplementedError

    def _forget(self, key: BlockKey) -> None:
        raise NotImplementedError

    def put(
        self,
        key: BlockKey,
        block: torch.Tensor,
        *,
        hold: bool = False,
        created_s: float | None = None,
        wait: bool = True,
        tenant: bytes | None = None,
        live: Callable[[], bool] | None = None,
        populated_only: bool = False,
    ) -> torch.Tensor | None:
        """Copy ``block`` into a slot; returns the slot's bytes (referenced if ``hold``), None if it cannot
        (``populated_only``: nor into a free slot whose pages are not populated yet, see ``prefault``).

        None when the tier is off, the block is of another size than the slots, or every slot is in use;
        without ``wait``, also when another thread holds the pool (a reading thread promoting a block
        must not stall its reads behind a large save); and when ``live()`` is False as it would be
        published (purged meanwhile: checked under the lock a purge clears the pool with).
        """
        nbytes = block.numel() * block.element_size()
        if live is not None and not live():  # purged already: no slot, no copy
            return None
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            if not self._fits(nbytes):
                return None
            assert self._pool is not None
            now = self.clock()
            slot = self._refresh(key, now, created_s)
            if slot is not None:
                if hold:
                    self._ref(slot)
                return self._pool[slot]
            slot = self._take_slot(tenant, populated_only=populated_only)
            if slot is None:
                return None
            self._ref(slot)  # claimed: neither free nor published, so no one else takes, finds or evicts it
        finally:
            self._lock.release()
        # Copied outside the lock: a 2 MiB block into pages not yet faulted in takes a millisecond or more,
        # and the disk writer releasing the slots it wrote (or a reader) must not wait behind it. Published
        # only once complete, so no reader sees a half-written slot. On a GPU the copy is queued on the
        # caller's stream, which is the stream that later reads the slot (stream order keeps it
        # consistent); a host slot is complete when put returns (the disk writer reads it from another
        # thread).
        try:
            self._pool[slot].view(block.dtype).view(block.shape).copy_(
                block, non_blocking=self.device.type == "cuda"
            )
        except BaseException:
            with self._lock:
                self._unclaim(slot)
            raise
        with self._lock:
            refused = live is not None and not live()
            if refused or self._slot(key, now) is not None:  # purged, or put by another thread meanwhile
                self._settle_copy()
                self._unclaim(slot)
                if refused:
                    return None
                slot = self._lru[key]
                if hold:
                    self._ref(slot)
                return self._pool[slot]
            self._publish(key, slot, now, created_s, tenant)
            self.counters.add(self.name, "blocks_written")
            self.counters.add(self.name, "bytes_written", nbytes)
            if not hold:
                self._unref(slot)
            return self._pool[slot]

    def _settle_copy(self) -> None:
        """Before a slot with a copy queued into it goes back: on a GPU the copy runs on the caller's
        stream, and the next taker may write the slot from another (rare: a purge or a duplicate put)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _unclaim(self, slot: int) -> None:
        """Give back a slot ``put`` claimed but did not publish. Under the lock."""
        self._unref(slot)
        if self._refs[slot] == 0 and slot not in self._free:
            self._free.append(slot)

    def put_many(
        self,
        keys: Sequence[BlockKey],
        blocks: torch.Tensor,
        tenant: bytes | None = None,
        live: Callable[[BlockKey], bool] | None = None,
    ) -> int:
        """``put`` for a contiguous stack of blocks ``[N, ...]``: the new ones land in one indexed copy (one
        kernel on a GPU) instead of one copy each. Returns how many were new; stops when no slot is free.
        A key ``live(key)`` says was purged is skipped (checked under the lock, as in ``put``)."""
        n_blocks = blocks.shape[0]
        nbytes = blocks[0].numel() * blocks.element_size() if n_blocks else 0
        with self._lock:
            if not n_blocks:
                return 0
            if not self._fits(nbytes):
                return 0
            picked, slots = [], []
            now = self.clock()
            for j, key in enumerate(keys):
                if live is not None and not live(key):
                    continue
                if self._refresh(key, now, None) is not None:
                    continue
                slot = self._take_slot(tenant)
                if slot is None:
                    break
                self._ref(slot)  # until copied: a later block of this batch must not evict this one
                self._publish(key, slot, now, None, tenant)
                picked.append(j)
                slots.append(slot)
            if not slots:
                return 0
            assert self._pool is not None
            rows = blocks.reshape(n_blocks, -1).view(torch.uint8)
            if len(picked) < n_blocks:
                rows = rows.index_select(0, index_tensor(picked, rows.device))
            self._pool.index_copy_(0, index_tensor(slots, self.device), rows)
            for slot in slots:
                self._unref(slot)
            self.counters.add(self.name, "blocks_written", len(slots))
            self.counters.add(self.name, "bytes_written", len(slots) * nbytes)
            return len(slots)

    def put_run(
        self,
        keys: Sequence[BlockKey],
        buf: torch.Tensor,
        positions: Sequence[int],
        block_tokens: int,
        created_s: Sequence[float | None],
        *,
        wait: bool = True,
        tenant: bytes | None = None,
        live: Callable[[BlockKey], bool] | None = None,
        populated_only: bool = False,
    ) -> list[bool]:
        """``put`` of blocks ``positions`` of ``buf`` (a KV tensor ``[layers, 2, tokens, ...]``): for each key,
        whether the tier holds it now. From a CPU tensor whose slabs are contiguous, the new blocks are
        gathered into their slots natively, a sub-run of at most ``PUT_RUN_NBYTES`` per hold of the lock
        (the GIL released), and a key is published only once its slot is written; else, and as the
        reference, one ``put`` each. A position outside ``buf`` is not held, nor a key ``live(key)`` says
        was purged (checked under the lock, as in ``put``)."""
        B = block_tokens
        if not (self.device.type == "cpu" and rows_scatterable(buf) and native.enabled() and keys):
            return [
                self.put(
                    k,
                    buf[:, :, p * B : (p + 1) * B],
                    created_s=c,
                    wait=wait,
                    tenant=tenant,
                    live=None if live is None else functools.partial(live, k),
                    populated_only=populated_only,
                )
                is not None
                if 0 <= p < buf.shape[2] // B
                else False
                for k, p, c in zip(keys, positions, created_s)
            ]
        L, _, T, H, D = buf.shape
        nbytes = L * 2 * B * H * D * buf.element_size()
        where = slabs(buf)
        todo = [j for j, p in enumerate(positions) if 0 <= p < T // B]

        def copy(slots: list[int], pos: list[int]) -> None:
            assert self._pool is not None
            gather_run(where, nbytes, [self._pool[slot].data_ptr() for slot in slots], pos)

        return self._put_parts(
            keys, todo, positions, copy, created_s, nbytes, wait, tenant, live, populated_only
        )

    def put_blocks(
        self,
        keys: Sequence[BlockKey],
        blocks: Sequence[torch.Tensor],
        *,
        created_s: float | None = None,
        tenant: bytes | None = None,
        live: Callable[[BlockKey], bool] | None = None,
    ) -> list[bool]:
        """``put`` of each block (a save's, on the CPU): for each key, whether the tier holds it now. Views
        of one tensor are gathered into their slots natively (``gather_blocks``), a sub-run of at most
        ``PUT_RUN_NBYTES`` per hold of the lock, each key published once its slot is written; else, and
        as the reference, one ``put`` each."""
        nbytes = blocks[0].numel() * blocks[0].element_size() if blocks else 0
        # Only what one native call copies is copied under the lock (put copies outside it).
        if not (self.device.type == "cpu" and gatherable(blocks) is not None):
            return [
                self.put(
                    k,
                    b,
                    created_s=created_s,
                    tenant=tenant,
                    live=None if live is None else functools.partial(live, k),
                )
                is not None
                for k, b in zip(keys, blocks)
            ]

        def copy(slots: list[int], idx: list[int]) -> None:
            assert self._pool is not None
            if not gather_blocks([blocks[i] for i in idx], [self._pool[slot].data_ptr() for slot in slots]):
                raise RuntimeError("put_blocks: blocks that gatherable accepted were refused")

        created = [created_s] * len(keys)
        return self._put_parts(
            keys, range(len(keys)), range(len(keys)), copy, created, nbytes, True, tenant, live
        )

    def _put_parts(
        self,
        keys: Sequence[BlockKey],
        todo: Sequence[int],
        positions: Sequence[int],
        copy: Callable[[list[int], list[int]], None],
        created_s: Sequence[float | None],
        nbytes: int,
        wait: bool,
        tenant: bytes | None,
        live: Callable[[BlockKey], bool] | None,
        populated_only: bool = False,
    ) -> list[bool]:
        """Keys ``todo`` (indices) in sub-runs of at most ``PUT_RUN_NBYTES``; ``copy(slots, positions)``
        writes their blocks into the slots taken for them."""
        held = [False] * len(keys)
        step = max(1, PUT_RUN_NBYTES // nbytes)
        for at in range(0, len(todo), step):
            part = list(todo[at : at + step])
            got = self._put_sub(
                [keys[j] for j in part],
                copy,
                [positions[j] for j in part],
                [created_s[j] for j in part],
                nbytes,
                wait,
                tenant,
                live,
                populated_only,
            )
            for j, g in zip(part, got):
                held[j] = g
        return held

    def _put_sub(
        self,
        keys: Sequence[BlockKey],
        copy: Callable[[list[int], list[int]], None],
        positions: Sequence[int],
        created_s: Sequence[float | None],
        nbytes: int,
        wait: bool,
        tenant: bytes | None,
        live: Callable[[BlockKey], bool] | None,
        populated_only: bool = False,
    ) -> list[bool]:
        if not self._lock.acquire(blocking=wait):
            return [False] * len(keys)
        try:
            if not self._fits(nbytes):
                return [False] * len(keys)
            assert self._pool is not None
            now = self.clock()
            held: list[bool] = []
            new: dict[BlockKey, tuple[int, int, float | None]] = {}  # key -> (slot, position, created)
            try:
                for key, pos, created in zip(keys, positions, created_s):
                    if live is not None and not live(key):  # purged since it was read: not brought back
                        held.append(False)
                        continue
                    slot = self._refresh(key, now, created)  # held already: recent again, not rewritten
                    if slot is None and key not in new:  # taken slots are in neither LRU nor free list
                        # the run's unpublished count too
                        slot = self._take_slot(tenant, 1 + len(new), populated_only)
                        if slot is not None:
                            new[key] = (slot, pos, created)
                    held.append(slot is not None or key in new)
                if new:
                    copy([slot for slot, _, _ in new.values()], [pos for _, pos, _ in new.values()])
            except BaseException:  # nothing published: the taken slots go back, the keys stay unknown
                for key, (slot, _, _) in new.items():
                    self._forget(key)
                    self._free.append(slot)
                raise
            for key, (slot, _, created) in new.items():  # written: now a reader may find them
                self._publish(key, slot, now, created, tenant)
            self.counters.add(self.name, "blocks_written", len(new))
            self.counters.add(self.name, "bytes_written", len(new) * nbytes)
            return held
        finally:
            self._lock.release()
