"""Tier bandwidth against the disk's own limit and memcpy, measured side by side in one run.

Rows (GB/s, medians of ``runs`` with their spread):
  raw O_DIRECT reads and writes    the disk's limits (no page cache) over as many bytes as the store holds:
                                   sequential with one and four streams, scattered block-sized reads,
                                   sequential writes; "disk limit" is the better sequential read
  raw buffered cold read           large sequential reads through the page cache
  naive LMDB get, cold             payloads as LMDB values read in random key order (the design we left)
  persistence                      TieredStore save + flush, a durable commit per batch
  restore one-prefix cold / warm   TieredStore.load of prefixes written in one go; page cache dropped / hot
  restore interleaved cold         prefixes whose blocks were written interleaved
  restore zstd / zstd+shuffle cold the same with compressed records
  host tier restore                TieredStore.load from RAM
  memcpy                           torch copy_ of the same size
plus the lookup latency of a 32K-token prompt (hashing + index).
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tierkv import Namespace, TieredStore
from tierkv.bench.machine import drop_page_cache, summary

# The embedded default model's KV layout: 6 layers, 4 KV heads, head dim 64, fp32: 12 KiB per token.
NS = Namespace(
    model_id="bench",
    revision="0",
    dtype="float32",
    num_layers=6,
    num_kv_heads=4,
    head_dim=64,
    block_tokens=64,
)
PROMPT_TOKENS = 8192
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _raw_io(path: Path, nbytes: int, runs: int, record_nbytes: int) -> dict[str, list[float]]:
    """The disk's own limits, without tierkv: O_DIRECT reads (one stream, four parallel streams, scattered
    record-sized reads), buffered cold reads, and O_DIRECT sequential writes."""
    from concurrent.futures import ThreadPoolExecutor

    chunk_nbytes = 8 << 20
    buf = mmap.mmap(-1, chunk_nbytes)
    src = mmap.mmap(-1, chunk_nbytes)
    src.write(os.urandom(chunk_nbytes))
    out: dict[str, list[float]] = {
        "odirect_write": [],
        "odirect": [],
        "odirect_4": [],
        "odirect_scattered": [],
        "buffered_cold": [],
    }
    n_chunks = max(1, nbytes // chunk_nbytes)
    nbytes = n_chunks * chunk_nbytes
    rng = random.Random(0)
    for _ in range(runs):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        t0 = time.perf_counter()
        for i in range(n_chunks):
            os.pwritev(fd, [src], i * chunk_nbytes)
        os.fsync(fd)
        out["odirect_write"].append(nbytes / (time.perf_counter() - t0))
        os.close(fd)
        for mode in ("odirect", "odirect_4", "odirect_scattered", "buffered_cold"):
            drop_page_cache([path])
            fd = os.open(path, os.O_RDONLY | (0 if mode == "buffered_cold" else os.O_DIRECT))
            t0 = time.perf_counter()
            if mode in ("odirect", "buffered_cold"):
                for i in range(n_chunks):
                    os.preadv(fd, [buf], i * chunk_nbytes)
                done = nbytes
            elif mode == "odirect_4":

                def stream(k: int, fd: int = fd) -> None:  # stream k reads chunks k, k+4, ... into its buffer
                    own = mmap.mmap(-1, chunk_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
                    for i in range(k, n_chunks, 4):
                        os.preadv(fd, [own], i * chunk_nbytes)
                    own.close()

                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(stream, range(4)))
                done = nbytes
            else:  # record-sized reads at random record offsets: blocks scattered over the disk
                count = nbytes // record_nbytes
                with memoryview(buf) as whole:
                    view = whole[:record_nbytes]
                    for _ in range(count):
                        os.preadv(fd, [view], rng.randrange(count) * record_nbytes)
                    view.release()
                done = count * record_nbytes
            out[mode].append(done / (time.perf_counter() - t0))
            os.close(fd)
    buf.close()
    src.close()
    path.unlink()
    return out


def _naive_lmdb(dirpath: Path, blocks: list[bytes], runs: int) -> list[float]:
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
                total += len(txn.get(k) or b"")
        results.append(total / (time.perf_counter() - t0))
        env.close()
    shutil.rmtree(dirpath)
    return results


def _restores(
    store_dir: Path, prompts: list[list[int]], out: torch.Tensor, runs: int, cold: bool, host_bytes: int = 0
) -> tuple[list[float], str]:
    bws, method = [], ""
    kv_nbytes = out.numel() * out.element_size()
    for _ in range(runs):
        with TieredStore.open(store_dir, host_bytes=host_bytes) as store:
            if host_bytes:  # fill the host tier from disk first
                for toks in prompts:
                    store.load(NS, toks, out=out)
            if cold:
                method = drop_page_cache(list((store_dir / "segments").glob("*.seg")))
            t0 = time.perf_counter()
            for toks in prompts:
                n, _ = store.load(NS, toks, out=out)
                assert n == len(toks), (n, len(toks))
            bws.append(len(prompts) * kv_nbytes / (time.perf_counter() - t0))
    return bws, method


def run(base: Path, *, total_nbytes: int = 512 << 20, runs: int = 5) -> dict[str, Any]:
    prompt_tokens = PROMPT_TOKENS if total_nbytes >= 96 << 20 else 1024
    token_nbytes = 12 * 1024
    num_prompts = max(1, total_nbytes // (prompt_tokens * token_nbytes))
    prompts = [[p * 10**6 + t for t in range(prompt_tokens)] for p in range(num_prompts)]
    kv = torch.randn(
        NS.num_layers,
        2,
        prompt_tokens,
        NS.num_kv_heads,
        NS.head_dim,
        generator=torch.Generator().manual_seed(0),
    )
    kv_nbytes = kv.numel() * 4
    data_nbytes = num_prompts * kv_nbytes
    rows: dict[str, dict[str, float]] = {}

    block_nbytes = kv_nbytes // (prompt_tokens // 64)
    raw = _raw_io(base / "raw.bin", data_nbytes, runs, block_nbytes)
    rows["raw O_DIRECT sequential read"] = summary(raw["odirect"])
    rows["raw O_DIRECT sequential read, 4 streams"] = summary(raw["odirect_4"])
    rows["raw O_DIRECT scattered block-sized reads"] = summary(raw["odirect_scattered"])
    rows["raw O_DIRECT sequential write"] = summary(raw["odirect_write"])
    rows["raw buffered cold read"] = summary(raw["buffered_cold"])
    blocks = [kv[:, :, i : i + 64].contiguous().numpy().tobytes() for i in range(0, prompt_tokens, 64)]
    rows["naive LMDB get, cold, random order"] = summary(
        _naive_lmdb(base / "naive", blocks * num_prompts, runs)
    )

    store_dir = base / "store"
    times = []
    for _ in range(runs):
        shutil.rmtree(store_dir, ignore_errors=True)
        with TieredStore.open(store_dir, host_bytes=0) as store:
            t0 = time.perf_counter()
            for toks in prompts:
                store.save(NS, toks, kv)
            store.flush()
            times.append(data_nbytes / (time.perf_counter() - t0))
    rows["persistence (save+flush, durable)"] = summary(times)

    out = torch.empty_like(kv)
    bws, method = _restores(store_dir, prompts, out, runs, cold=True)
    rows["restore one-prefix, cold"] = summary(bws)
    rows["restore one-prefix, warm page cache"] = summary(
        _restores(store_dir, prompts, out, runs, cold=False)[0]
    )
    rows["restore from host tier"] = summary(
        _restores(store_dir, prompts, out, runs, cold=False, host_bytes=data_nbytes + (64 << 20))[0]
    )

    shutil.rmtree(store_dir)
    with TieredStore.open(store_dir, host_bytes=0) as store:  # every prompt's block b before any block b+1
        for b in range(prompt_tokens // 64):
            for toks in prompts:
                store.save(NS, toks[: (b + 1) * 64], kv[:, :, : (b + 1) * 64], start_block=b)
        store.flush()
    rows["restore interleaved prefixes, cold"] = summary(
        _restores(store_dir, prompts, out, runs, cold=True)[0]
    )

    for codec_ in ("zstd", "zstd_shuffle"):
        shutil.rmtree(store_dir)
        with TieredStore.open(store_dir, host_bytes=0, codec_=codec_) as store:
            for toks in prompts:
                store.save(NS, toks, kv)
            store.flush()
            ratio = data_nbytes / store.stats()["disk"]["used_nbytes"]
        rows[f"restore {codec_} (ratio {ratio:.2f}), cold"] = summary(
            _restores(store_dir, prompts, out, runs, cold=True)[0]
        )

    src = torch.empty(kv_nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(runs * 3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(kv_nbytes / (time.perf_counter() - t0))
    rows["memcpy (torch copy_)"] = summary(times)

    long_prompt = list(range(32768))
    shutil.rmtree(store_dir)
    lat = []
    with TieredStore.open(store_dir, host_bytes=0) as store:
        store.save(NS, long_prompt, torch.zeros(NS.num_layers, 2, 32768, NS.num_kv_heads, NS.head_dim))
        store.flush()
        for _ in range(runs * 4):
            t0 = time.perf_counter()
            hit = store.lookup(NS, long_prompt)
            lat.append(time.perf_counter() - t0)
            assert hit.num_tokens == 32768
    shutil.rmtree(store_dir)
    # The disk's limit: the better of one O_DIRECT stream and four (a queue depth of one undersells NVMe).
    od = max(
        rows["raw O_DIRECT sequential read"]["median"],
        rows["raw O_DIRECT sequential read, 4 streams"]["median"],
    )
    return {
        "config": {
            "kv_nbytes": data_nbytes,
            "prompts": num_prompts,
            "prompt_tokens": prompt_tokens,
            "block_tokens": NS.block_tokens,
            "block_nbytes": kv_nbytes // (prompt_tokens // 64),
            "runs": runs,
            "cold_method": method,
        },
        "rows_Bps": rows,
        "lookup_32k_s": summary(lat),
        "ratios": {
            "restore cold one-prefix / disk limit": rows["restore one-prefix, cold"]["median"] / od,
            "restore cold interleaved / disk limit": rows["restore interleaved prefixes, cold"]["median"]
            / od,
            "naive LMDB cold / disk limit": rows["naive LMDB get, cold, random order"]["median"] / od,
            "persistence / O_DIRECT write": rows["persistence (save+flush, durable)"]["median"]
            / rows["raw O_DIRECT sequential write"]["median"],
            "restore warm / memcpy": rows["restore one-prefix, warm page cache"]["median"]
            / rows["memcpy (torch copy_)"]["median"],
            "host tier / memcpy": rows["restore from host tier"]["median"]
            / rows["memcpy (torch copy_)"]["median"],
        },
    }


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"KV {c['kv_nbytes'] / 2**20:.0f} MiB in {c['prompts']} prompts of {c['prompt_tokens']} tokens, "
        f"blocks of {c['block_tokens']} tokens ({c['block_nbytes'] / 2**10:.0f} KiB); {c['runs']} runs; "
        f"cold cache via {c['cold_method']}.",
        "",
        "| measurement | median GB/s | min | max |",
        "|---|---:|---:|---:|",
    ]
    for name, s in res["rows_Bps"].items():
        lines.append(f"| {name} | {s['median'] / 1e9:.2f} | {s['min'] / 1e9:.2f} | {s['max'] / 1e9:.2f} |")
    lk = res["lookup_32k_s"]
    lines.append(
        f"| lookup of a 32K-token prompt (ms) | {lk['median'] * 1e3:.2f} | {lk['min'] * 1e3:.2f} | "
        f"{lk['max'] * 1e3:.2f} |"
    )
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in res["ratios"].items()]
    return "\n".join(lines)


__all__ = ["NS", "PROMPT_TOKENS", "markdown", "run"]
