"""Moving a cache: ``tierkv export`` and ``tierkv import`` against the store's own read and write speeds,
measured in one run on the same data.

Rows (GB/s of KV, medians of ``runs`` with their spread; the store's rows alternate with the archive's so
that the disk's drift favours neither):
  durable save        TieredStore save + flush into an empty store (the store's own write speed)
  cold restore        TieredStore.load of every prompt, page cache dropped (the store's own read speed)
  copy                the store's segment files read cold and written to one file, synced, by the kernel
                      (sendfile, as cp does), without tierkv: an export reads and writes one disk too
  export              every record read cold, verified and written to an archive file, synced
  import              the archive read cold, every record verified, written durably into an empty store
Ratios: export / cold restore, export / copy (cp), import / durable save, and the archive's size against
the store's live bytes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tierkv import TieredStore
from tierkv.archive.export import archive_chunks, select
from tierkv.archive.load import import_archive
from tierkv.archive.streams import archive_file
from tierkv.bench.kv_workload import NS, workload
from tierkv.bench.machine import drop_page_cache, summary
from tierkv.bench.table import md_table
from tierkv.tiers.disk import DiskTier

__all__ = ["markdown", "run"]


def _export(store_dir: Path, archive: Path) -> int:
    """What ``tierkv export --cache-dir STORE ARCHIVE`` does, timed in process."""
    with DiskTier(store_dir, writer=False) as disk, archive_file(str(archive)) as out:
        chunks = archive_chunks(disk, select(disk))
        try:
            while True:
                out.write(next(chunks))
        except StopIteration as stop:
            report = stop.value
    assert report.corrupt == 0 and report.vanished == 0
    return int(report.blocks)


def _raw_copy(files: list[Path], dest: Path) -> None:
    """The kernel's own copy of the same bytes, no tierkv (as ``cp`` does it: sendfile): the store's
    segment files read cold and written to one new file, synced. An export reads and writes one disk too."""
    with open(dest, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                size, at = os.fstat(src.fileno()).st_size, 0
                while at < size:
                    at += os.sendfile(out.fileno(), src.fileno(), at, size - at)
        os.fsync(out.fileno())


def run(base: Path, *, total_nbytes: int = 512 << 20, runs: int = 3) -> dict[str, Any]:
    prompts, kv = workload(total_nbytes)
    num_prompts, prompt_tokens = len(prompts), len(prompts[0])
    data_nbytes = num_prompts * kv.numel() * 4
    blocks = num_prompts * prompt_tokens // NS.block_tokens
    store_dir, archive, dest = base / "store", base / "cache.tkv", base / "imported"
    out = torch.empty_like(kv)
    times: dict[str, list[float]] = {k: [] for k in ("save", "restore", "copy", "export", "import")}
    method = ""
    archive_nbytes = live_nbytes = 0
    for r in range(runs):
        shutil.rmtree(store_dir, ignore_errors=True)
        with TieredStore.open(store_dir, host_bytes=0) as store:
            t0 = time.perf_counter()
            for toks in prompts:
                store.save(NS, toks, kv)
            assert store.flush() == 0
            times["save"].append(time.perf_counter() - t0)
            live_nbytes = store.stats()["disk"]["used_nbytes"]

        def restore() -> None:
            nonlocal method
            with TieredStore.open(store_dir, host_bytes=0) as store:
                method = drop_page_cache(sorted((store_dir / "segments").glob("*.seg")))
                t0 = time.perf_counter()
                for toks in prompts:
                    assert store.load(NS, toks, out=out)[0] == len(toks)
                times["restore"].append(time.perf_counter() - t0)

        def export() -> None:
            drop_page_cache(
                [*sorted((store_dir / "segments").glob("*.seg")), *(store_dir / "index").glob("*.mdb")]
            )
            t0 = time.perf_counter()
            assert _export(store_dir, archive) == blocks
            times["export"].append(time.perf_counter() - t0)

        def copy() -> None:
            files = sorted((store_dir / "segments").glob("*.seg"))
            drop_page_cache(files)
            t0 = time.perf_counter()
            _raw_copy(files, base / "copy.bin")
            times["copy"].append(time.perf_counter() - t0)
            (base / "copy.bin").unlink()

        for step in (restore, copy, export) if r % 2 == 0 else (export, copy, restore):
            step()
        archive_nbytes = archive.stat().st_size
        shutil.rmtree(dest, ignore_errors=True)
        drop_page_cache([archive])
        t0 = time.perf_counter()
        with DiskTier(dest) as disk, open(archive, "rb") as src:
            got = import_archive(disk, src)
        times["import"].append(time.perf_counter() - t0)
        assert got.imported == blocks and got.complete and got.digest_ok, got
    rows = {
        "durable save (save + flush, empty store)": summary([data_nbytes / t for t in times["save"]]),
        "cold restore (load every prompt)": summary([data_nbytes / t for t in times["restore"]]),
        "copy of the store's files (sendfile, as cp; fsync; no tierkv)": summary(
            [data_nbytes / t for t in times["copy"]]
        ),
        "export (cold read, verify, write the archive, fsync)": summary(
            [data_nbytes / t for t in times["export"]]
        ),
        "import (cold read of the archive, verify, durable write)": summary(
            [data_nbytes / t for t in times["import"]]
        ),
    }
    med = {k: v["median"] for k, v in zip(("save", "restore", "copy", "export", "import"), rows.values())}
    return {
        "config": {
            "kv_nbytes": data_nbytes,
            "blocks": blocks,
            "block_nbytes": data_nbytes // blocks,
            "prompts": num_prompts,
            "prompt_tokens": prompt_tokens,
            "runs": runs,
            "cold_method": method,
        },
        "rows_Bps": rows,
        "archive_nbytes": archive_nbytes,
        "live_nbytes": live_nbytes,
        "ratios": {
            "export / cold restore": med["export"] / med["restore"],
            "export / copy (cp)": med["export"] / med["copy"],
            "import / durable save": med["import"] / med["save"],
            "archive size / store live bytes": archive_nbytes / live_nbytes,
        },
    }


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    head = (
        f"Moving a cache: {c['kv_nbytes'] / 2**20:.0f} MiB of KV in {c['blocks']} records of "
        f"{c['block_nbytes'] / 2**10:.0f} KiB, {c['runs']} runs, page cache dropped by {c['cold_method']}."
    )
    rows = [
        [name, f"{v['median'] / 1e9:.2f}", f"{v['min'] / 1e9:.2f} to {v['max'] / 1e9:.2f}"]
        for name, v in res["rows_Bps"].items()
    ]
    ratios = [[name, f"{value:.2f}"] for name, value in res["ratios"].items()]
    return "\n".join(
        [
            head,
            "",
            *md_table(["GB/s of KV", "median", "spread"], "lrr", rows),
            "",
            *md_table(["ratio (same run)", "value"], "lr", ratios),
        ]
    )
