"""Time to first token: cold prefill against restore from each tier, each beside its floor.

For a prompt of L+1 tokens (L cached, one computed), medians of ``runs``:
  cold        prefill with the cache off
  no-hit      prefill with the cache on and nothing cached (a new prompt each run): the cache's overhead
  host        restore L tokens from the host tier, forward 1
  disk warm   a fresh store without a host tier, page cache warm
  disk cold   the same after dropping the page cache
Floor of a tier = KV bytes / that tier's bandwidth measured in this run (memcpy; page-cache read; the
disk's read limit: the best raw sequential read of any pattern, as in the tiers benchmark) + the median
one-token forward over the model's own contiguous cache. A second table splits TTFT: the restore alone against the bytes' floor, and the one-token
forward after a restore against the same forward over the model's own contiguous cache.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tierkv import TieredStore
from tierkv.bench.disk_limits import sequential_read_limit
from tierkv.bench.machine import drop_page_cache, memcpy_bps, summary, warm_page_cache
from tierkv.default_model import DEFAULT_MODEL_ID, ByteTokenizer, build_default_model
from tierkv.worker import CachedModel

# Model configs: the embedded default, and a wider, deeper Llama shape (more KV per token, more compute).
MODELS: dict[str, dict[str, Any]] = {
    "default": {},
    "llama-wide": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    ),
}


def _bandwidths(base: Path, nbytes: int) -> dict[str, float]:
    memcpy = memcpy_bps(nbytes)
    path = base / "bw.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, nbytes)
    out = {"memcpy": memcpy}
    # The disk's limit: the best raw sequential read, any pattern (as in the tiers benchmark).
    out["disk_read_limit"] = sequential_read_limit(path, nbytes // (8 << 20) * (8 << 20) or nbytes, 3)
    for mode in ("page_cache",):
        ts = []
        for _ in range(5):
            fd = os.open(path, os.O_RDONLY)
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                n = os.preadv(fd, [memoryview(buf)[got:]], got)
                if n <= 0:
                    break
                got += n
            ts.append(time.perf_counter() - t0)
            os.close(fd)
        out[mode] = nbytes / summary(ts)["median"]
    buf.close()
    path.unlink()
    return out


# The seeds' headline, for the table beside them: 11,561 tokens, 4,109 ms cold, 22 ms from the cache.
SEED_HEADLINE = {"tokens": 11561, "cold_s": 4.109, "hit_s": 0.022}


def _model(name: str, store: TieredStore | None) -> CachedModel:
    """A config of the embedded model (``MODELS``), a built-in model (``smollm2``, ``tiny``) or a directory."""
    if name in ("default", "tiny"):
        return CachedModel.default(store)
    if name in MODELS:
        return CachedModel(
            build_default_model(torch.float32, **MODELS[name]),
            ByteTokenizer(),
            store,
            model_id=f"{DEFAULT_MODEL_ID}-{name}",
        )
    return CachedModel.from_pretrained(name, store, dtype=torch.float32)


@torch.inference_mode()
def _contiguous_forward(cm: CachedModel, ids: list[int], runs: int) -> list[float]:
    """The last token's forward over the model's own cache of the others (no restore): what the forward
    after a restore is compared with."""
    pre = cm.prefill(ids[:-1], use_cache=False)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        cm._forward(ids[-1:], pre.cache)
        ts.append(time.perf_counter() - t0)
        pre.cache.crop(-1)  # the token just added
    return ts


def default_lengths(cm: CachedModel) -> tuple[int, ...]:
    """Cached tokens per row: 1K to 4K, and 8K where the context allows (8,128 + 1 within 8,192)."""
    context = int(getattr(cm.model.config, "max_position_embeddings", 4096))
    return tuple(n for n in (1024, 2048, 4096) if n < context) + ((8128,) if context >= 8192 else ())


def run(
    base: Path,
    *,
    model: str = "default",
    lengths: tuple[int, ...] | None = (512, 1024, 2048, 4096),
    runs: int = 5,
) -> dict[str, Any]:
    """``lengths``: cached tokens per row (each prompt is one token longer); None: ``default_lengths``."""
    torch.manual_seed(0)
    bw = _bandwidths(base, 64 << 20)
    rows = []
    method = ""
    cm = _model(model, None)
    lengths = default_lengths(cm) if lengths is None else lengths
    ns = cm.base_namespace
    token_nbytes = ns.num_layers * 2 * ns.num_kv_heads * ns.head_dim * cm.dtype.itemsize
    # Token ids: any ids of the vocabulary but the first three (special tokens in both tokenizers); the
    # costs do not depend on which.
    vocab = int(cm.model.get_input_embeddings().num_embeddings)
    for L in lengths:
        ids = torch.randint(3, vocab, (L + 1,)).tolist()
        store_dir = base / f"store-{model}-{L}"
        row: dict[str, Any] = {"tokens": L + 1, "kv_nbytes": L * token_nbytes}
        with TieredStore.open(store_dir, host_bytes=L * token_nbytes + (64 << 20)) as store:
            cm.store = store
            cold: list[float] = []
            nohit: list[float] = []
            cm.prefill(ids[: L // 2], use_cache=False)  # warm-up
            for r in range(runs):
                fresh = [(t + r + 1) % (vocab - 3) + 3 for t in ids]  # nothing cached: a new prompt each run
                # Alternate which goes first, so drift (frequency, allocator) favours neither.
                for kind in ("cold", "nohit") if r % 2 == 0 else ("nohit", "cold"):
                    t0 = time.perf_counter()
                    cm.prefill(ids, use_cache=False) if kind == "cold" else cm.prefill(fresh)
                    (cold if kind == "cold" else nohit).append(time.perf_counter() - t0)
            store.flush()  # the idle-priority disk writer lets go of the host slots it still holds
            cm.prefill(ids)
            store.flush()
            host, fwd, restore = [], [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                p = cm.prefill(ids)
                host.append(time.perf_counter() - t0)
                fwd.append(p.forward_s)
                restore.append(p.restore_s)
                assert p.hit.by_tier["host"] == L, p.hit
        row.update(
            cold_s=summary(cold),
            nohit_s=summary(nohit),
            host_s=summary(host),
            forward_1_s=summary(fwd),
            host_restore_s=summary(restore),
            forward_1_contiguous_s=summary(_contiguous_forward(cm, ids, runs)),
        )
        for label, cold_cache in (("disk_warm_s", False), ("disk_cold_s", True)):
            ts, restore = [], []
            for _ in range(runs):
                with TieredStore.open(store_dir, host_bytes=0) as store:
                    cm.store = store
                    cm.prefill(ids[:65])  # warm up the code path, not the data (block 0 only)
                    segments = list((store_dir / "segments").glob("*.seg"))
                    if cold_cache:
                        method = drop_page_cache(segments)
                    else:  # read into the page cache now: the store's writes (O_DIRECT) never fill it
                        warm_page_cache(segments)
                    t0 = time.perf_counter()
                    p = cm.prefill(ids)
                    ts.append(time.perf_counter() - t0)
                    restore.append(p.restore_s)
                    assert p.hit.by_tier["disk"] == L, p.hit
            row[label] = summary(ts)
            row[label.replace("_s", "_restore_s")] = summary(restore)
        # the floor's forward is the one over the model's own contiguous cache: what a perfect restore
        # would be followed by (the forward after a restore is measured apart, and may be slower)
        f = row["forward_1_contiguous_s"]["median"]
        row["floor_host_s"] = row["kv_nbytes"] / bw["memcpy"] + f
        row["floor_disk_warm_s"] = row["kv_nbytes"] / bw["page_cache"] + f
        row["floor_disk_cold_s"] = row["kv_nbytes"] / bw["disk_read_limit"] + f
        # the restores alone against their floors: the bytes over the tier's bandwidth, nothing else
        row["restore_floor_s"] = {
            "host": row["kv_nbytes"] / bw["memcpy"],
            "disk_warm": row["kv_nbytes"] / bw["page_cache"],
            "disk_cold": row["kv_nbytes"] / bw["disk_read_limit"],
        }
        rows.append(row)
        shutil.rmtree(store_dir)
    cm.store = None
    params = sum(p.numel() for p in cm.model.parameters())
    return {
        "config": {
            "model": model,
            "model_id": ns.model_id,
            "params": params,
            "layers": ns.num_layers,
            "kv_heads": ns.num_kv_heads,
            "head_dim": ns.head_dim,
            "dtype": ns.dtype,
            "token_kv_nbytes": token_nbytes,
            "block_tokens": ns.block_tokens,
            "runs": runs,
            "threads": torch.get_num_threads(),
            "cold_method": method,
        },
        "bandwidth_Bps": bw,
        "rows": rows,
    }


def markdown(res: dict[str, Any]) -> str:
    c, bw = res["config"], res["bandwidth_Bps"]
    lines = [
        f"Model `{c['model']}` ({c.get('model_id', c['model'])}): {c['params'] / 1e6:.0f}M params, {c['layers']} layers, {c['kv_heads']} KV heads x "
        f"{c['head_dim']}, {c['dtype']}, {c['token_kv_nbytes'] / 1024:.0f} KiB of KV per token; {c['runs']} runs; "
        f"{c['threads']} threads. Bandwidth in this run: memcpy {bw['memcpy'] / 1e9:.1f} GB/s, page-cache read "
        f"{bw['page_cache'] / 1e9:.1f} GB/s, disk limit {bw.get('disk_read_limit', bw.get('odirect', 0.0)) / 1e9:.2f} GB/s; cold cache via "
        f"{c['cold_method']}.",
        "",
        "TTFT medians (ms). In brackets: the ratio to the tier's floor (the KV bytes over the tier's bandwidth "
        "plus the one-token forward over a contiguous cache); `x`: speed-up over the cold prefill. Each model's "
        "bandwidths are measured in its own part of the run.",
        "",
        "| tokens | KV MiB | cold | no-hit (overhead) | host | disk warm | disk cold |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        cold = r["cold_s"]["median"]

        def cell(key: str, floor: str, r: dict = r, cold: float = cold) -> str:
            v = r[key]["median"]
            return f"{v * 1e3:.1f} ({v / r[floor]:.2f}) {cold / v:.0f}x"

        nohit = r["nohit_s"]["median"]
        lines.append(
            f"| {r['tokens']} | {r['kv_nbytes'] / 2**20:.1f} | {cold * 1e3:.0f} | {nohit * 1e3:.0f} "
            f"({100 * (nohit / cold - 1):+.1f}%) | {cell('host_s', 'floor_host_s')} | "
            f"{cell('disk_warm_s', 'floor_disk_warm_s')} | {cell('disk_cold_s', 'floor_disk_cold_s')} |"
        )
    if not any("restore_floor_s" in r for r in res["rows"]):
        return "\n".join(lines)  # a run from before the restore and the forward were timed apart
    lines += [
        "",
        "Restore and forward apart (ms, medians): each restore beside its floor (the KV bytes over that "
        "tier's bandwidth in this run; in brackets the ratio); the one-token forward after a host restore "
        "beside the same forward over the model's own contiguous cache.",
        "",
        "| tokens | host restore | disk warm restore | disk cold restore | forward 1, restored | "
        "forward 1, contiguous |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        if "restore_floor_s" not in r:
            continue
        fl = r["restore_floor_s"]

        def rcell(key: str, tier: str, r: dict = r, fl: dict = fl) -> str:
            v = r[key]["median"]
            return f"{v * 1e3:.1f} / {fl[tier] * 1e3:.1f} ({v / fl[tier]:.2f})"

        lines.append(
            f"| {r['tokens']} | {rcell('host_restore_s', 'host')} | "
            f"{rcell('disk_warm_restore_s', 'disk_warm')} | {rcell('disk_cold_restore_s', 'disk_cold')} | "
            f"{r['forward_1_s']['median'] * 1e3:.1f} | {r['forward_1_contiguous_s']['median'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def beside_seeds(res: dict[str, Any]) -> str:
    """Tokens, cold, hit (the host tier; disk after a restart in brackets) and ratio, beside the seeds' headline."""
    s = SEED_HEADLINE
    lines = [
        "Beside the project's founding headline, a figure given when it began, not measured in this run (a "
        "hit from the host tier; from disk after a restart with the page cache dropped in brackets):",
        "",
        "| | tokens | cold prefill | cache hit | ratio |",
        "|---|---:|---:|---:|---:|",
        f"| the project's founding headline (given, not measured here) | {s['tokens']:,} | {s['cold_s'] * 1e3:,.0f} ms | {s['hit_s'] * 1e3:.0f} ms | "
        f"{s['cold_s'] / s['hit_s']:.0f}x |",
    ]
    for r in res["rows"]:
        cold, host, disk = r["cold_s"]["median"], r["host_s"]["median"], r["disk_cold_s"]["median"]
        lines.append(
            f"| `{res['config']['model']}` | {r['tokens']:,} | {cold * 1e3:,.0f} ms | {host * 1e3:.0f} ms "
            f"({disk * 1e3:.0f} ms) | {cold / host:.0f}x ({cold / disk:.0f}x) |"
        )
    return "\n".join(lines)


__all__ = ["MODELS", "SEED_HEADLINE", "beside_seeds", "default_lengths", "markdown", "run"]
