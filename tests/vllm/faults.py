"""Faults injected into a vLLM engine process with the connector (``vllm_run.py``, spec key ``faults``).

    partial_load   probability that a restore stops at a random block (evicted or expired meanwhile)
    read_eio       probability that a read of a record (``os.preadv``, or one record of a native run) fails
                   with EIO
    write_enospc   probability that an append to a segment (``os.pwritev``, or a native write) fails with
                   ENOSPC
    purge_at_batches  at the start of these batches another process purges the whole cache directory
                   (``tierkv gc --all``), while the batch runs
    seed           the faults' random generator (the first chance of each fault always hits)

They act below the connector (the store, the file system, another process), never inside it: the
connector must turn each into a miss or a recompute, and save nothing wrong.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

counts: dict[str, int] = {"partial_load": 0, "read_eio": 0, "write_enospc": 0, "purge": 0}
_threads: list[threading.Thread] = []


def finish() -> None:
    """Wait for the purging processes started, and for the engine's store to write what it holds (the
    disk writer runs on idle cores: otherwise at shutdown, after the counts are reported)."""
    for t in _threads:
        t.join(timeout=120)
    from tierkv.integrations.vllm import options

    for entry in list(options._stores.values()):
        entry.store.flush()


def _native() -> Any:
    """The native data path's module where it runs (its reads and writes bypass ``os``)."""
    from tierkv import native

    return native.module() if native.enabled() else None


def install(faults: dict[str, Any], cache_dir: str) -> Callable[[int], None]:
    """Patch the faults in; returns the hook ``vllm_run`` calls before each batch."""
    rng = random.Random(faults.get("seed", 0))
    lock = threading.Lock()

    def draw(name: str) -> bool:
        """The first chance of each fault always hits (how many chances there are is timing's: appends
        and reads are batched), later ones with its probability."""
        p = float(faults.get(name, 0.0))
        with lock:
            hit = p > 0 and (not counts[name] or rng.random() < p)
        if hit:
            counts[name] += 1
        return hit

    if faults.get("partial_load"):
        from tierkv.store import TieredStore

        restore = TieredStore.restore

        def partial(
            self: TieredStore, ns: Any, token_ids: Any, out: Any = None, *, start_block: int = 0
        ) -> Any:
            if draw("partial_load"):  # blocks from ``keep`` on are gone by the time of the load
                from tierkv.keys import BlockChain
                from tierkv.store import Hit

                chain = token_ids if isinstance(token_ids, BlockChain) else BlockChain.of(ns, token_ids)
                keep = rng.randrange(start_block, max(start_block + 1, len(chain)))
                if keep == start_block:
                    return Hit(0, dict.fromkeys(self.tier_names, 0)), None
                token_ids = chain.prefix(keep)
            return restore(self, ns, token_ids, out, start_block=start_block)

        TieredStore.restore = partial  # type: ignore[method-assign]

    if faults.get("read_eio"):
        preadv = os.preadv

        def failing_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            if draw("read_eio"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return preadv(fd, buffers, offset, *args)

        os.preadv = failing_preadv
        nat = _native()
        if nat is not None:  # the native reader's reads: a bad sector under one record of the run
            read_run = nat.read_run

            def failing_read_run(reqs: Any, *args: Any) -> Any:
                if not len(reqs) or not draw("read_eio"):
                    return read_run(reqs, *args)
                fd, _, _, offset, nbytes, _ = (int(v) for v in reqs[rng.randrange(len(reqs))])
                st = os.fstat(fd)
                nat.inject_fault(st.st_dev, st.st_ino, offset, offset + nbytes, errno.EIO)
                try:
                    return read_run(reqs, *args)
                finally:
                    nat.clear_faults()

            nat.read_run = failing_read_run

    if faults.get("write_enospc"):
        pwritev = os.pwritev

        def full_pwritev(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            if draw("write_enospc"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return pwritev(fd, buffers, offset, *args)

        os.pwritev = full_pwritev
        nat = _native()
        if nat is not None:  # the native writer's appends
            write_run = nat.write_run

            def full_write_run(*args: Any) -> Any:
                if draw("write_enospc"):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return write_run(*args)

            nat.write_run = full_write_run

    purges = set(faults.get("purge_at_batches", ()))
    cli = [os.environ.get("TIERKV_CLI_PYTHON", sys.executable), "-m", "tierkv.cli"]

    def purge() -> None:
        r = subprocess.run(
            [*cli, "gc", "--all", "--cache-dir", cache_dir], capture_output=True, text=True, timeout=120
        )
        if r.returncode == 0:
            counts["purge"] += 1
        else:
            print(f"faults: purge failed: {r.stderr[-500:]}", file=sys.stderr)

    def before_batch(n: int) -> None:
        """Batch ``n`` starts: another process purges the directory while it runs, if asked."""
        if n in purges:
            _threads.append(threading.Thread(target=purge, name="faults-purge", daemon=True))
            _threads[-1].start()

    return before_batch
