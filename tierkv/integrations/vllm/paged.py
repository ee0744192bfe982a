"""Copies between canonical blocks and vLLM's paged caches, natively: ``tierkv._native.copy_paged``.

A restore lands in vLLM's pages with one copy, from a memory tier's slots or from the buffer a disk read
filled, and a save gathers its blocks out of the pages in one call; both on a few threads without the GIL.
Where the native module is not built, the layout is no strided view (``PagedLayout.strides`` is None) or
a cache is not a plain contiguous CPU tensor, ``usable`` is False and the caller keeps ``PagedLayout``'s
torch copies, which stay the reference the tests compare these with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tierkv import native
from tierkv.integrations.vllm.layout import PagedLayout
from tierkv.layout import KVSpec
from tierkv.tiers.slot_copies import copy_threads
from tierkv.tiers.target import rows_scatterable

__all__ = ["PagedCaches", "PagedSink"]

_EMPTY = np.zeros(0, dtype=np.int64)
_SLABS, _SLOTS = 0, 1  # copy_paged's modes: blocks at positions of a tensor's slabs, or whole blocks


class PagedCaches:
    """Every layer's paged cache (``caches``, as vLLM registered them) under one learned ``layout``."""

    def __init__(self, layout: PagedLayout, caches: Sequence[torch.Tensor]) -> None:
        self.layout = layout
        self.caches = list(caches)
        first = self.caches[0]
        self.num_pages = first.shape[0] // layout.page.kernel_blocks
        self.page_nbytes = layout.page.numel * first.element_size()
        self.usable = (
            native.enabled()
            and layout.strides is not None
            and first.device.type == "cpu"
            and first.element_size() in (2, 4)
            and all(
                c.is_contiguous()
                and (c.shape, c.dtype, c.device) == (first.shape, first.dtype, first.device)
                and c.numel() * c.element_size() == self.num_pages * self.page_nbytes
                for c in self.caches
            )
        )
        if self.usable:
            assert layout.strides is not None
            self._pages = np.array([c.data_ptr() for c in self.caches], dtype=np.int64)
            self._strides = np.array(layout.strides, dtype=np.int64).reshape(2, 5)
        self.itemsize = first.element_size()
        self.dtype = first.dtype
        L, H, D, B = len(self.caches), layout.num_kv_heads, layout.head_dim, layout.block_tokens
        self.block_shape = (L, 2, B, H, D)
        self.block_nbytes = L * 2 * B * H * D * self.itemsize

    def _copy(
        self,
        ids: Sequence[int],
        mode: int,
        where: np.ndarray,
        rows: np.ndarray,
        row_nbytes: int,
        gather: bool,
    ) -> None:
        p = self.layout.page
        native.module().copy_paged(
            self._pages,
            self.page_nbytes,
            self.num_pages,
            self._strides,
            p.kernel_blocks,
            p.kernel_tokens,
            self.layout.num_kv_heads,
            self.layout.head_dim,
            self.itemsize,
            np.asarray(ids, dtype=np.int64),
            mode,
            where,
            rows,
            row_nbytes,
            copy_threads(),
            gather,
        )

    def put_rows(self, kv: torch.Tensor, positions: Sequence[int], ids: Sequence[int]) -> None:
        """Blocks at block ``positions`` of ``kv`` (CPU ``[layers, 2, tokens, kv_heads, head_dim]``, every
        (layer, k/v) slab contiguous) into pages ``ids``."""
        if kv.dtype != self.dtype or tuple(kv.shape[:2]) != self.block_shape[:2] or not rows_scatterable(kv):
            raise ValueError(f"kv {list(kv.shape)} of {kv.dtype} is not this cache's rows")
        self._copy(ids, _SLABS, np.asarray(positions, dtype=np.int64), *_slabs(kv), gather=False)

    def put_slots(self, slots: Sequence[torch.Tensor], ids: Sequence[int]) -> None:
        """Whole canonical blocks (memory-tier slots, ``[layers, 2, block_tokens, kv_heads, head_dim]``
        contiguous) into pages ``ids``."""
        if any(s.device.type != "cpu" or s.numel() * s.element_size() < self.block_nbytes for s in slots):
            raise ValueError("a slot is smaller than a block or not in CPU memory")
        addrs = np.array([s.data_ptr() for s in slots], dtype=np.int64)
        self._copy(ids, _SLOTS, addrs, _EMPTY, 0, gather=False)

    def gather(self, ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Pages ``ids`` into ``out`` (``[n, layers, 2, block_tokens, kv_heads, head_dim]``, contiguous), as
        ``PagedLayout.gather`` does."""
        if (
            not out.is_contiguous()
            or out.device.type != "cpu"
            or out.dtype != self.dtype
            or tuple(out.shape) != (len(ids), *self.block_shape)
        ):
            raise ValueError(
                f"out must be [{len(ids)}, {', '.join(map(str, self.block_shape))}] of {self.dtype}"
            )
        where = out.data_ptr() + self.block_nbytes * np.arange(len(ids), dtype=np.int64)
        self._copy(ids, _SLOTS, where, _EMPTY, 0, gather=True)
        return out


def _slabs(kv: torch.Tensor) -> tuple[np.ndarray, int]:
    rows = [kv[layer, k] for layer in range(kv.shape[0]) for k in (0, 1)]
    return np.array([r.data_ptr() for r in rows], dtype=np.int64), rows[0].numel() * rows[0].element_size()


class PagedSink:
    """One load's destination (a ``tiers.target.Sink``): blocks ``first..`` of the prompt land in vLLM's
    pages ``ids``, as the store restores them."""

    def __init__(self, caches: PagedCaches, spec: KVSpec, first: int, ids: Sequence[int]) -> None:
        self.caches = caches
        self.spec = spec
        self.first = first
        self.ids = list(ids)
        self.num_blocks = first + len(self.ids)

    def _pages(self, blocks: Sequence[int]) -> list[int]:
        if any(i < self.first for i in blocks):  # the store never restores blocks below start_block
            raise ValueError(f"block {min(blocks)} is before this load's first block {self.first}")
        return [self.ids[i - self.first] for i in blocks]

    def put_rows(self, kv: torch.Tensor, positions: Sequence[int], blocks: Sequence[int]) -> None:
        self.caches.put_rows(kv, positions, self._pages(blocks))

    def put_slots(self, slots: Sequence[torch.Tensor], blocks: Sequence[int]) -> None:
        self.caches.put_slots(slots, self._pages(blocks))

    def block(self, i: int) -> torch.Tensor:
        out = torch.empty((1, *self.spec.block_shape), dtype=self.spec.dtype)
        return self.caches.gather(self._pages([i]), out)[0]
