"""Break-even: above which read bandwidth does restoring KV beat recomputing it?

Restoring T tokens costs ``T * kv_bytes_per_token / bandwidth``; recomputing them costs ``T / prefill
throughput``. So restore wins when ``bandwidth > kv_bytes_per_token * throughput`` (the break-even
bandwidth). Long prompts favour restore further (attention grows with context, reads do not): the
numbers here use the throughput measured at ``context`` tokens, or for the computed shapes a throughput
from the GPU's published peak at an assumed model FLOPs utilisation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

# Published dense BF16 tensor peaks (FLOP/s, without sparsity) and memory bandwidth (B/s).
GPUS = {
    "H100-SXM": (989e12, 3.35e12),
    "H200": (989e12, 4.8e12),
    "A100-80GB": (312e12, 2.0e12),
    "L40S": (362e12, 0.864e12),
}
# name: (layers, kv bytes per token per layer in bf16, active parameters)
SHAPES = {
    "Llama-3.2-1B (GQA 8x64)": (16, 2 * 8 * 64 * 2, 1.24e9),
    "Llama-3.1-8B (GQA 8x128)": (32, 2 * 8 * 128 * 2, 8.0e9),
    "Llama-3.1-70B (GQA 8x128)": (80, 2 * 8 * 128 * 2, 70.6e9),
    "DeepSeek-V3 (MLA 512+64)": (61, (512 + 64) * 2, 37e9),
}


def computed(gpu: str = "H200", mfu: float = 0.4, context: int = 8192) -> list[dict[str, Any]]:
    """Break-even bandwidths for well-known shapes: COMPUTED from published numbers, not measured."""
    peak, hbm = GPUS[gpu]
    rows = []
    for name, (layers, kv_layer, params) in SHAPES.items():
        kv_token = layers * kv_layer
        # 2 FLOPs per parameter per token, plus attention over half the context on average.
        flops_token = 2 * params + 2 * layers * context * (kv_layer // 2)
        throughput = peak * mfu / flops_token
        rows.append(
            {
                "shape": name,
                "gpu": gpu,
                "mfu": mfu,
                "context": context,
                "kv_bytes_per_token": kv_token,
                "prefill_flops_per_token": flops_token,
                "prefill_tokens_per_s": throughput,
                "break_even_Bps": kv_token * throughput,
                "hbm_Bps": hbm,
            }
        )
    return rows


def measured(cm: Any, base: Path, context: int = 1024) -> dict[str, Any]:
    """This machine: the model's KV bytes per token and prefill throughput, and the bandwidths."""
    from tierkv.bench.ttft import _bandwidths

    ns = cm.base_namespace
    kv_token = (
        ns.num_layers * 2 * ns.num_kv_heads * ns.head_dim * torch.empty((), dtype=cm.dtype).element_size()
    )
    ids = torch.randint(3, 259, (context,)).tolist()
    cm.prefill(ids[: context // 4], use_cache=False)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        cm.prefill(ids, use_cache=False)
        ts.append(time.perf_counter() - t0)
    throughput = context / sorted(ts)[1]
    params = sum(p.numel() for p in cm.model.parameters())
    bw = _bandwidths(base, 64 << 20)
    be = kv_token * throughput
    return {
        "model": ns.model_id,
        "params": params,
        "dtype": ns.dtype,
        "context": context,
        "kv_bytes_per_token": kv_token,
        "prefill_flops_per_token": 2 * params,
        "prefill_tokens_per_s": throughput,
        "break_even_Bps": be,
        "tiers": {
            "host (memcpy)": bw["memcpy"],
            "disk, warm page cache": bw["page_cache"],
            "disk, cold (its limit)": bw["disk_read_limit"],
        },
        "speedup_bound": {
            k: v / be
            for k, v in {
                "host (memcpy)": bw["memcpy"],
                "disk, warm page cache": bw["page_cache"],
                "disk, cold (its limit)": bw["disk_read_limit"],
            }.items()
        },
    }


def markdown(m: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    lines = []
    if m is not None:
        lines += [
            f"**Measured here** for `{m['model']}` ({m['params'] / 1e6:.0f}M params, {m['dtype']}): "
            f"{m['kv_bytes_per_token'] / 1024:.1f} KiB of KV per token, ~{m['prefill_flops_per_token'] / 1e9:.2f} "
            f"GFLOP per token, prefill {m['prefill_tokens_per_s']:.0f} tokens/s at {m['context']} tokens. "
            f"Restoring beats recomputing above **{m['break_even_Bps'] / 1e6:.1f} MB/s**.",
            "",
            "| tier | bandwidth measured | x break-even (upper bound on the speed-up) |",
            "|---|---:|---:|",
        ]
        for tier, bw in m["tiers"].items():
            lines.append(f"| {tier} | {bw / 1e9:.2f} GB/s | {m['speedup_bound'][tier]:.0f}x |")
        lines.append("")
    if rows:
        r0 = rows[0]
        lines += [
            f"**Computed, not measured**: {r0['gpu']} at {r0['mfu']:.0%} MFU of its published BF16 peak, "
            f"{r0['context']}-token context, BF16 KV.",
            "",
            "| shape | KV per token | prefill tokens/s | break-even bandwidth |",
            "|---|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['shape']} | {r['kv_bytes_per_token'] / 1024:.0f} KiB | {r['prefill_tokens_per_s']:.0f} | "
                f"{r['break_even_Bps'] / 1e9:.2f} GB/s |"
            )
    return "\n".join(lines)


__all__ = ["GPUS", "SHAPES", "computed", "markdown", "measured"]
