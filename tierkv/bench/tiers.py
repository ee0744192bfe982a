"""Tier bandwidth against the disk's own limit and memcpy, measured side by side in one run.

Rows (GB/s, medians of ``runs`` with their spread):
  raw O_DIRECT reads and writes    over as many bytes as the store holds: sequential 1 and 8 MiB requests
                                   at queue depths 1, 4 and 32 (threads), fio's 1 and 8 MiB at 32 when fio
                                   is installed; scattered block-sized reads
  raw buffered cold read           the restore's own pattern without tierkv: 8 MiB reads on 4 threads
                                   through a dropped page cache, of the raw file and (alternated with
                                   the cold restores) of the store's own segment files
  first restore                    in a fresh process, the page cache and the index dropped; with the
                                   host tier on, beside a raw read of its own files in the same minute
  (the disk's read limit is the best raw sequential read of them all, the reads measured in two passes,
  before and after tierkv's rows, as this disk drifts; its write limit the best sequential write)
  naive LMDB get, cold             payloads as LMDB values read in random key order (the design we left)
  persistence                      TieredStore save + flush, a durable commit per batch: without a host
                                   tier (saves copy into private buffers), and with one reserved and
                                   populated before the timer, as a serving store has (saves copy into
                                   its slots); and records of 8 MiB, an 8B model's 64-token block
  restore one-prefix cold / warm   TieredStore.load of prefixes written in one go; page cache dropped / hot;
                                   warm also with 8 MiB records (an 8B model's block: a block's fixed costs,
                                   its Python included, spread over 10x the bytes)
  raw buffered warm read           the warm restore's own limit: its segment files read, cached, into
                                   buffers on as many threads as there are CPUs
  a warm read and its checksum     the same in 1 MiB reads, each hashed (xxh3) after it as a restore
                                   verifies each record: the ceiling of a verified read
  restore interleaved cold         prefixes whose blocks were written interleaved
  (each of these for the disk tier's data paths side by side, in brackets: native, the default where the
  extension is built, what the page cache lacks read with O_DIRECT or buffered, whichever this disk
  served faster; python, TIERKV_NATIVE=0, the fallback; native buffered reads, direct_reads=False;
  native O_DIRECT reads, direct_reads=True)
  restore zstd / zstd+shuffle cold the same with compressed records
  host tier restore                TieredStore.load from RAM
  memcpy                           torch copy_ of the same size
plus the lookup latency of a 32K-token prompt (hashing + index).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tierkv import TieredStore, native
from tierkv.bench.disk_limits import (
    READ_THREADS,
    REQUEST_SIZES,
    best_pattern,
    buffered_cold,
    buffered_warm,
    naive_lmdb,
    pattern_name,
    raw_read,
    raw_reads,
    raw_rows,
    raw_write,
    raw_writes,
)
from tierkv.bench.first_restore import in_fresh_process, raw_read_in_fresh_process
from tierkv.bench.kv_workload import LARGE_NS, NS, PROMPT_TOKENS, large_workload, workload
from tierkv.bench.machine import Memcpy, summary
from tierkv.bench.restore_runs import cold_alternated, restores
from tierkv.bench.tier_ratios import in_words, paired, ratios

# The disk tier's readers and writers, side by side: native (the default: what the page cache lacks read
# with O_DIRECT or buffered, whichever this disk served faster, read_modes.py), python (the fallback,
# buffered), native with every read buffered (TIERKV_DIRECT_READS=0), native with O_DIRECT always (=1)
PATHS = ("native", "python", "native buffered reads", "native O_DIRECT reads")
AFTER_MEMORY = (
    f"raw buffered cold read of the store's segment files, 8 MiB, {READ_THREADS} threads, in a fresh process "
    "after writing as much new memory as the host tier"
)


def run(base: Path, *, total_nbytes: int = 512 << 20, runs: int = 5) -> dict[str, Any]:
    prompts, kv = workload(total_nbytes)
    num_prompts, prompt_tokens = len(prompts), len(prompts[0])
    kv_nbytes = kv.numel() * 4
    data_nbytes = num_prompts * kv_nbytes
    rows: dict[str, dict[str, float]] = {}

    block_nbytes = kv_nbytes // (prompt_tokens // 64)
    raw_path = base / "raw.bin"
    raw_nbytes = max(1, data_nbytes // max(REQUEST_SIZES)) * max(REQUEST_SIZES)
    raw = raw_writes(raw_path, raw_nbytes, runs)
    # Reads in two passes, before and after tierkv's rows: this disk's bandwidth drifts over minutes.
    raw_reads(raw_path, raw_nbytes, runs, block_nbytes, raw)
    # The best patterns of this first pass, measured again beside each durable save and each first restore:
    # the goals' limits in the same minute as what they hold to them (this disk's speed drifts up to 2x
    # between the parts of one run, and the best of twelve medians taken minutes apart favours a fast one).
    best_write, best_read = best_pattern(raw, "write"), best_pattern(raw, "read")
    first_pass = {k: statistics.median(v) for k, v in raw.items()}  # the reads' rows mix both passes
    blocks = [kv[:, :, i : i + 64].contiguous().numpy().tobytes() for i in range(0, prompt_tokens, 64)]
    rows["naive LMDB get, cold, random order"] = summary(
        naive_lmdb(base / "naive", blocks * num_prompts, runs)
    )

    store_dir = base / "store"
    # native: O_DIRECT where the file system allows it (the default); native buffered: through the page cache
    writers = ("native", "native buffered", "python") if native.enabled() else ("python",)
    # And a serving store's: its host tier reserved and populated at start-up (as the vLLM connector
    # does), before the timer; saves copy into its slots and the disk writer encodes from them.
    hosted = f"{writers[0]}, host tier populated"
    # And a store that has saved as much before (a running server's: its private copies recycled), where
    # the others are a fresh process's first saves.
    again = f"{writers[0]}, a store that has saved before"
    # And records of 8 MiB, an 8B model's 64-token block: larger than the native writer's chunk.
    large = f"{writers[0]}, 8 MiB records (an 8B model's block)"
    quick = data_nbytes < 96 << 20  # a quick run: fewer rows (each below says what it leaves out)
    with_large = not quick  # its KV alone is 128 MiB
    large_prompts, large_kv = large_workload(data_nbytes) if with_large else ([], kv)
    large_nbytes = len(large_prompts) * large_kv.numel() * large_kv.element_size()
    # (the restores below read the last store written: first or last of these, never ``large``)
    kinds = (*writers, *([large] if with_large else []), hosted, again)
    times: dict[str, list[float]] = {w: [] for w in kinds}
    beside: list[float] = []  # the best raw write of the same bytes next to each run of the first writer
    for r in range(runs):
        for w in kinds if r % 2 == 0 else kinds[::-1]:  # drift favours none
            if w == writers[0] and r % 2 == 0:
                beside.append(raw_write(base / "beside.bin", data_nbytes, best_write))
            shutil.rmtree(store_dir, ignore_errors=True)
            with (
                native.use(not w.startswith("python")),
                TieredStore.open(
                    store_dir,
                    host_bytes=data_nbytes + (64 << 20) if w == hosted else 0,
                    direct_writes=w in ("native", hosted, again) and native.enabled(),
                ) as store,
            ):
                if w == hosted:
                    store.reserve(NS, populate_now=True)
                if w == again:
                    for toks in prompts:
                        store.save(NS, [t + 10**9 for t in toks], kv)
                    store.flush()
                ns_, saved, kv_ = (LARGE_NS, large_prompts, large_kv) if w == large else (NS, prompts, kv)
                t0 = time.perf_counter()
                for toks in saved:
                    store.save(ns_, toks, kv_)
                lost = store.flush()
                times[w].append((large_nbytes if w == large else data_nbytes) / (time.perf_counter() - t0))
                assert lost == 0, f"{lost} blocks lost for the disk"
            if w == writers[0] and r % 2 == 1:
                beside.append(raw_write(base / "beside.bin", data_nbytes, best_write))
    for w in writers:
        rows[f"persistence (save+flush, durable) [{w}]"] = summary(times[w])
    rows[
        f"raw O_DIRECT sequential write beside each durable save, {pattern_name(best_write)} (the first "
        f"pass's best) [{writers[0]}]"
    ] = summary(beside)
    rows[f"persistence (save+flush, durable), host tier populated [{writers[0]}]"] = summary(times[hosted])
    rows[f"persistence (save+flush, durable), a store that has saved before [{writers[0]}]"] = summary(
        times[again]
    )
    if large in times:
        rows[f"persistence (save+flush, durable), 8 MiB records (an 8B model's block) [{writers[0]}]"] = (
            summary(times[large])
        )

    out = torch.empty_like(kv)
    paths = PATHS if native.enabled() else ("python",)
    own: list[float] = []
    cold, method = cold_alternated(store_dir, prompts, out, runs, paths, raw=own)
    bws = cold[paths[0]]
    for path in paths:
        rows[f"restore one-prefix, cold [{path}]"] = summary(cold[path])
    meter = Memcpy(kv_nbytes)
    copies: dict[str, list[float]] = {"warm": [], "host": []}
    warm: dict[str, list[float]] = {}
    for path in paths[:2]:
        warm[path] = restores(
            store_dir, prompts, out, runs, cold=False, path=path, copies=(meter, copies["warm"])
        )[0]
        rows[f"restore one-prefix, warm page cache [{path}]"] = summary(warm[path])
    if with_large:  # the same with an 8B model's blocks, each run beside a memcpy of as many bytes
        large_dir, large_out = base / "store-large", torch.zeros_like(large_kv)  # faulted in, as memcpy's
        with TieredStore.open(large_dir, host_bytes=0) as store:
            for toks in large_prompts:
                store.save(LARGE_NS, toks, large_kv)
            store.flush()
        copies["large"] = []
        warm["large"] = restores(
            large_dir,
            large_prompts,
            large_out,
            runs,
            cold=False,
            path=paths[0],
            copies=(Memcpy(large_out.numel() * large_out.element_size()), copies["large"]),
            ns=LARGE_NS,
        )[0]
        rows[f"restore one-prefix, warm page cache, 8 MiB records (an 8B model's block) [{paths[0]}]"] = (
            summary(warm["large"])
        )
        shutil.rmtree(large_dir)
        del large_out
    threads = min(native.READ_THREADS, len(os.sched_getaffinity(0)))  # as many as a warm restore runs
    segments = sorted((store_dir / "segments").glob("*.seg"))
    rows[f"raw buffered warm read of the store's segment files, 8 MiB, {threads} threads"] = summary(
        buffered_warm(segments, threads, runs)
    )
    # A verified read's ceiling: what a restore must do at least (read, then hash, each record's bytes);
    # the hash is the native one (the Python path's hashes in Python).
    if native.enabled():
        rows[
            f"a warm read and its checksum: the same files, 1 MiB reads, xxh3 of each, {threads} threads"
        ] = summary(buffered_warm(segments, threads, runs, chunk=1 << 20, checksum=True))
    hosted_bws = restores(
        store_dir,
        prompts,
        out,
        runs,
        cold=False,
        host_bytes=data_nbytes + (64 << 20),
        copies=(meter, copies["host"]),
    )[0]
    rows["restore from host tier"] = summary(hosted_bws)
    # A fresh process's first cold restores, with a host tier (allocated, and promoted into, on the way)
    # and without, alternated so that drift favours neither.
    firsts = [(p, h) for p in paths for h in (2 * data_nbytes, 0)]
    if quick:  # each is a fresh process: the native path's alone will do
        firsts = [(paths[0], 2 * data_nbytes)]
    first: dict[tuple[str, int], list[float]] = {k: [] for k in firsts}
    # The first's, with the host tier on, beside a raw read of the same files in the same minute: this
    # disk drifts between the parts of a run more than between two neighbouring reads.
    first_own: list[float] = []
    # and beside the best raw read pattern of raw.bin, cold, in the same minute: the goal's limit
    first_best: list[float] = []
    # And, in full runs, the same raw read in a fresh process that first wrote as much new memory as the
    # host tier (``raw_read_after_fresh_memory``: what this VM does to a cold read beside fresh memory),
    # beside the first restore with its host tier populated before it (the same memory).
    after_memory: list[float] = []
    populated: list[float] = []
    segs = sorted((store_dir / "segments").glob("*.seg"))

    def beside_fresh_memory() -> None:
        if quick:
            return
        after_memory.append(raw_read_in_fresh_process(store_dir, firsts[0][1]))
        populated.append(
            in_fresh_process(
                store_dir, num_prompts, prompt_tokens, firsts[0][1], paths[0], populate_first=True
            )
        )

    for r in range(runs):
        if r % 2 == 0:
            first_own.append(buffered_cold(segs, READ_THREADS))
            first_best.append(raw_read(raw_path, raw_nbytes, best_read))
            beside_fresh_memory()
        for path, host_bytes in firsts if r % 2 == 0 else firsts[::-1]:
            first[path, host_bytes].append(
                in_fresh_process(store_dir, num_prompts, prompt_tokens, host_bytes, path)
            )
        if r % 2 == 1:
            first_own.append(buffered_cold(segs, READ_THREADS))
            first_best.append(raw_read(raw_path, raw_nbytes, best_read))
            beside_fresh_memory()
    for path, host_bytes in firsts:
        on = "host tier on" if host_bytes else "no host tier"
        rows[f"first restore in a fresh process, cold, {on} [{path}]"] = summary(first[path, host_bytes])
    rows[
        f"raw O_DIRECT sequential read beside each first restore, {pattern_name(best_read)} (the first pass's best)"
    ] = summary(first_best)
    if after_memory:
        rows[AFTER_MEMORY] = summary(after_memory)
        rows[f"first restore in a fresh process, cold, host tier on and populated first [{paths[0]}]"] = (
            summary(populated)
        )

    shutil.rmtree(store_dir)
    with TieredStore.open(store_dir, host_bytes=0) as store:  # every prompt's block b before any block b+1
        for b in range(prompt_tokens // 64):
            for toks in prompts:
                store.save(NS, toks[: (b + 1) * 64], kv[:, :, : (b + 1) * 64], start_block=b)
        store.flush()
    interleaved, _ = cold_alternated(store_dir, prompts, out, runs, paths)
    for path in paths:
        rows[f"restore interleaved prefixes, cold [{path}]"] = summary(interleaved[path])

    for codec_ in ("zstd", "zstd_shuffle"):
        shutil.rmtree(store_dir)
        with TieredStore.open(store_dir, host_bytes=0, codec_=codec_) as store:
            for toks in prompts:
                store.save(NS, toks, kv)
            store.flush()
            ratio = data_nbytes / store.stats()["disk"]["used_nbytes"]
        rows[f"restore {codec_} (ratio {ratio:.2f}), cold"] = summary(
            restores(store_dir, prompts, out, runs, cold=True)[0]
        )

    # Measured beside each warm and host restore (above), as the disk's limits are.
    rows["memcpy (torch copy_)"] = summary(copies["warm"] + copies["host"])
    del meter

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
    raw_reads(raw_path, raw_nbytes, runs, block_nbytes, raw)
    raw_path.unlink()
    disk_rows = raw_rows(raw)
    disk_rows["raw buffered cold sequential read of the store's segment files, 8 MiB, 4 threads"] = summary(
        own
    )
    # The disk's limits: the best raw sequential read (write) of this run, whatever its pattern.
    read_limit = max(v["median"] for k, v in disk_rows.items() if "sequential read" in k)
    write_limit = max(v["median"] for k, v in disk_rows.items() if "sequential write" in k)
    rows = disk_rows | rows
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
        "raw_first_pass": first_pass,
        "disk_read_limit_Bps": read_limit,
        "disk_write_limit_Bps": write_limit,
        "lookup_32k_s": summary(lat),
        "ratios": ratios(rows, paths, od, write_limit, bws, own, (first[firsts[0]], first_own))
        | {
            f"persistence / the best raw write beside it, {pattern_name(best_write)} (median of each run's "
            f"ratio) [{writers[0]}]": paired(times[writers[0]], beside),
            f"first restore, host tier on / the best raw read beside it, {pattern_name(best_read)} (median of "
            f"each run's ratio) [{paths[0]}]": paired(first[firsts[0]], first_best),
        }
        # Memory's rows, each run beside the memcpy measured next to it.
        | {
            f"restore warm / memcpy (median of each run's ratio) [{path}]": paired(
                warm[path], copies["warm"][i * runs : (i + 1) * runs]
            )
            for i, path in enumerate(paths[:2])
        }
        | (
            {
                f"restore warm, 8 MiB records (an 8B model's block) / memcpy of as many bytes (median of each "
                f"run's ratio) [{paths[0]}]": paired(warm["large"], copies["large"])
            }
            if "large" in warm
            else {}
        )
        | {"host tier / memcpy (median of each run's ratio)": paired(hosted_bws, copies["host"])}
        | (
            {
                f"first restore, host tier on / the raw read after as much fresh memory (median of each "
                f"run's ratio) [{paths[0]}]": paired(first[firsts[0]], after_memory),
                f"first restore, host tier populated first / the raw read after as much fresh memory (median "
                f"of each run's ratio) [{paths[0]}]": paired(populated, after_memory),
            }
            if after_memory
            else {}
        ),
    }


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        in_words(res),
        "",
        f"KV {c['kv_nbytes'] / 2**20:.0f} MiB in {c['prompts']} prompts of {c['prompt_tokens']} tokens, "
        f"blocks of {c['block_tokens']} tokens ({c['block_nbytes'] / 2**10:.0f} KiB); {c['runs']} runs; "
        f"cold cache via {c['cold_method']} (this machine's page cache: a virtual disk's host may still cache).",
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
    lines += [
        "",
        f"The disk's read limit in this run: {res['disk_read_limit_Bps'] / 1e9:.2f} GB/s, the best median of the "
        "raw sequential reads above; its write limit: "
        f"{res['disk_write_limit_Bps'] / 1e9:.2f} GB/s, the best of the raw sequential writes. 'Each run's ratio': "
        "a cold restore divided by the raw read of the same segment files in the same run.",
    ]
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in res["ratios"].items()]
    return "\n".join(lines)


__all__ = ["NS", "PROMPT_TOKENS", "markdown", "run", "workload"]
