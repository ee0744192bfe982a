"""What a benchmark ran on, and how it makes the page cache cold."""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tierkv.units import format_size


def describe(path: str | Path = ".") -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.+)", text)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    disk = "?"
    try:
        dev = os.stat(path).st_dev
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            parts = line.split()
            major, minor = map(int, parts[2].split(":"))
            if os.makedev(major, minor) == dev:
                sep = parts.index("-")
                disk = f"{parts[sep + 2]} ({parts[sep + 1]}) at {parts[4]}"
                break
    except (OSError, ValueError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "disk": disk,
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "memory_reclaim": memory_reclaim(),
    }


def memory_reclaim(sys_root: Path = Path("/sys")) -> list[str]:
    """What takes memory from this machine behind a benchmark's back, as read from sysfs: a virtual
    machine that hands its free pages to its host (virtio-balloon free page reporting: memory used
    again must be backed again, which slows the next fresh allocation or page-cache fill) and DAMON
    schemes that page out memory left idle (page cache dropped that a "warm" row expected)."""
    found: list[str] = []
    for dev in sorted(sys_root.glob("bus/virtio/devices/*")):
        try:
            balloon = int((dev / "device").read_text().strip(), 16) == 5
            features = (dev / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if balloon and len(features) > 5 and features[5] == "1":  # VIRTIO_BALLOON_F_REPORTING
            found.append("free pages reported to the hypervisor (virtio-balloon)")
    for ctx in sorted(sys_root.glob("kernel/mm/damon/admin/kdamonds/*/contexts/*")):
        try:
            if (ctx.parents[1] / "state").read_text().strip() != "on":
                continue
            aggr_us = int((ctx / "monitoring_attrs/intervals/aggr_us").read_text())
            for scheme in sorted(ctx.glob("schemes/*/")):
                if (scheme / "action").read_text().strip() != "pageout":
                    continue
                age = int((scheme / "access_pattern/age/min").read_text())
                anon_spared = any(
                    (f / "type").read_text().strip() == "anon" and (f / "allow").read_text().strip() == "N"
                    for f in scheme.glob("ops_filters/*/")
                )
                what = "page cache" if anon_spared else "memory"
                found.append(f"{what} idle {age * aggr_us / 1e6:.0f} s paged out (DAMON)")
        except (OSError, ValueError):
            continue
    return found


def tag(desc: dict[str, Any]) -> str:
    """A short folder name for results: ``cpu-2c`` or ``h200-16c``."""
    if desc.get("gpu"):
        name = re.sub(r"[^a-z0-9]+", "-", desc["gpu"].lower().replace("nvidia", "")).strip("-")
    else:
        name = "cpu"
    return f"{name}-{desc['cores']}c"


def _not_lmdb_locks(paths: list[Path]) -> list[Path]:
    """``paths`` but LMDB's lock files: closing any descriptor of a file drops every fcntl lock this process
    holds on it, and a store open in this process keeps its reader table's there (its pages matter to no
    benchmark)."""
    return [p for p in paths if p.name != "lock.mdb"]


def drop_page_cache(paths: list[Path]) -> str:
    """Make ``paths`` cold: each file synced and dropped from the page cache (``fadvise(DONTNEED)``).
    Returns the method, with how much stayed cached (pages mapped by a process: drop_caches leaves those
    too) or that this could not be told.

    Only these files: dropping the machine's whole page cache (drop_caches, which this did when root
    until 2026-12-05) also evicts the benchmark's own code (torch's libraries), and a fresh process's first
    restore then paid about 20 ms reading it back from the disk, charged to the restore (`target[0, 0]`,
    a first indexing in the process, took 22 ms after drop_caches and 0.2 ms after dropping the store's
    files). A server restarted on a warm machine has its code in memory and its cache files on disk."""
    left: int | None = 0
    for p in _not_lmdb_locks(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            resident = _resident_nbytes(fd)
            left = None if left is None or resident is None else left + resident
        finally:
            os.close(fd)
    method = "fadvise(DONTNEED) of the files read"
    if left is None:
        return f"{method} (what stayed cached unknown: no mincore)"
    return method if left == 0 else f"{method} ({format_size(left)} mapped stayed cached)"


def warm_page_cache(paths: list[Path]) -> None:
    """Read ``paths`` into the page cache (the native reader reads what the cache lacks with O_DIRECT,
    which does not fill it: a warm run's page cache is filled here)."""
    for p in _not_lmdb_locks(paths):
        with open(p, "rb") as fh:
            while fh.read(8 << 20):
                pass


def _resident_nbytes(fd: int) -> int | None:
    """How much of the open file ``fd`` the page cache holds (mincore over a read-only map of it, which
    reads nothing); None where that cannot be told."""
    import ctypes
    import mmap

    import numpy as np

    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
        m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError, AttributeError):
        return None
    page = mmap.PAGESIZE
    vec = np.zeros((size + page - 1) // page, dtype=np.uint8)
    try:
        view = np.frombuffer(m, dtype=np.uint8)
        try:
            rc = mincore(
                ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec.ctypes.data_as(ctypes.c_void_p)
            )
        finally:
            del view  # the map's buffer export, before it closes
        return None if rc != 0 else int(np.count_nonzero(vec & 1)) * page
    finally:
        m.close()


class Memcpy:
    """torch ``copy_`` of ``nbytes`` into a preallocated tensor: the benchmarks' memcpy baseline. The
    source is written first: a never-written buffer reads the kernel's one shared zero page, from the
    CPU's cache, and copied 1.4-1.6x faster here than memory does (22-25 against 15.5 GB/s)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # the destination's pages faulted in, untimed

    def bps(self) -> float:
        """Bytes per second of one copy."""
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return self.nbytes / (time.perf_counter() - t0)


def memcpy_bps(nbytes: int, runs: int = 5) -> float:
    """The median of ``runs`` copies of ``nbytes`` (``Memcpy``), after one untimed copy."""
    m = Memcpy(nbytes)
    return statistics.median(m.bps() for _ in range(runs))


def summary(xs: list[float]) -> dict[str, float]:
    """Median and spread of repeated measurements."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


__all__ = ["Memcpy", "describe", "drop_page_cache", "memcpy_bps", "summary", "tag"]
