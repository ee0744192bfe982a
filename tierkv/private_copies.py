"""Private copies of saved blocks for the record tiers, recycled (``PrivateCopies``).

A block saved from CPU memory that no CPU memory tier holds (a store without a host tier, or a pool with
no slot to spare) is copied before ``save`` returns, since the caller may reuse its buffer at once, and
the disk writer encodes from that copy later. A fresh allocation of a few hundred KiB faults in every page
it touches: on the 2-core development VM, saving 512 MiB copied at 1.5 to 3.4 GB/s into fresh pages
against about 10 GB/s into pages already faulted in, and those faults took the writer's CPU (a durable
save of 512 MiB: 0.28 to 0.35 s with warm buffers, 0.42 to 0.50 s without, same run). So the copies the
writers are done with are kept for the next saves, up to a bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["KEEP_NBYTES", "PrivateCopies"]

KEEP_NBYTES = 256 << 20  # free copies kept for reuse, all sizes together; past it they are freed


class PrivateCopies:
    """Contiguous byte buffers, one per block copy; each is reused once every writer it was handed to has
    released it (the ``BlockWrite.release`` contract: after release nobody reads the payload)."""

    def __init__(self, keep_nbytes: int = KEEP_NBYTES) -> None:
        self.keep_nbytes = keep_nbytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_nbytes = 0
        self._lock = threading.Lock()

    @property
    def free_nbytes(self) -> int:
        with self._lock:
            return self._free_nbytes

    def copy(self, block: torch.Tensor, users: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """A private copy of CPU ``block``'s bytes (flat ``uint8``), and the release each of its ``users``
        calls once when done with it."""
        nbytes = block.numel() * block.element_size()
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_nbytes -= nbytes
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        buf.view(block.dtype).view(block.shape).copy_(block)
        left = [users]

        def release() -> None:
            with self._lock:
                left[0] -= 1
                if left[0] == 0 and self._free_nbytes + nbytes <= self.keep_nbytes:
                    self._free.setdefault(nbytes, []).append(buf)
                    self._free_nbytes += nbytes

        return buf, release

    def clear(self) -> None:
        """Free what is kept (copies still with a writer are kept on release as before)."""
        with self._lock:
            self._free.clear()
            self._free_nbytes = 0
