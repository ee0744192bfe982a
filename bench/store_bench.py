"""Disk-tier bandwidth against the disk's own limit, measured side by side in one run.

    python -m bench.store_bench [--total 512MiB] [--runs 5] [--dir PATH] [--json out.json]

Rows (medians of --runs, each with its spread):
  raw O_DIRECT sequential read     the disk's limit (no page cache), same bytes as the store holds
  raw buffered cold read           what the page cache path can do
  naive LMDB get, cold             payloads as LMDB values, read in random key order (the design we left)
  restore, one prefix, cold        TieredStore.load of a prefix written in one go, page cache dropped
  restore, interleaved, cold       the same when prefixes' blocks were written interleaved
  restore, warm                    page cache hot, against memcpy of the same bytes
  persistence                      save + flush with a durable commit per batch
  lookup 32K tokens                hashing + index for a 32K-token prompt
The page cache is dropped with /proc/sys/vm/drop_caches when root, else posix_fadvise(DONTNEED) per file.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tierkv import Namespace, TieredStore
from tierkv.units import format_size, parse_size

# The embedded default model's KV layout: 6 layers, 4 KV heads, head dim 64, fp32: 12 KiB per token.
NS = Namespace(model_id="bench", revision="0", dtype="float32", num_layers=6, num_kv_heads=4, head_dim=64,
               block_tokens=64)


def drop_page_cache(paths: list[Path]) -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def _median(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def raw_reads(path: Path, nbytes: int, runs: int) -> dict[str, list[float]]:
    with open(path, "wb") as f:
        chunk = os.urandom(16 << 20)
        for _ in range(0, nbytes, len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, 8 << 20)
    out: dict[str, list[float]] = {"odirect": [], "buffered_cold": []}
    for _ in range(runs):
        for mode in out:
            drop_page_cache([path])
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if mode == "odirect" else 0))
            t0 = time.perf_counter()
            off = 0
            while off < nbytes:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                off += n
            out[mode].append(off / (time.perf_counter() - t0))
            os.close(fd)
    buf.close()
    path.unlink()
    return out


def naive_lmdb(dirpath: Path, blocks: list[bytes], runs: int) -> list[float]:
    import lmdb

    env = lmdb.open(str(dirpath), map_size=4 * sum(map(len, blocks)) + (1 << 30))
    keys = [i.to_bytes(8, "big") for i in range(len(blocks))]
    with env.begin(write=True) as txn:
        for k, b in zip(keys, blocks):
            txn.put(k, b)
    env.sync(True)
    env.close()
    results = []
    for _ in range(runs):
        drop_page_cache([dirpath / "data.mdb"])  # with the map closed: mapped pages are not dropped
        env = lmdb.open(str(dirpath))
        order = keys[:]
        random.shuffle(order)
        t0 = time.perf_counter()
        total = 0
        with env.begin(buffers=True) as txn:
            for k in order:
                total += len(txn.get(k))
        results.append(total / (time.perf_counter() - t0))
        env.close()
    return results


def run(total_nbytes: int, runs: int, base: Path) -> dict[str, object]:
    spec_tokens = total_nbytes // (12 * 1024)
    prompt_tokens = 8192
    num_prompts = max(1, spec_tokens // prompt_tokens)
    prompts = [[p * 10**6 + t for t in range(prompt_tokens)] for p in range(num_prompts)]
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(NS.num_layers, 2, prompt_tokens, NS.num_kv_heads, NS.head_dim, generator=g)
    kv_nbytes = kv.numel() * 4
    res: dict[str, object] = {"config": {"total_nbytes": num_prompts * kv_nbytes, "prompts": num_prompts,
                                         "prompt_tokens": prompt_tokens, "block_tokens": NS.block_tokens,
                                         "block_nbytes": kv_nbytes // (prompt_tokens // NS.block_tokens),
                                         "runs": runs, "torch": torch.__version__, "cpus": os.cpu_count()}}
    rows: dict[str, tuple[float, float, float]] = {}

    raw = raw_reads(base / "raw.bin", num_prompts * kv_nbytes, runs)
    rows["raw O_DIRECT sequential read"] = _median(raw["odirect"])
    rows["raw buffered cold read"] = _median(raw["buffered_cold"])

    blocks = [kv[:, :, i:i + 64].contiguous().numpy().tobytes() for i in range(0, prompt_tokens, 64)]
    rows["naive LMDB get, cold, random order"] = _median(naive_lmdb(base / "naive", blocks * num_prompts, runs))
    shutil.rmtree(base / "naive")

    # Persistence: the whole data set saved and flushed, a durable commit per batch.
    times = []
    for _ in range(runs):
        shutil.rmtree(base / "store", ignore_errors=True)
        with TieredStore.open(base / "store", host_bytes=0) as store:
            t0 = time.perf_counter()
            for toks in prompts:
                store.save(NS, toks, kv)
            store.flush()
            times.append(num_prompts * kv_nbytes / (time.perf_counter() - t0))
    rows["persistence (save+flush, durable)"] = _median(times)

    out = torch.empty_like(kv)
    segs = list((base / "store" / "segments").glob("*.seg"))
    method = ""
    for label, cold in (("restore, one prefix each, cold", True), ("restore, warm page cache", False)):
        bws = []
        for _ in range(runs):
            with TieredStore.open(base / "store", host_bytes=0) as store:
                if cold:
                    method = drop_page_cache(segs)
                t0 = time.perf_counter()
                for toks in prompts:
                    n, _ = store.load(NS, toks, out=out)
                    assert n == prompt_tokens
                bws.append(num_prompts * kv_nbytes / (time.perf_counter() - t0))
        rows[label] = _median(bws)

    # Interleaved: every prompt's block i written before any prompt's block i+1.
    shutil.rmtree(base / "store")
    with TieredStore.open(base / "store", host_bytes=0) as store:
        for b in range(prompt_tokens // 64):
            for toks in prompts:
                store.save(NS, toks[: (b + 1) * 64], kv[:, :, : (b + 1) * 64], start_block=b)
        store.flush()
    segs = list((base / "store" / "segments").glob("*.seg"))
    bws = []
    for _ in range(runs):
        with TieredStore.open(base / "store", host_bytes=0) as store:
            drop_page_cache(segs)
            t0 = time.perf_counter()
            for toks in prompts:
                n, _ = store.load(NS, toks, out=out)
                assert n == prompt_tokens
            bws.append(num_prompts * kv_nbytes / (time.perf_counter() - t0))
    rows["restore, interleaved prefixes, cold"] = _median(bws)

    src = torch.empty(kv_nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs * 3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(kv_nbytes / (time.perf_counter() - t0))
    rows["memcpy (torch copy_)"] = _median(times)

    long_prompt = list(range(32768))
    with TieredStore.open(base / "store", host_bytes=0) as store:
        kv32 = torch.zeros(NS.num_layers, 2, 32768, NS.num_kv_heads, NS.head_dim)
        store.save(NS, long_prompt, kv32)
        store.flush()
        lat = []
        for _ in range(runs * 4):
            t0 = time.perf_counter()
            hit = store.lookup(NS, long_prompt)
            lat.append(time.perf_counter() - t0)
            assert hit.num_tokens == 32768
    res["lookup_32k_s"] = _median(lat)
    res["cold_method"] = method
    res["rows"] = rows
    od = rows["raw O_DIRECT sequential read"][0]
    res["ratios"] = {
        "restore cold one-prefix / O_DIRECT": rows["restore, one prefix each, cold"][0] / od,
        "restore cold interleaved / O_DIRECT": rows["restore, interleaved prefixes, cold"][0] / od,
        "naive LMDB cold / O_DIRECT": rows["naive LMDB get, cold, random order"][0] / od,
        "restore warm / memcpy": rows["restore, warm page cache"][0] / rows["memcpy (torch copy_)"][0],
    }
    return res


def print_table(res: dict) -> None:
    cfg = res["config"]
    print(f"config: {cfg['prompts']} prompts x {cfg['prompt_tokens']} tokens, {format_size(cfg['total_nbytes'])} of KV, "
          f"block {cfg['block_tokens']} tokens = {format_size(cfg['block_nbytes'])}, {cfg['runs']} runs, "
          f"torch {cfg['torch']}, {cfg['cpus']} cpus; cold cache via {res['cold_method']}")
    print(f"{'measurement':40s} {'median GB/s':>12s} {'min':>8s} {'max':>8s}")
    for name, (med, lo, hi) in res["rows"].items():
        print(f"{name:40s} {med / 1e9:12.2f} {lo / 1e9:8.2f} {hi / 1e9:8.2f}")
    med, lo, hi = res["lookup_32k_s"]
    print(f"{'lookup of a 32K-token prompt (ms)':40s} {med * 1e3:12.3f} {lo * 1e3:8.3f} {hi * 1e3:8.3f}")
    for name, ratio in res["ratios"].items():
        print(f"ratio {name:40s} {ratio:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="512MiB", help="KV bytes in the store (default 512MiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to put the store (default: a temp dir under the repo's disk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir or str(Path.cwd())))
    try:
        res = run(parse_size(args.total), args.runs, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
