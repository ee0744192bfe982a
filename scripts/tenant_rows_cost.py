"""What tenant accounting costs the disk tier: durable saves and a full budget's evictions, a tenant's
namespace (with quotas) against a namespace of no tenant, in one run.

    .venv/bin/python scripts/tenant_rows_cost.py [--blocks 2048] [--repeats 5] [--layers 4]

Each repeat: a fresh store with a disk budget of half the blocks, every block saved and flushed (so the
second half evicts the first), timed; the medians and their ratio are printed. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tierkv import TieredStore
from tierkv.keys import Namespace
from tierkv.layout import KVSpec
from tierkv.tenancy import Quota, namespace_salt


def _run(ns: Namespace, quotas: dict[bytes, Quota], blocks: int) -> float:
    spec = KVSpec.of(ns)
    kv = torch.randn(spec.num_layers, 2, 64 * ns.block_tokens, spec.num_kv_heads, spec.head_dim).to(
        spec.dtype
    )
    record = spec.block_nbytes + 4096
    with tempfile.TemporaryDirectory() as d:
        with TieredStore.open(d, host_bytes=0, disk_bytes=blocks // 2 * record, sweep_interval_s=0) as store:
            store.set_quotas(quotas)
            t0 = time.perf_counter()
            for p in range(blocks // 64):  # prompts of 64 blocks
                tokens = [p * 100_000 + t for t in range(64 * ns.block_tokens)]
                store.save(ns, tokens, kv)
                store.flush()
            return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4, help="KV layers (block size: layers x 8 KiB)")
    args = ap.parse_args()
    base = Namespace(
        "cost", "r1", "float16", num_layers=args.layers, num_kv_heads=2, head_dim=64, block_tokens=16
    )
    tenant = base.with_salt(namespace_salt("s" * 32, ""))
    assert tenant.tenant_id is not None
    quotas = {
        tenant.tenant_id: Quota("t", disk_nbytes=1 << 20),
        b"x" * 16: Quota("other", disk_nbytes=1 << 30),
    }
    print(
        f"config: {args.blocks} blocks of {KVSpec.of(base).block_nbytes} B, disk budget half of them, "
        f"{args.repeats} repeats, saved in prompts of 64 blocks, each flushed"
    )
    plain, tenanted = [], []
    for _ in range(args.repeats):  # interleaved, so drift in the machine hits both alike
        plain.append(_run(base, {}, args.blocks))
        tenanted.append(_run(tenant, quotas, args.blocks))
    mp, mt = statistics.median(plain), statistics.median(tenanted)
    print(
        f"no tenant:                  median {mp * 1000:.0f} ms  ({', '.join(f'{x * 1000:.0f}' for x in plain)})"
    )
    print(
        f"tenant above its quota:     median {mt * 1000:.0f} ms  ({', '.join(f'{x * 1000:.0f}' for x in tenanted)})"
    )
    print(f"ratio tenant / no tenant:   {mt / mp:.3f}")


if __name__ == "__main__":
    main()
