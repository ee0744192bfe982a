"""The tiers bench's restore runs: each a fresh store over the same segment files, cold (page cache dropped) or
warm, each run optionally beside a raw read or a memcpy measured next to it (``tiers.run`` divides by those)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tierkv import Namespace, TieredStore, native
from tierkv.bench.disk_limits import READ_THREADS, buffered_cold
from tierkv.bench.kv_workload import NS
from tierkv.bench.machine import Memcpy, drop_page_cache, warm_page_cache

__all__ = ["cold_alternated", "restores"]


def _path(path: str) -> tuple[bool, bool | None]:
    """Whether a data path is native, and whether it reads what the page cache lacks with O_DIRECT (None:
    the default, whichever this disk served faster)."""
    return path != "python", {"native": None, "native O_DIRECT reads": True}.get(path, False)


def restores(
    store_dir: Path,
    prompts: list[list[int]],
    out: torch.Tensor,
    runs: int,
    cold: bool,
    host_bytes: int = 0,
    raw: list[float] | None = None,
    path: str = "native",
    copies: tuple[Memcpy, list[float]] | None = None,
    first_run: int = 0,
    ns: Namespace = NS,
) -> tuple[list[float], str]:
    """Restores of every prompt, ``runs`` times; with ``raw``, each cold run is preceded by a raw read of
    the store's own segment files (the same bytes, the same pattern, no tierkv), appended to ``raw``; with
    ``copies``, each run by a memcpy of a prompt's KV (memory's bandwidth drifts too), appended there.
    ``first_run``: the number of the first run (where the raw read goes, before or after, alternates)."""
    bws, method = [], ""
    kv_nbytes = out.numel() * out.element_size()
    use_native, direct = _path(path)
    for r in range(first_run, first_run + runs):
        own = sorted((store_dir / "segments").glob("*.seg"))
        if raw is not None and r % 2 == 0:  # before the restore on even runs, after it on odd ones
            raw.append(buffered_cold(own, READ_THREADS))
        with (
            native.use(use_native),
            TieredStore.open(store_dir, host_bytes=host_bytes, direct_reads=direct) as store,
        ):
            if host_bytes:  # fill the host tier from disk first (a prefetch: a restore promotes only into
                for toks in prompts:  # the pages populated so far while the tier is populated behind)
                    store.prefetch(NS, toks)
            if cold:
                method = drop_page_cache(list((store_dir / "segments").glob("*.seg")))
            elif not host_bytes:
                warm_page_cache(own)  # as a recent save or a buffered read leaves it
            t0 = time.perf_counter()
            for toks in prompts:
                n, _ = store.load(ns, toks, out=out)
                assert n == len(toks), (n, len(toks))
            bws.append(len(prompts) * kv_nbytes / (time.perf_counter() - t0))
        if copies is not None:  # with the store closed: its background threads would slow the copy
            copies[1].append(copies[0].bps())
        if raw is not None and r % 2 == 1:
            raw.append(buffered_cold(own, READ_THREADS))
    return bws, method


def cold_alternated(
    store_dir: Path, prompts: list[list[int]], out: torch.Tensor, runs: int, paths: tuple[str, ...], **kw: Any
) -> tuple[dict[str, list[float]], str]:
    """Cold restores on each data path, ``runs`` each, the paths taking turns run by run (in order, then
    reversed): this disk drifts over minutes, and a path measured in a window of its own got that
    window's disk. ``kw`` (``raw``) goes to the first path's restores."""
    got: dict[str, list[float]] = {path: [] for path in paths}
    method = ""
    for r in range(runs):
        for path in paths if r % 2 == 0 else paths[::-1]:
            more = kw if path == paths[0] else {}
            bws, method = restores(store_dir, prompts, out, 1, cold=True, path=path, first_run=r, **more)
            got[path] += bws
    return got, method
