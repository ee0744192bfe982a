"""GPU telemetry through NVML (pynvml, from the ``nvidia-ml-py`` package): memory, utilisation, PCIe.

NVML is device-wide, so ``tierkv stats`` in a shell sees the same figures as the server that uses the GPU.
Without the package, without the driver library or without a GPU, ``gpu_telemetry()`` returns an empty list:
nothing else changes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

__all__ = ["GpuSample", "free_memory_nbytes", "gpu_telemetry"]

log = logging.getLogger("tierkv.telemetry")

_lock = threading.Lock()
_nvml: Any = None  # the pynvml module once initialised; False once it failed (not retried)


@dataclasses.dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    memory_used_nbytes: int
    memory_total_nbytes: int
    memory_free_nbytes: int
    utilization_gpu_pct: int  # share of the last sample period a kernel ran
    utilization_memory_pct: int  # share of it device memory was read or written
    pcie_tx_Bps: int  # bytes/s device -> host over the last ~20 ms (NVML's own window)
    pcie_rx_Bps: int  # bytes/s host -> device


def _init() -> Any:
    global _nvml
    with _lock:
        if _nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # no package, no libnvidia-ml, no driver: telemetry is off
                log.debug("NVML unavailable: %s", exc)
                _nvml = False
        return _nvml or None


def gpu_telemetry() -> list[GpuSample]:
    """One sample per visible GPU; empty without NVML or a GPU. Never raises."""
    nvml = _init()
    if nvml is None:
        return []
    samples = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            name = nvml.nvmlDeviceGetName(h)
            samples.append(
                GpuSample(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_used_nbytes=int(mem.used),
                    memory_total_nbytes=int(mem.total),
                    memory_free_nbytes=int(mem.free),
                    utilization_gpu_pct=int(util.gpu),
                    utilization_memory_pct=int(util.memory),
                    pcie_tx_Bps=_pcie(nvml, h, nvml.NVML_PCIE_UTIL_TX_BYTES),
                    pcie_rx_Bps=_pcie(nvml, h, nvml.NVML_PCIE_UTIL_RX_BYTES),
                )
            )
    except Exception as exc:  # a GPU that fell off the bus must not take stats or /metrics down
        log.warning("NVML query failed: %s", exc)
    return samples


def _pcie(nvml: Any, handle: Any, counter: int) -> int:
    try:
        return int(nvml.nvmlDeviceGetPcieThroughput(handle, counter)) * 1024  # NVML reports KB/s
    except Exception:  # not supported on this device (some virtualised GPUs)
        return 0


def free_memory_nbytes(device_index: int) -> int | None:
    """Free memory of one GPU by NVML, None without it."""
    for s in gpu_telemetry():
        if s.index == device_index:
            return s.memory_free_nbytes
    return None
