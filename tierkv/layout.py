"""The canonical block layout and its sizes.

A block's KV is ``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``: layer-major, so one layer is one
contiguous slice (layer-by-layer restore), token-major inside as paged engines store it.
"""

from __future__ import annotations

import dataclasses

import torch

from tierkv import keys
from tierkv.keys import Namespace

__all__ = ["DTYPES", "DTYPE_NAMES", "KVSpec"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in keys.DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @classmethod
    def of(cls, ns: Namespace) -> KVSpec:
        return cls(ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.block_tokens, DTYPES[ns.dtype])

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.shape(self.block_tokens)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def token_nbytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.token_nbytes * self.block_tokens
