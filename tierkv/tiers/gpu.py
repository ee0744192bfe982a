"""The GPU tier: a preallocated pool of block slots in device memory. A hit restores by a device copy.

Its budget (``--gpu-cache``) is a size (``8GiB``), a fraction of the device's free memory (``0.2``, read
through NVML, else torch's ``mem_get_info``), ``auto`` (a tenth of the free memory) or 0. Without a CUDA
device it is always 0 (one config serves a GPU node and a CPU box). The pool is allocated once, after the
model is loaded, so the fraction sees the model's weights as used.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tierkv.metrics import Counters
from tierkv.telemetry import free_memory_nbytes
from tierkv.tiers.pool import BlockPool
from tierkv.units import parse_size

__all__ = ["AUTO_FRACTION", "GpuTier", "gpu_budget_nbytes"]

log = logging.getLogger("tierkv.gpu")

AUTO_FRACTION = 0.1


class GpuTier(BlockPool):
    direct = True  # a device copy on the compute stream, never through the staging ring

    def __init__(
        self,
        capacity_nbytes: int,
        *,
        device: torch.device | str = "cuda",
        counters: Counters | None = None,
        **pool_options: Any,
    ) -> None:
        super().__init__(capacity_nbytes, name="gpu", device=device, counters=counters, **pool_options)


def gpu_budget_nbytes(spec: str | int | float, device: torch.device | str) -> int:
    """``--gpu-cache`` in bytes for ``device``: a size, a fraction of free memory, ``auto`` or 0."""
    device = torch.device(device)
    text = str(spec).strip().lower()
    if text in ("0", "off", "none", ""):
        return 0
    if device.type != "cuda":  # one config for a GPU node and a CPU box: the GPU tier is just off here
        if text != "auto":
            log.warning("--gpu-cache %s ignored: the model runs on %s", spec, device)
        return 0
    fraction: float | None = None
    if text == "auto":
        fraction = AUTO_FRACTION
    else:
        try:
            value = float(text)
            if 0 < value < 1:
                fraction = value
        except ValueError:
            pass
    if fraction is None:
        return parse_size(text)
    index = device.index if device.index is not None else torch.cuda.current_device()
    free = free_memory_nbytes(index)
    source = "NVML"
    if free is None:
        free, _ = torch.cuda.mem_get_info(index)
        source = "torch"
    nbytes = int(free * fraction)
    log.info(
        "GPU tier budget: %.2f of %.1f GiB free (%s) = %.1f GiB",
        fraction,
        free / 2**30,
        source,
        nbytes / 2**30,
    )
    return nbytes
