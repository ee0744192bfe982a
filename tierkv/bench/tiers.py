"""Tier bandwidth against the disk's own limit and memcpy, measured side by side in one run.

Rows (GB/s, medians of ``runs`` with their spread):
  raw O_DIRECT reads and writes    the disk's limits (no page cache) over as many bytes as the store holds:
                                   sequential 1 and 8 MiB requests at queue depths 1, 4 and 32 (threads), fio's
                                   at 32 when fio is installed; scattered block-sized reads. The disk's
                                   read (write) limit is the best sequential read (write) of them all
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


REQUEST_SIZES = (1 << 20, 8 << 20)  # per request: small requests undersell a disk with a long latency
QUEUE_DEPTHS = (1, 4, 32)  # requests in flight (one thread each): one stream undersells an NVMe disk


def _odirect_stream(
    path: Path, nbytes: int, depth: int, src: mmap.mmap | None, request_nbytes: int = 1 << 20
) -> float:
    """Bytes per second of O_DIRECT requests of ``request_nbytes`` over ``path``'s first ``nbytes``,
    sequential, ``depth`` in flight (thread k does requests k, k+depth, ...). Writes ``src`` (a buffer of
    ``request_nbytes``) when given (then fsync), else reads."""
    from concurrent.futures import ThreadPoolExecutor

    n = nbytes // request_nbytes
    flags = (os.O_WRONLY | os.O_CREAT) if src is not None else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o600)

    def stream(k: int) -> None:
        own = src or mmap.mmap(-1, request_nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        for i in range(k, n, depth):
            if src is not None:
                os.pwritev(fd, [own], i * request_nbytes)
            else:
                os.preadv(fd, [own], i * request_nbytes)
        if src is None:
            own.close()

    try:
        with ThreadPoolExecutor(depth) as pool:
            t0 = time.perf_counter()
            list(pool.map(stream, range(depth)))
            if src is not None:
                os.fsync(fd)
            return n * request_nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def _fio(path: Path, nbytes: int, write: bool) -> float | None:
    """fio's O_DIRECT sequential 1 MiB at queue depth 32 (libaio), as a cross-check: None without fio."""
    import json
    import shutil as sh
    import subprocess

    if sh.which("fio") is None:
        return None
    rw = "write" if write else "read"
    r = subprocess.run(
        ["fio", "--name=limit", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--direct=1",
         "--ioengine=libaio", "--iodepth=32", f"--size={nbytes}", "--output-format=json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if r.returncode != 0:
        return None
    job = json.loads(r.stdout)["jobs"][0][rw]
    return float(job["bw_bytes"]) or None


def _raw_io(path: Path, nbytes: int, runs: int, record_nbytes: int) -> dict[str, list[float]]:
    """The disk's own limits, without tierkv: O_DIRECT sequential reads and writes of each of
    ``REQUEST_SIZES`` at each of ``QUEUE_DEPTHS``, scattered record-sized O_DIRECT reads, buffered cold
    reads; fio when installed."""
    largest = max(REQUEST_SIZES)
    srcs = {size: mmap.mmap(-1, size) for size in REQUEST_SIZES}
    for m in srcs.values():
        m.write(os.urandom(len(m)))
    buf = mmap.mmap(-1, 8 << 20)
    nbytes = max(1, nbytes // largest) * largest
    combos = [(size, d) for size in REQUEST_SIZES for d in QUEUE_DEPTHS]
    out: dict[str, list[float]] = {f"write_{size >> 20}m_qd{d}": [] for size, d in combos}
    out |= {f"read_{size >> 20}m_qd{d}": [] for size, d in combos}
    out |= {"odirect_scattered": [], "buffered_cold": [], "fio_read_qd32": [], "fio_write_qd32": []}
    rng = random.Random(0)
    for _ in range(runs):
        path.unlink(missing_ok=True)
        for size, d in combos:
            out[f"write_{size >> 20}m_qd{d}"].append(_odirect_stream(path, nbytes, d, srcs[size], size))
        for size, d in combos:
            drop_page_cache([path])
            out[f"read_{size >> 20}m_qd{d}"].append(_odirect_stream(path, nbytes, d, None, size))
        for mode in ("odirect_scattered", "buffered_cold"):
            drop_page_cache([path])
            fd = os.open(path, os.O_RDONLY | (0 if mode == "buffered_cold" else os.O_DIRECT))
            t0 = time.perf_counter()
            if mode == "buffered_cold":
                for i in range(nbytes // len(buf)):
                    os.preadv(fd, [buf], i * len(buf))
                done = nbytes // len(buf) * len(buf)
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
    for write in (False, True):
        drop_page_cache([path])
        if (bw := _fio(path, nbytes, write)) is not None:
            out["fio_write_qd32" if write else "fio_read_qd32"].append(bw)
    buf.close()
    for m in srcs.values():
        m.close()
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


def _prompts(num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    return [[p * 10**6 + t for t in range(prompt_tokens)] for p in range(num_prompts)]


def first_restore(store_dir: str, num_prompts: int, prompt_tokens: int, host_bytes: int) -> float:
    """In a fresh process (``_first_restore``): open the store and reserve its host tier (as a server does
    at start-up), drop the page cache, restore every prompt once at once; bytes per second. What a
    server's first cached requests after a restart see."""
    prompts = _prompts(num_prompts, prompt_tokens)
    out = torch.empty(NS.num_layers, 2, prompt_tokens, NS.num_kv_heads, NS.head_dim)
    out.fill_(0)  # the caller's buffer is the caller's: its pages are not what is measured
    with TieredStore.open(store_dir, host_bytes=host_bytes) as store:
        store.reserve(NS)  # as a server does at start-up: the host tier's pages are populated behind
        drop_page_cache(list(Path(store_dir, "segments").glob("*.seg")))
        t0 = time.perf_counter()
        for toks in prompts:
            n, _ = store.load(NS, toks, out=out)
            assert n == len(toks), (n, len(toks))
        return num_prompts * out.numel() * out.element_size() / (time.perf_counter() - t0)


def _first_restore(store_dir: Path, num_prompts: int, prompt_tokens: int, host_bytes: int) -> float:
    import subprocess
    import sys

    code = (
        "import sys; from tierkv.bench.tiers import first_restore; "
        "print(first_restore(sys.argv[1], *map(int, sys.argv[2:])))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(store_dir), str(num_prompts), str(prompt_tokens), str(host_bytes)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise RuntimeError(f"first restore failed: {r.stderr[-2000:]}")
    return float(r.stdout.strip().splitlines()[-1])


def run(base: Path, *, total_nbytes: int = 512 << 20, runs: int = 5) -> dict[str, Any]:
    prompt_tokens = PROMPT_TOKENS if total_nbytes >= 96 << 20 else 1024
    token_nbytes = 12 * 1024
    num_prompts = max(1, total_nbytes // (prompt_tokens * token_nbytes))
    prompts = _prompts(num_prompts, prompt_tokens)
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
    for rw in ("read", "write"):
        for size in REQUEST_SIZES:
            for d in QUEUE_DEPTHS:
                rows[f"raw O_DIRECT sequential {rw}, {size >> 20} MiB, QD {d}"] = summary(
                    raw[f"{rw}_{size >> 20}m_qd{d}"]
                )
    for rw in ("read", "write"):
        if raw[f"fio_{rw}_qd32"]:
            rows[f"fio O_DIRECT sequential {rw}, 1 MiB, QD 32 (libaio)"] = summary(raw[f"fio_{rw}_qd32"])
    rows["raw O_DIRECT scattered block-sized reads"] = summary(raw["odirect_scattered"])
    rows["raw buffered cold read"] = summary(raw["buffered_cold"])
    # The disk's limits: the best sequential O_DIRECT measurement (any queue depth, ours or fio's).
    read_limit = max(v["median"] for k, v in rows.items() if "sequential read" in k)
    write_limit = max(v["median"] for k, v in rows.items() if "sequential write" in k)
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
    # A fresh process's first cold restores, with a host tier (allocated, and promoted into, on the way)
    # and without, alternated so that drift favours neither.
    first: dict[int, list[float]] = {0: [], 2 * data_nbytes: []}
    for r in range(runs):
        for host_bytes in list(first) if r % 2 == 0 else list(first)[::-1]:
            first[host_bytes].append(_first_restore(store_dir, num_prompts, prompt_tokens, host_bytes))
    rows["first restore in a fresh process, cold, host tier on"] = summary(first[2 * data_nbytes])
    rows["first restore in a fresh process, cold, no host tier"] = summary(first[0])

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
    od = read_limit
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
        "disk_read_limit_Bps": read_limit,
        "disk_write_limit_Bps": write_limit,
        "lookup_32k_s": summary(lat),
        "ratios": {
            "restore cold one-prefix / disk limit": rows["restore one-prefix, cold"]["median"] / od,
            "first restore, host tier on / disk limit": rows[
                "first restore in a fresh process, cold, host tier on"
            ]["median"]
            / od,
            "restore cold interleaved / disk limit": rows["restore interleaved prefixes, cold"]["median"]
            / od,
            "naive LMDB cold / disk limit": rows["naive LMDB get, cold, random order"]["median"] / od,
            "persistence / disk write limit": rows["persistence (save+flush, durable)"]["median"]
            / write_limit,
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
