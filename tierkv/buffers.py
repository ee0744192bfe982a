"""Buffers an engine's restores and saves go through, kept between calls on CPU.

A fresh large allocation is only address space: its first touch faults a page per 4 KiB, on the request's
path (a host-tier restore of 66 MiB took 28-34 ms into fresh pages, 10-13 ms into pages touched before).
So on CPU each named buffer is kept and grown when a call needs more, and a server may reserve one at
start-up, its pages faulted in before the first request. On a GPU each call gets a fresh one (the caching
allocator reuses memory there): a restored cache may keep views of it, and the staging ring may still be
reading the last save's.
"""

from __future__ import annotations

import torch

from tierkv.tiers.prefault import populate_in_background

__all__ = ["ReusedBuffers"]


class ReusedBuffers:
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._kept: dict[str, torch.Tensor] = {}

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        grow_dim: int,
        *,
        min_len: int = 1,
        max_len: int | None = None,
    ) -> torch.Tensor:
        """A tensor of ``shape``: on CPU a view of the buffer ``name``, grown when ``shape[grow_dim]``
        exceeds it, to at least twice its length (a growing prompt reallocates rarely) and ``min_len``, at
        most ``max_len`` (what a call can need: the context) unless the call needs more."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        buf = self._kept.get(name)
        if buf is not None:
            assert (
                buf.shape[:grow_dim] + buf.shape[grow_dim + 1 :] == shape[:grow_dim] + shape[grow_dim + 1 :]
            ), f"{name} buffer: {tuple(buf.shape)} cannot serve {shape}"
        if buf is None or buf.shape[grow_dim] < shape[grow_dim]:
            grown = list(shape)
            was = buf.shape[grow_dim] if buf is not None else 0
            grown[grow_dim] = max(shape[grow_dim], 2 * was, min_len)
            if max_len is not None:
                grown[grow_dim] = max(shape[grow_dim], min(grown[grow_dim], max_len))
            self._kept.pop(name, None)
            del buf  # the old one is let go before the larger one is allocated
            buf = torch.empty(grown, dtype=self.dtype)
            self._kept[name] = buf
        return buf.narrow(grow_dim, 0, shape[grow_dim])

    def reserve(self, name: str, shape: tuple[int, ...], grow_dim: int) -> bool:
        """Allocate ``name`` for exactly ``shape`` now and fault its pages in before returning (at full
        speed: a caller about to serve); whether it did (on CPU only)."""
        if self.device.type != "cpu":
            return False
        self.get(name, shape, grow_dim, max_len=shape[grow_dim])
        # the whole kept buffer (contiguous), not the view: a narrowed view is strided
        populator = populate_in_background(self._kept[name], f"{name} buffer", paced=False)
        if populator is not None:
            populator.join()
        return True
