"""GPU measurements (run by scripts/gpu_check.sh on a lent GPU; nothing here runs without CUDA).

ring D2H         blocks through the staging ring against torch's own pinned-memory copy
restore H2D      a store restore from the pinned host tier into device memory against torch's pinned copy
gather           1000 scattered blocks of all layers: one batched call against a loop of copies
TTFT             a 1B-class Llama in bf16, 4K and 16K: cold prefill against restore from the GPU tier, the
                 host tier and the disk tier (page cache warm); and the cost of saving during a prefill
                 (cache on with no hit against cache off)
telemetry        NVML's memory, utilisation and PCIe figures as tierkv stats and /metrics report them
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def _timed(fn: Any, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def ring_vs_torch(nbytes: int = 1 << 30, block_nbytes: int = 8 << 20) -> dict[str, float]:
    from tierkv.staging import StagingRing

    src = torch.randn(nbytes // 4, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch_s = _timed(lambda: pinned.copy_(src.view(torch.uint8), non_blocking=True))
    ring = StagingRing(16, block_nbytes, device="cuda", on_ready=lambda slot, meta: None, wait_s=10.0)
    blocks = src.view(torch.uint8).view(-1, block_nbytes)

    def through_ring() -> None:
        for b in blocks:
            ring.submit(b, None)
        ring.flush()

    ring_s = _timed(through_ring)
    ring.close()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d_s = _timed(lambda: dev.copy_(pinned, non_blocking=True))
    return {
        "torch_d2h_GBps": nbytes / torch_s / 1e9,
        "ring_d2h_GBps": nbytes / ring_s / 1e9,
        "ring_over_torch": torch_s / ring_s,
        "pinned_h2d_GBps": nbytes / h2d_s / 1e9,
    }


def gather_vs_loop(
    num_blocks: int = 1000, layers: int = 16, heads: int = 8, head_dim: int = 128, block_tokens: int = 64
) -> dict[str, Any]:
    from tierkv import kernels

    T = num_blocks * block_tokens
    keys = [torch.randn(heads, T, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(heads, T, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    starts = (torch.randperm(num_blocks) * block_tokens).cuda()
    out = torch.empty(
        (num_blocks, layers, 2, block_tokens, heads, head_dim), device="cuda", dtype=torch.bfloat16
    )
    batched = _timed(lambda: kernels.gather_blocks(keys, values, starts, block_tokens, out=out))
    starts_list = starts.tolist()

    def loop() -> None:
        for n, s in enumerate(starts_list):
            for layer in range(layers):
                out[n, layer, 0].copy_(keys[layer][:, s : s + block_tokens].transpose(0, 1))
                out[n, layer, 1].copy_(values[layer][:, s : s + block_tokens].transpose(0, 1))

    looped = _timed(loop, repeat=3)
    return {
        "backend": kernels.BACKEND,
        "batched_ms": batched * 1e3,
        "loop_ms": looped * 1e3,
        "speedup": looped / batched,
    }


def _bench_ns() -> Any:
    """The 1B-class model's KV layout (16 layers, 8 KV heads of 64, bf16): 32 KiB per token."""
    from tierkv import Namespace

    return Namespace(
        model_id="bench",
        revision="r",
        dtype="bfloat16",
        num_layers=16,
        num_kv_heads=8,
        head_dim=64,
        block_tokens=64,
    )


def restore_h2d(nbytes: int = 1 << 30) -> dict[str, float]:
    """Host-tier hits restored into device memory (pinned slots, DMA) against torch's pinned H2D copy."""
    from tierkv import TieredStore

    ns = _bench_ns()
    tokens = nbytes // (16 * 2 * 8 * 64 * 2)
    ids = list(range(tokens))
    kv = torch.randn(16, 2, tokens, 8, 64, dtype=torch.bfloat16)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch_s = _timed(lambda: dev.copy_(pinned, non_blocking=True))
    with TieredStore.open(None, host_bytes=nbytes + (64 << 20)) as store:
        store.save(ns, ids, kv)
        out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
        hit, got = store.restore(ns, ids, out=out)
        assert got is not None and hit.by_tier["host"] == tokens and torch.equal(got.cpu(), kv), (
            "restore is not exact"
        )
        restore_s = _timed(lambda: store.restore(ns, ids, out=out))
    return {
        "torch_h2d_GBps": nbytes / torch_s / 1e9,
        "restore_h2d_GBps": nbytes / restore_s / 1e9,
        "restore_over_torch": torch_s / restore_s,
    }


