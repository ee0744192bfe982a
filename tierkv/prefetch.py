"""Prefetch: a prompt's cached prefix brought from the slower tiers (disk, remote) into the CPU memory tier,
computing nothing, so that the request that follows restores it from memory (``POST /v1/cache/prefetch``,
``tierkv prefetch``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierkv.keys import BlockChain
from tierkv.layout import KVSpec
from tierkv.tiers.pool import BlockPool

if TYPE_CHECKING:
    from tierkv.store import Hit, TieredStore

__all__ = ["prefetch"]


def prefetch(store: TieredStore, chain: BlockChain, chunk_nbytes: int) -> tuple[Hit, Hit]:
    """At most what the CPU memory tier holds is read, in chunks of ``chunk_nbytes`` (the memory this costs
    meanwhile), through ``restore`` (which promotes what it reads into the memory tiers), every cached
    block read even where the planner would compute it (nothing waits for this). Returns where the prefix
    was before and where it is after (``lookup``'s ``Hit``s)."""
    ns = chain.ns
    before = store.lookup(ns, chain)
    pool = next((t for t in store.tiers if isinstance(t, BlockPool) and t.device.type == "cpu"), None)
    if pool is None or before.num_blocks == 0:
        return before, before
    spec = KVSpec.of(ns)
    n = min(before.num_blocks, pool.capacity_nbytes // spec.block_nbytes)
    step = max(1, chunk_nbytes // spec.block_nbytes)
    done = 0
    while done < n:
        end = min(n, done + step)
        # Rows before ``done`` are never written: their pages are never touched (not memory spent).
        out = torch.empty(spec.shape(end * ns.block_tokens), dtype=spec.dtype)
        hit, _ = store.restore(ns, chain.prefix(end), out, start_block=done, plan=False)
        if hit.num_blocks < end:  # a block failed verification (purged): the prefix ends there
            break
        done = end
    return before, store.lookup(ns, chain)
