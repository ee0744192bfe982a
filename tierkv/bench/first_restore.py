"""A fresh process's first restores: what a server's first cached requests after a restart see, run in a
process of their own (``tierkv bench --only tiers``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tierkv import TieredStore
from tierkv.bench.kv_workload import NS, prompts_of
from tierkv.bench.machine import drop_page_cache

__all__ = ["first_restore", "in_fresh_process", "raw_read_after_fresh_memory", "raw_read_in_fresh_process"]


def first_restore(
    store_dir: str, num_prompts: int, prompt_tokens: int, host_bytes: int, populate_first: int = 0
) -> float:
    """In a fresh process (``in_fresh_process``): open the store and reserve its host tier (as a server does
    at start-up), drop the page cache, restore every prompt once at once; bytes per second. What a
    server's first cached requests after a restart see. ``populate_first``: the host tier's pages are
    all populated before the page cache is dropped (the memory ``raw_read_after_fresh_memory`` reads
    beside), not behind."""
    prompts = prompts_of(num_prompts, prompt_tokens)
    out = torch.empty(NS.num_layers, 2, prompt_tokens, NS.num_kv_heads, NS.head_dim)
    out.fill_(0)  # the caller's buffer is the caller's: its pages are not what is measured
    with TieredStore.open(store_dir, host_bytes=host_bytes) as store:
        store.reserve(NS, populate_now=bool(populate_first))  # as a server does at start-up: populated behind
        # The index too: a fresh process has not mapped it yet, as after drop_caches. Its data file only:
        # closing a descriptor of lock.mdb would drop this process's LMDB locks (``DiskTier.read_ahead``).
        drop_page_cache([*Path(store_dir, "segments").glob("*.seg"), Path(store_dir, "index", "data.mdb")])
        t0 = time.perf_counter()
        for toks in prompts:
            n, _ = store.load(NS, toks, out=out)
            assert n == len(toks), (n, len(toks))
        return num_prompts * out.numel() * out.element_size() / (time.perf_counter() - t0)


def raw_read_after_fresh_memory(store_dir: str, touch_nbytes: int) -> float:
    """In a fresh process (``raw_read_in_fresh_process``): write ``touch_nbytes`` of new memory first (a
    host tier's, populated before the read: ``first_restore`` with ``populate_first``), then read the
    store's segment files as ``buffered_cold`` does, reading no record through tierkv; bytes per second.
    The first restore's baseline under the same memory: on a VM whose free memory goes back to its host (virtio-balloon free page reporting), the page cache a cold
    read fills lands on pages the host must back again once a process took the backed ones, and the
    kernel's copy out of them slows down with no tierkv read in the process (2026-12-06: 0.68-1.07
    against 0.99-1.12 GB/s, system time 0.19-0.96 against 0.20-0.21 s, 4 alternated pairs)."""
    from tierkv.bench.disk_limits import READ_THREADS, buffered_cold

    memory = torch.empty(touch_nbytes, dtype=torch.uint8)
    memory.fill_(0)
    return buffered_cold(sorted(Path(store_dir, "segments").glob("*.seg")), READ_THREADS)


def raw_read_in_fresh_process(store_dir: Path, touch_nbytes: int) -> float:
    """``raw_read_after_fresh_memory`` in a fresh process; bytes per second."""
    return _fresh("raw_read_after_fresh_memory", [store_dir, touch_nbytes])


def _fresh(fn: str, args: list[object], env: dict[str, str] | None = None) -> float:
    """This module's ``fn(*args)`` (a path, then integers) in a fresh Python process: what it printed."""
    code = (
        f"import sys; from tierkv.bench.first_restore import {fn} as f; "
        "print(f(sys.argv[1], *map(int, sys.argv[2:])))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600, env=env
    )
    if r.returncode != 0:
        raise RuntimeError(f"{fn} failed: {r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


def in_fresh_process(
    store_dir: Path,
    num_prompts: int,
    prompt_tokens: int,
    host_bytes: int,
    path: str = "native",
    populate_first: bool = False,
) -> float:
    """``first_restore`` in a fresh process on the data path ``path`` (native, python, native buffered
    reads or native O_DIRECT reads); bytes per second."""
    env = {**os.environ, "TIERKV_NATIVE": "0" if path == "python" else "1"}
    env.pop("TIERKV_DIRECT_READS", None)  # native: the default, whichever this disk served faster
    if path != "native":
        env["TIERKV_DIRECT_READS"] = "1" if path == "native O_DIRECT reads" else "0"
    args = [store_dir, num_prompts, prompt_tokens, host_bytes, int(populate_first)]
    return _fresh("first_restore", args, env)
