"""Where a CPU engine's caches keep their keys and values: one buffer, faulted in at start-up, lent to one
cache at a time.

A cache's layers (``adapters``' ``AppendLayer``) copy a restored prefix into storage of their own on the
first forward after the restore, with room for the tokens to come. Into fresh memory that copy faults a
page per 4 KiB, and on this project's VM the host must back each such page again: SmolLM2's first
request after a restart (2,864 tokens restored, 126 MiB) spent 190-250 ms of its forward in it, against
19-27 ms into memory touched before (2026-12-06). So an engine reserves one buffer
``[layers, 2, kv_heads, tokens, head_dim]`` at start-up (``reserve``, pages faulted in), and each new
cache may take it (``lease``) for its layers, one layer's keys and values each.

A cache takes the buffer only while no tensor of an earlier cache still views it: the buffer's storage
counts its holders (``torch._C._storage_Use_Count``), and a cache that is kept (a caller's ``prefill``
result, a cache still decoding) holds its views. Reuse can then never change the KV another cache sees.
Where that count is not available (another PyTorch), the buffer is never lent and every cache allocates as
before. What the count cannot see: another process (a cache's tensor moved to shared memory, or sent
through ``torch.multiprocessing``, takes the whole buffer with it) and native code that keeps a raw
address without a tensor; and a cache's tensors deep-copied, pickled or saved carry the whole buffer,
other requests' bytes included (a deep-copied cache itself allocates its own storage). The engine does none of these.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from tierkv.tiers.prefault import populate_in_background

if TYPE_CHECKING:
    from tierkv.adapters import CacheLayout

__all__ = ["CacheStorage", "Lease"]


def _holders(t: torch.Tensor) -> int | None:
    """Holders of ``t``'s storage, this call's own included: tensors and storage objects (counted by the
    storage), and references to its Python storage object (a caller's ``untyped_storage()`` is handed out
    again, not made anew: the storage counts it once however many hold it). None where this PyTorch
    cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = t.untyped_storage()
    return int(count(storage._cdata)) + sys.getrefcount(storage)


class CacheStorage:
    """One kept buffer ``[layers, 2, kv_heads, tokens, head_dim]`` (CPU), lent to one cache at a time."""

    def __init__(self, dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.dtype = dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self._buf: torch.Tensor | None = None
        self._free_count: int | None = None  # the storage's holders when no cache views it
        self._owner: weakref.ref[Lease] | None = None  # the lease that took it last
        self._lock = threading.Lock()

    @classmethod
    def of(cls, layout: CacheLayout, dtype: torch.dtype) -> CacheStorage:
        """For a model of this layout and dtype (none reserved yet)."""
        return cls(dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)

    @property
    def tokens(self) -> int:
        """The tokens each layer's keys and values hold in the kept buffer (0: none kept)."""
        return 0 if self._buf is None else self._buf.shape[3]

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def reserve(self, tokens: int) -> bool:
        """Allocate the buffer for ``tokens`` (rounded up to 64: every slot starts 64-byte aligned, as a
        fresh tensor does) and fault its pages in now (a server about to serve); False, nothing kept,
        where it cannot be lent safely (see the module) or ``tokens`` is not positive. An earlier buffer
        goes once its last cache lets go of it."""
        if tokens <= 0 or _holders(torch.empty(0)) is None:
            return False
        tokens = -(-tokens // 64) * 64
        with torch.inference_mode(False):  # a normal tensor: written in inference mode and outside it
            buf = torch.empty(
                (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim), dtype=self.dtype
            )
        populator = populate_in_background(buf, "cache storage", paced=False)
        if populator is not None:
            populator.join()
        free = _holders(buf)
        with self._lock:
            self._buf, self._free_count, self._owner = buf, free, None
        return True

    def lease(self) -> Lease:
        """A new cache's claim on the buffer, taken by its layers as they first need storage."""
        return Lease(self)

    def _take(
        self, lease: Lease, slot: int, tokens: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer slot ``slot``'s keys and values ``[1, kv_heads, capacity, head_dim]`` for ``lease``, with
        room for ``tokens`` like ``keys`` and ``values`` (heads, head size, dtype); None where the buffer
        cannot serve: none kept, too small, another shape, or still viewed by another cache."""
        with self._lock:
            buf = self._buf
            if (
                buf is None
                or slot >= self.num_layers
                or tokens > buf.shape[3]
                or any(
                    t.dtype != buf.dtype
                    or t.device != buf.device
                    or t.shape[1] != buf.shape[2]
                    or t.shape[3] != buf.shape[4]
                    for t in (keys, values)
                )
            ):
                return None
            if torch.is_inference(buf) and not torch.is_inference_mode_enabled():
                return None  # not writable here
            owner = self._owner() if self._owner is not None else None
            if owner is not lease:
                # Taken only when no earlier cache views it; from then on this lease's, until another takes it.
                if _holders(buf) != self._free_count:
                    return None
                self._owner = weakref.ref(lease)
            # the views are made under the lock: from here the storage counts them
            return buf[slot, 0].unsqueeze(0), buf[slot, 1].unsqueeze(0)


class Lease:
    """One cache's claim on a ``CacheStorage``: each of its layers takes one slot, once."""

    def __init__(self, storage: CacheStorage) -> None:
        self._storage = storage
        self._next_slot = 0
        self._lock = threading.Lock()

    def take(
        self, tokens: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values for a layer of this cache with room for ``tokens`` like ``keys`` and ``values``
        (``[1, kv_heads, tokens, head_dim]``); None: the layer allocates its own. Each call takes the next
        slot: a slot is never handed out twice, so no layer's views alias another's."""
        with self._lock:
            slot = self._next_slot
            self._next_slot += 1
        return self._storage._take(self, slot, tokens, keys, values)

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        return None  # a copied cache allocates its own storage
