"""The KV the tier benchmarks move: the embedded default model's layout, distinct prompts, one KV tensor
(the tiers, peers, transfer and stall parts share it)."""

from __future__ import annotations

import torch

from tierkv import Namespace
from tierkv.layout import KVSpec

__all__ = ["LARGE_NS", "NS", "PROMPT_TOKENS", "large_workload", "prompts_of", "workload"]

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
# An 8B model's KV layout (Llama 3 8B: 32 layers, 8 KV heads, head dim 128, bfloat16): 128 KiB per token,
# a record of 8 MiB per 64-token block, larger than the native writer's chunk.
LARGE_NS = Namespace(
    model_id="bench-8b",
    revision="0",
    dtype="bfloat16",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    block_tokens=64,
)


def prompts_of(num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    return [[p * 10**6 + t for t in range(prompt_tokens)] for p in range(num_prompts)]


def _kv_of(ns: Namespace, total_nbytes: int, prompt_tokens: int, seed: int) -> tuple[int, torch.Tensor]:
    """How many prompts of ``prompt_tokens`` make about ``total_nbytes`` (at least one) of KV in ``ns``'s
    layout, and the one random KV tensor (``ns``'s dtype) every prompt saves."""
    spec = KVSpec.of(ns)
    kv = torch.randn(
        ns.num_layers,
        2,
        prompt_tokens,
        ns.num_kv_heads,
        ns.head_dim,
        generator=torch.Generator().manual_seed(seed),
    ).to(spec.dtype)
    return max(1, total_nbytes // (prompt_tokens * spec.token_nbytes)), kv


def workload(total_nbytes: int) -> tuple[list[list[int]], torch.Tensor]:
    """About ``total_nbytes`` of KV in NS's layout: distinct prompts (8K tokens each, 1K in quick runs) and
    the one KV tensor every prompt saves."""
    prompt_tokens = PROMPT_TOKENS if total_nbytes >= 96 << 20 else 1024
    num_prompts, kv = _kv_of(NS, total_nbytes, prompt_tokens, seed=0)
    return prompts_of(num_prompts, prompt_tokens), kv


def large_workload(total_nbytes: int) -> tuple[list[list[int]], torch.Tensor]:
    """About ``total_nbytes`` (at least one prompt) of KV in LARGE_NS's layout: prompts of 1,024 tokens,
    none of them one of ``workload``'s."""
    num_prompts, kv = _kv_of(LARGE_NS, total_nbytes, 1024, seed=1)
    return [[10**8 + t for t in toks] for toks in prompts_of(num_prompts, 1024)], kv
