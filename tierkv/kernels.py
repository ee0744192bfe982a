"""Batched gather and scatter of KV blocks between a model's per-layer caches and the canonical layout.

One call moves N scattered blocks of all layers: ``gather_blocks`` builds ``[N, layers, 2, block_tokens,
kv_heads, head_dim]`` from per-layer ``[kv_heads, tokens, head_dim]`` key and value tensors, and
``scatter_blocks`` writes such blocks back. The torch implementation issues 2 x layers indexed copies
(not N x layers small ones); the optional CUDA extension (``cuda_ext/``) does it in one launch. It is
built ahead with ``TIERKV_BUILD_CUDA=1 pip install -e . --no-build-isolation``, or compiled at first import
with ``TIERKV_CUDA_JIT=1`` (torch's cpp_extension, cached under ~/.cache/torch_extensions). Both have this
interface; which one runs is logged once, at import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["BACKEND", "SOURCE", "gather_blocks", "scatter_blocks"]

log = logging.getLogger("tierkv.kernels")

SOURCE = Path(__file__).resolve().parent.parent / "cuda_ext" / "gather_scatter.cu"


def _load_extension() -> tuple[Any, str]:
    try:  # built only on request, on a CUDA machine: never required
        from tierkv import _cuda_ext

        return _cuda_ext, "cuda_ext (built)"
    except ImportError:
        pass
    if os.environ.get("TIERKV_CUDA_JIT") == "1" and torch.cuda.is_available() and SOURCE.exists():
        try:
            from torch.utils.cpp_extension import load

            t0 = time.perf_counter()
            ext = load("tierkv_cuda_ext", [str(SOURCE)])
            return ext, f"cuda_ext (compiled in {time.perf_counter() - t0:.1f} s)"
        except Exception as exc:  # no nvcc, a compiler error: the fallback is correct, only slower
            log.warning("could not compile %s: %s", SOURCE, exc)
    return None, "torch"


_cuda_ext, _how = _load_extension()
BACKEND = "cuda_ext" if _cuda_ext is not None else "torch"
log.info("block gather/scatter: %s", _how)


def _starts_tensor(block_starts: torch.Tensor | range, device: torch.device) -> torch.Tensor:
    if isinstance(block_starts, range):
        return torch.arange(block_starts.start, block_starts.stop, block_starts.step, device=device)
    return block_starts.to(device, torch.long)


def _as_slice(block_starts: torch.Tensor | range, block_tokens: int) -> slice | None:
    """The token slice of consecutive blocks given as a range (then no index is built at all)."""
    if isinstance(block_starts, range) and block_starts.step == block_tokens:
        return slice(block_starts.start, block_starts.start + len(block_starts) * block_tokens)
    return None


def _token_index(block_starts: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """[N * block_tokens] token positions of the blocks, in block order."""
    offsets = torch.arange(block_tokens, device=block_starts.device)
    return (block_starts.to(torch.long)[:, None] + offsets[None, :]).reshape(-1)


def gather_blocks(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    block_starts: torch.Tensor | range,
    block_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocks starting at ``block_starts`` (token offsets; a ``range`` for consecutive blocks) of every
    layer, canonical layout ``[N, layers, 2, block_tokens, kv_heads, head_dim]``.

    ``keys[l]`` / ``values[l]``: ``[kv_heads, tokens, head_dim]`` (a batch-1 cache without its batch dim).
    """
    L = len(keys)
    H, _, D = keys[0].shape
    N = len(block_starts) if isinstance(block_starts, range) else block_starts.numel()
    if out is None:
        out = torch.empty((N, L, 2, block_tokens, H, D), dtype=keys[0].dtype, device=keys[0].device)
    if _cuda_ext is not None and keys[0].is_cuda and (D * keys[0].element_size()) % 2 == 0:
        _cuda_ext.gather(
            list(keys), list(values), _starts_tensor(block_starts, keys[0].device), block_tokens, out
        )
        return out
    span = _as_slice(block_starts, block_tokens)
    idx = _token_index(_starts_tensor(block_starts, keys[0].device), block_tokens) if span is None else None
    for layer in range(L):
        for kv, src in ((0, keys[layer]), (1, values[layer])):
            picked = src[:, span] if idx is None else src.index_select(1, idx)
            out[:, layer, kv].copy_(picked.view(H, N, block_tokens, D).permute(1, 2, 0, 3))  # -> [N, B, H, D]
    return out


def scatter_blocks(
    blocks: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    block_starts: torch.Tensor | range,
) -> None:
    """Write canonical ``blocks`` ``[N, layers, 2, block_tokens, kv_heads, head_dim]`` into the caches."""
    N, L, _, B, H, D = blocks.shape
    if _cuda_ext is not None and blocks.is_cuda and (D * blocks.element_size()) % 2 == 0:
        _cuda_ext.scatter(blocks, list(keys), list(values), _starts_tensor(block_starts, blocks.device))
        return
    idx = _token_index(_starts_tensor(block_starts, blocks.device), B)
    for layer in range(L):
        for kv, dst in ((0, keys[layer]), (1, values[layer])):
            src = blocks[:, layer, kv].permute(2, 0, 1, 3).reshape(H, N * B, D)  # [H, N*B, D]
            dst.index_copy_(1, idx, src)
