"""TTFT of the embedded default model: cold prefill against restore from each tier, beside each floor.

    python -m bench.ttft_bench [--lengths 512,1024,2048,4096] [--runs 5] [--json out.json]

For a prompt of L+1 tokens (L cached, one computed) it measures, medians of --runs:
  cold          prefill with the cache off
  no-hit        prefill with the cache on and nothing cached (a fresh prompt each run): the overhead
  host          restore L tokens from the host tier, forward 1
  disk warm     a fresh store with no host tier, page cache warm
  disk cold     the same after dropping the page cache (/proc/sys/vm/drop_caches, or fadvise DONTNEED)
Floor of a tier = KV bytes / that tier's bandwidth measured in this run (memcpy; buffered warm read;
O_DIRECT read) + the median one-token forward after a restore.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.store_bench import drop_page_cache
from tierkv import TieredStore
from tierkv.worker import CachedModel


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _bandwidths(base: Path, nbytes: int) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        t.append(time.perf_counter() - t0)
    path = base / "bw.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, nbytes)
    out = {"memcpy": nbytes / _median(t)}
    for mode in ("warm", "odirect"):
        ts = []
        for _ in range(5):
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if mode == "odirect" else 0))
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                n = os.preadv(fd, [memoryview(buf)[got:]], got)
                if n <= 0:
                    break
                got += n
            ts.append(time.perf_counter() - t0)
            os.close(fd)
        out[mode] = nbytes / _median(ts)
    buf.close()
    path.unlink()
    return out


def run(lengths: list[int], runs: int, base: Path) -> dict:
    torch.manual_seed(0)
    res: dict = {"config": {"model": "embedded default (Llama, 6 layers, 4 KV heads x 64, fp32, ~33M params)",
                            "runs": runs, "torch": torch.__version__, "threads": torch.get_num_threads(),
                            "block_tokens": 64}, "rows": []}
    bw = _bandwidths(base, 64 << 20)
    res["bandwidth_Bps"] = bw
    method = ""
    for L in lengths:
        ids = torch.randint(3, 259, (L + 1,)).tolist()
        store_dir = base / f"store-{L}"
        row: dict = {"tokens": L + 1}
        with TieredStore.open(store_dir, host_bytes=2**31) as store:
            cm = CachedModel.default(store)
            kv_nbytes = L * cm.base_namespace.num_layers * 2 * 4 * 64 * 4
            row["kv_nbytes"] = kv_nbytes
            cold, nohit = [], []
            cm.prefill(ids[:L // 2], use_cache=False)  # warm-up
            for r in range(runs):
                fresh = [(t + r + 1) % 256 + 3 for t in ids]  # nothing cached: a new prompt each run
                # Alternate which goes first, so drift (frequency, allocator) does not favour either.
                for kind in (("cold", "nohit") if r % 2 == 0 else ("nohit", "cold")):
                    t0 = time.perf_counter()
                    cm.prefill(ids, use_cache=False) if kind == "cold" else cm.prefill(fresh)
                    (cold if kind == "cold" else nohit).append(time.perf_counter() - t0)
            cm.prefill(ids)
            store.flush()
            host, fwd = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                p = cm.prefill(ids)
                host.append(time.perf_counter() - t0)
                fwd.append(p.forward_s)
                assert p.hit.by_tier["host"] == L
        row.update(cold_s=_median(cold), nohit_s=_median(nohit), host_s=_median(host), forward_1_s=_median(fwd))
        for label, cold_cache in (("disk_warm_s", False), ("disk_cold_s", True)):
            ts = []
            for _ in range(runs):
                with TieredStore.open(store_dir, host_bytes=0) as store:
                    cm.store = store
                    cm.prefill(ids[:65])  # warm up the code path, not the data (block 0 only)
                    if cold_cache:
                        method = drop_page_cache(list((store_dir / "segments").glob("*.seg")))
                    t0 = time.perf_counter()
                    p = cm.prefill(ids)
                    ts.append(time.perf_counter() - t0)
                    assert p.hit.by_tier["disk"] == L, p.hit
            row[label] = _median(ts)
        f = row["forward_1_s"]
        row["floor_host_s"] = kv_nbytes / bw["memcpy"] + f
        row["floor_disk_warm_s"] = kv_nbytes / bw["warm"] + f
        row["floor_disk_cold_s"] = kv_nbytes / bw["odirect"] + f
        res["rows"].append(row)
        shutil.rmtree(store_dir)
    res["cold_method"] = method
    return res


def print_table(res: dict) -> None:
    bw = res["bandwidth_Bps"]
    c = res["config"]
    print(f"config: {c['model']}; {c['runs']} runs; torch {c['torch']}, {c['threads']} threads; block "
          f"{c['block_tokens']}; bandwidth memcpy {bw['memcpy'] / 1e9:.1f} GB/s, page-cache read "
          f"{bw['warm'] / 1e9:.1f} GB/s, O_DIRECT {bw['odirect'] / 1e9:.2f} GB/s; cold via {res['cold_method']}")
    print("TTFT medians in ms; (x) = ratio to the tier's floor; speedup = cold / tier")
    print(f"{'tokens':>6} {'KV MiB':>7} {'cold':>8} {'no-hit':>8} {'ovh%':>6} {'host':>14} {'disk warm':>14} "
          f"{'disk cold':>14} {'speedup h/dw/dc':>18}")
    for r in res["rows"]:
        def cell(key: str, floor: str, r: dict = r) -> str:
            return f"{r[key] * 1e3:7.1f} ({r[key] / r[floor]:.2f})"
        print(f"{r['tokens']:>6} {r['kv_nbytes'] / 2**20:7.1f} {r['cold_s'] * 1e3:8.1f} {r['nohit_s'] * 1e3:8.1f} "
              f"{100 * (r['nohit_s'] / r['cold_s'] - 1):6.1f} {cell('host_s', 'floor_host_s'):>14} "
              f"{cell('disk_warm_s', 'floor_disk_warm_s'):>14} {cell('disk_cold_s', 'floor_disk_cold_s'):>14} "
              f"{r['cold_s'] / r['host_s']:6.0f}/{r['cold_s'] / r['disk_warm_s']:4.0f}/{r['cold_s'] / r['disk_cold_s']:4.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tierkv-ttft-", dir=str(Path.cwd())))
    try:
        res = run([int(x) for x in args.lengths.split(",")], args.runs, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
