"""GPU measurements (run by scripts/gpu_check.sh on a lent GPU; nothing here runs without CUDA).

  ring D2H         blocks through the staging ring against torch's own pinned-memory copy
  host tier H2D    a restore's upload from the pinned host pool against torch's pinned copy
  gather           1000 scattered blocks of all layers: one batched call against a loop of copies
  TTFT             a 1B-class Llama in bf16: cold prefill against restore from the host tier, 4K and 16K
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
    return {"torch_d2h_GBps": nbytes / torch_s / 1e9, "ring_d2h_GBps": nbytes / ring_s / 1e9,
            "ring_over_torch": torch_s / ring_s, "pinned_h2d_GBps": nbytes / h2d_s / 1e9}


def gather_vs_loop(num_blocks: int = 1000, layers: int = 16, heads: int = 8, head_dim: int = 128,
                   block_tokens: int = 64) -> dict[str, float]:
    from tierkv import kernels

    T = num_blocks * block_tokens
    keys = [torch.randn(heads, T, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(heads, T, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    starts = (torch.randperm(num_blocks) * block_tokens).cuda()
    out = torch.empty((num_blocks, layers, 2, block_tokens, heads, head_dim), device="cuda", dtype=torch.bfloat16)
    batched = _timed(lambda: kernels.gather_blocks(keys, values, starts, block_tokens, out=out))
    starts_list = starts.tolist()

    def loop() -> None:
        for n, s in enumerate(starts_list):
            for layer in range(layers):
                out[n, layer, 0].copy_(keys[layer][:, s:s + block_tokens].transpose(0, 1))
                out[n, layer, 1].copy_(values[layer][:, s:s + block_tokens].transpose(0, 1))

    looped = _timed(loop, repeat=3)
    return {"backend": kernels.BACKEND, "batched_ms": batched * 1e3, "loop_ms": looped * 1e3,
            "speedup": looped / batched}


def ttft_1b(lengths: tuple[int, ...] = (4096, 16384)) -> list[dict[str, Any]]:
    from tierkv import TieredStore
    from tierkv.default_model import ByteTokenizer, build_default_model
    from tierkv.worker import CachedModel

    cfg = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, max_position_embeddings=32768)
    model = build_default_model(torch.bfloat16, **cfg).cuda()
    rows = []
    for L in lengths:
        ids = torch.randint(3, 259, (L + 1,)).tolist()
        with TieredStore.open(None, host_bytes=L * 16 * 2 * 8 * 64 * 2 + (256 << 20)) as store:
            cm = CachedModel(model, ByteTokenizer(), store, model_id="llama-1b-class")

            hits: list[int] = []
            cold_s = _timed(lambda cm=cm, ids=ids: cm.prefill(ids, use_cache=False), repeat=3)
            cm.prefill(ids)
            warm_s = _timed(lambda cm=cm, ids=ids, hits=hits: hits.append(cm.prefill(ids).hit.num_tokens), repeat=3)
            rows.append({"tokens": L + 1, "cold_ms": cold_s * 1e3, "host_restore_ms": warm_s * 1e3,
                         "speedup": cold_s / warm_s, "restored_tokens": hits[-1]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to measure")
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "ring": ring_vs_torch(),
           "gather": gather_vs_loop(), "ttft": ttft_1b()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(res, indent=2))
    r, g = res["ring"], res["gather"]
    print(f"device {res['device']}, torch {res['torch']}")
    print(f"ring D2H {r['ring_d2h_GBps']:.1f} GB/s vs torch pinned {r['torch_d2h_GBps']:.1f} GB/s "
          f"({r['ring_over_torch']:.2f}x; goal >= 0.8); pinned H2D {r['pinned_h2d_GBps']:.1f} GB/s")
    print(f"gather of 1000 blocks ({g['backend']}): {g['batched_ms']:.2f} ms vs loop {g['loop_ms']:.1f} ms "
          f"({g['speedup']:.0f}x; goal >= 5)")
    for row in res["ttft"]:
        print(f"TTFT {row['tokens']} tokens: cold {row['cold_ms']:.0f} ms, host restore {row['host_restore_ms']:.1f} ms "
              f"({row['speedup']:.1f}x, {row['restored_tokens']} restored)")


if __name__ == "__main__":
    main()
