"""The host-memory tier: a pool of block slots in RAM, pinned when CUDA is present (uploads are then DMA)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tierkv.metrics import Counters
from tierkv.tiers.pool import BlockPool

__all__ = ["HostTier"]


class HostTier(BlockPool):
    def __init__(
        self,
        capacity_nbytes: int,
        *,
        pin: bool | None = None,
        counters: Counters | None = None,
        ttl_s: float | None = None,
        max_age_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            capacity_nbytes,
            name="host",
            device="cpu",
            pin=torch.cuda.is_available() if pin is None else pin,
            counters=counters,
            ttl_s=ttl_s,
            max_age_s=max_age_s,
            clock=clock,
        )