def ttft_1b(lengths: tuple[int, ...] = (4096, 16384), profile: bool = False) -> list[dict[str, Any]]:
    import tempfile

    from tierkv import TieredStore
    from tierkv.bench.machine import drop_page_cache
    from tierkv.default_model import ByteTokenizer, build_default_model
    from tierkv.tiers.pool import BlockPool
    from tierkv.worker import CachedModel

    cfg: dict[str, Any] = dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=32768,
    )
    model = build_default_model(torch.bfloat16, **cfg).cuda()
    tok = ByteTokenizer()

    def timed_prefill(
        row: dict[str, Any], name: str, prefill: Any, repeat: int = 3, between: Any = None
    ) -> Any:
        """``row[name_ms]`` the median prefill, with its restore and forward parts; returns the last.
        ``between``: called before each prefill, untimed."""
        total, parts, res = [], [], None
        for k in range(repeat + 1):
            if between is not None:
                between()
            t0 = time.perf_counter()
            res = prefill()
            torch.cuda.synchronize()
            if k:  # the first is a warm-up
                total.append(time.perf_counter() - t0)
                parts.append((res.restore_s, res.forward_s))
        mid = sorted(range(repeat), key=lambda i: total[i])[repeat // 2]
        row[f"{name}_ms"] = total[mid] * 1e3
        row[f"{name}_restore_ms"], row[f"{name}_forward_ms"] = (x * 1e3 for x in parts[mid])
        return res

    rows = []
    for L in lengths:
        kv_nbytes = L * 16 * 2 * 8 * 64 * 2
        ids = torch.randint(3, 259, (L + 1,)).tolist()
        row: dict[str, Any] = {"tokens": L + 1, "kv_MiB": kv_nbytes / 2**20}
        with tempfile.TemporaryDirectory(dir=".") as d:  # on the disk (/tmp may be RAM)
            with TieredStore.open(d, host_bytes=kv_nbytes + (256 << 20)) as store:
                store.add_gpu_tier(kv_nbytes + (256 << 20), "cuda")
                cm = CachedModel(model, tok, store, model_id="llama-1b-class")
                timed_prefill(row, "cold", lambda cm=cm, ids=ids: cm.prefill(ids, use_cache=False))
                # Saving during a prefill: cache on, no hit (a new prompt each time) against cache off,
                # back to back (the worst case: the host and disk tiers absorb KV slower than this makes it).
                fresh = iter([torch.randint(3, 259, (L + 1,)).tolist() for _ in range(8)])
                timed_prefill(row, "save", lambda cm=cm, fresh=fresh: cm.prefill(next(fresh)))
                row["save_overhead"] = row["save_ms"] / row["cold_ms"] - 1
                # The same with the previous save's write-behind finished first: the save's own cost,
                # without the background work of the one before.
                timed_prefill(
                    row,
                    "save_spaced",
                    lambda cm=cm, fresh=fresh: cm.prefill(next(fresh)),
                    between=store.flush,
                )
                if profile:  # where the model thread's time goes in one more such prefill
                    _profiled(lambda cm=cm, L=L: cm.prefill(torch.randint(3, 259, (L + 1,)).tolist()))
                store.flush()
                snap = store.stats()
                row["save_dropped_blocks"] = snap.get("staging", {}).get("dropped_saves", 0)
                row["save_blocks"] = 8 * (L // 64)
                cm.prefill(ids)
                store.flush()
                res = timed_prefill(row, "gpu", lambda cm=cm, ids=ids: cm.prefill(ids))
                assert res.hit.by_tier["gpu"] == L, res.hit.by_tier
                gpu = store.tier("gpu")
                assert isinstance(gpu, BlockPool)
                res = timed_prefill(
                    row, "host", lambda cm=cm, ids=ids, gpu=gpu: (gpu.clear(), cm.prefill(ids))[1]
                )
                assert res.hit.by_tier["host"] == L, res.hit.by_tier
                store.flush()
            with TieredStore.open(d, host_bytes=0) as store:  # the disk tier, page cache warm
                cm = CachedModel(model, tok, store, model_id="llama-1b-class")
                res = timed_prefill(row, "disk_warm", lambda cm=cm, ids=ids: cm.prefill(ids))
                assert res.hit.by_tier["disk"] == L, res.hit.by_tier
            # After a restart with the page cache dropped: the store's open, the model's wrapper (it
            # fingerprints the weights) and the first prefill, each timed.
            cold: list[tuple[float, float, float]] = []
            for _ in range(3):
                row["cold_method"] = drop_page_cache([p for p in Path(d).rglob("*") if p.is_file()])
                t0 = time.perf_counter()
                with TieredStore.open(d, host_bytes=0) as store:
                    t1 = time.perf_counter()
                    cm = CachedModel(model, tok, store, model_id="llama-1b-class")
                    t2 = time.perf_counter()
                    res = cm.prefill(ids)
                    torch.cuda.synchronize()
                    assert res.hit.by_tier["disk"] == L, res.hit.by_tier
                    cold.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            open_s, wrap_s, first_s = sorted(cold, key=lambda c: c[2])[1]
            row["restart_open_ms"], row["restart_wrap_ms"] = open_s * 1e3, wrap_s * 1e3
            row["disk_cold_ms"] = first_s * 1e3
            row["disk_cold_GBps"] = kv_nbytes / first_s / 1e9
        rows.append(row)
    return rows


def _profiled(fn: Any) -> None:
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue()[:5000])


def save_drain(nbytes: int = 1 << 30) -> dict[str, float]:
    """How fast saved blocks leave the GPU into the host tier, and into host and disk: ``save_blocks`` of
    device blocks (returns once the copies are queued), then ``flush`` (every block kept)."""
    import tempfile

    from tierkv import TieredStore

    ns = _bench_ns()
    nblocks = nbytes // (16 * 2 * 64 * 8 * 64 * 2)
    blocks = torch.randn(nblocks, 16, 2, 64, 8, 64, device="cuda").to(torch.bfloat16)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=".") as d:
        for name, path in (("host", None), ("host_disk", d)):
            with TieredStore.open(path, host_bytes=2 * nbytes + (64 << 20)) as store:
                for _k in range(2):  # the first makes the ring and populates the host tier's slots
                    ids = torch.randint(3, 259, (nblocks * 64,)).tolist()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    store.save_blocks(ns, ids, blocks)
                    t1 = time.perf_counter()
                    store.flush()
                    t2 = time.perf_counter()
                out[f"{name}_submit_ms"] = (t1 - t0) * 1e3
                out[f"{name}_drain_GBps"] = nbytes / (t2 - t0) / 1e9
                out[f"{name}_dropped"] = store.stats().get("staging", {}).get("dropped_saves", 0)
    return out


def _show_drain(r: dict[str, float]) -> None:
    print(
        f"save 1 GiB    into host {r['host_drain_GBps']:.1f} GB/s (submit {r['host_submit_ms']:.1f} ms), "
        f"host+disk {r['host_disk_drain_GBps']:.1f} GB/s (submit {r['host_disk_submit_ms']:.1f} ms); "
        f"dropped {r['host_dropped']:.0f}, {r['host_disk_dropped']:.0f}"
    )


def disk_read_limit(nbytes: int = 1 << 30) -> dict[str, float]:
    """The disk's best raw sequential read (O_DIRECT and buffered cold), for the cold restore's ratio."""
    import tempfile

    from tierkv.bench.disk_limits import raw_writes, sequential_read_limit

    with tempfile.TemporaryDirectory(dir=".") as d:
        path = Path(d) / "raw"
        raw_writes(path, nbytes, 1)
        return {"read_limit_GBps": sequential_read_limit(path, nbytes, 3) / 1e9}


def _show_disk(r: dict[str, float]) -> None:
    print(f"disk read limit {r['read_limit_GBps']:.2f} GB/s (best raw sequential read, this run)")


def _show_ring(r: dict[str, float]) -> None:
    print(
        f"ring D2H      {r['ring_d2h_GBps']:6.1f} GB/s vs torch pinned {r['torch_d2h_GBps']:.1f} GB/s "
        f"({r['ring_over_torch']:.2f}x; goal >= 0.8)"
    )


def _show_restore(h: dict[str, float]) -> None:
    print(
        f"restore H2D   {h['restore_h2d_GBps']:6.1f} GB/s vs torch pinned {h['torch_h2d_GBps']:.1f} GB/s "
        f"({h['restore_over_torch']:.2f}x; goal >= 0.8)"
    )


def _show_gather(g: dict[str, Any]) -> None:
    print(
        f"gather 1000 blocks ({g['backend']}): {g['batched_ms']:.2f} ms vs loop {g['loop_ms']:.1f} ms "
        f"({g['speedup']:.0f}x; goal >= 5)"
    )


def _show_ttft(rows: list[dict[str, Any]]) -> None:
    print("prefill ms (restore + forward): ")
    for row in rows:
        print(
            f"{row['tokens']:6d}  "
            + "  ".join(
                f"{k} {row[k + '_ms']:.1f} ({row[k + '_restore_ms']:.1f}+{row[k + '_forward_ms']:.1f})"
                for k in ("cold", "save", "save_spaced", "gpu", "host", "disk_warm")
            )
            + f"  restart: open {row['restart_open_ms']:.0f} wrap {row['restart_wrap_ms']:.0f}"
            + f"  save dropped {row['save_dropped_blocks']} of {row['save_blocks']} blocks"
        )
    print(
        "tokens  cold ms  gpu ms  host ms  disk(warm) ms  disk(cold, restart) ms  save overhead (goal <= 3%)"
    )
    for row in rows:
        print(
            f"{row['tokens']:6d}  {row['cold_ms']:7.1f}  {row['gpu_ms']:6.1f}  {row['host_ms']:7.1f}  "
            f"{row['disk_warm_ms']:13.1f}  {row['disk_cold_ms']:8.1f} ({row['disk_cold_GBps']:.2f} GB/s, "
            f"{row['cold_method']})  {100 * row['save_overhead']:+.1f}%"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu")
    ap.add_argument("--only", default="ring,restore,gather,ttft,drain,disk", help="comma-separated parts")
    ap.add_argument("--lengths", default="4096,16384", help="ttft: prompt lengths")
    ap.add_argument("--profile", action="store_true", help="ttft: profile one saving prefill")
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        help="Python's GIL switch interval (default 5 ms): how long a thread waiting for the GIL lets "
        "a thread running Python keep it (the model thread against the write-behind's threads)",
    )
    args = ap.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if args.switch_interval_ms is not None:
        import sys

        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to measure")
    import dataclasses

    from tierkv.telemetry import gpu_telemetry

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    res["switch_interval_ms"] = __import__("sys").getswitchinterval() * 1e3
    print(f"device {res['device']}, torch {res['torch']}")
    # Each part on its own: one that fails (the first run on a new machine) must not lose the others.
    for name, part, show in (
        ("ring", ring_vs_torch, _show_ring),
        ("restore", restore_h2d, _show_restore),
        ("gather", gather_vs_loop, _show_gather),
        ("ttft", lambda: ttft_1b(lengths, args.profile), _show_ttft),
        ("drain", save_drain, _show_drain),
        ("disk", disk_read_limit, _show_disk),
    ):
        if name not in args.only.split(","):
            continue
        try:
            res[name] = part()
            show(res[name])
        except Exception as exc:
            res[name] = {"error": repr(exc)}
            print(f"{name}: FAILED {exc!r}")
        (out / "gpu.json").write_text(json.dumps(res, indent=2))
    res["telemetry"] = [dataclasses.asdict(g) for g in gpu_telemetry()]
    (out / "gpu.json").write_text(json.dumps(res, indent=2))
    for t in res["telemetry"]:
        print(
            f"NVML gpu {t['index']}: {t['memory_used_nbytes'] / 2**30:.1f} of {t['memory_total_nbytes'] / 2**30:.1f} GiB, "
            f"busy {t['utilization_gpu_pct']}%, PCIe {t['pcie_tx_Bps'] / 1e9:.2f} GB/s out, "
            f"{t['pcie_rx_Bps'] / 1e9:.2f} GB/s in"
        )


__all__ = [
    "disk_read_limit",
    "gather_vs_loop",
    "save_drain",
    "main",
    "restore_h2d",
    "ring_vs_torch",
    "ttft_1b",
]


if __name__ == "__main__":
    main()
