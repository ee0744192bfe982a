"""After a restore: the restored blocks reach the faster tiers, and the slower tiers hear of their use.

promoter   a callback for ``Target.on_verified``: each block a record tier (disk, remote) read and
           verified goes into the CPU memory tiers above it on the reading thread, while its bytes
           are in cache (no second pass over the restored KV)
spread     what is left once the reads are done: blocks not promoted into the memory tiers, record
           tiers that want a block written back, slower tiers refreshing blocks served from above
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from tierkv.keys import BlockChain, BlockKey
from tierkv.tiers.base import Tier
from tierkv.tiers.pool import BlockPool
from tierkv.tiers.target import Sink
from tierkv.write_behind import WriteBehind

log = logging.getLogger("tierkv.store")

__all__ = ["Promoter", "blocks_on", "promoter", "runs_of", "spread"]


def runs_of(src: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(tier, first, end)`` runs of consecutive blocks served by the same tier."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(src) + 1):  # a run ends where the tier changes (one tuple per run, not per block)
        if i == len(src) or src[i] != src[start]:
            runs.append((src[start], start, i))
            start = i
    return runs


def blocks_on(
    device: torch.device, dest: torch.Tensor | Sink, idx: Sequence[int], B: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Blocks ``idx`` of ``dest`` on ``device``: from another device, one copy per run of consecutive
    blocks (not a synchronous copy per block under a pool's lock); from a sink, its copy of each."""
    if not isinstance(dest, torch.Tensor):
        yield from ((i, dest.block(i).to(device)) for i in idx)
        return
    if dest.device == device:
        yield from ((i, dest[:, :, i * B : (i + 1) * B]) for i in idx)
        return
    for _, a, b in runs_of([i - j for j, i in enumerate(idx)]):  # equal within a run of consecutive blocks
        first = idx[a]
        part = dest[:, :, first * B : (idx[b - 1] + 1) * B].to(device)
        yield from ((i, part[:, :, (i - first) * B : (i - first + 1) * B]) for i in idx[a:b])


class Promoter:
    """Puts each block a record tier read and verified into the CPU memory tiers above it, on the
    reading thread while its bytes are in cache: no second pass over the restored KV afterwards. Called
    per block (``promote(i, block)``), or per run (``run(buf, idx, base)``: one batched copy a pool)."""

    def __init__(
        self,
        pools: list[tuple[int, BlockPool]],
        chain: BlockChain,
        src: Sequence[int],
        start: int,
        created_s: dict[int, float],
        promoted: set[int],
        live: Callable[[BlockKey], bool],
        populated_only: bool = True,
    ) -> None:
        self.pools, self.chain, self.src, self.start = pools, chain, src, start
        self.created_s, self.promoted = created_s, promoted
        self.live = live  # the restore's generation: a block purged since it began is not promoted
        self.populated_only = populated_only

    def __call__(self, i: int, block: torch.Tensor) -> None:
        above = self._above(i)
        try:  # never waits for the pool (a large save may hold it): then spread puts it later
            if above and all(
                t.put(
                    self.chain.keys[i],
                    block,
                    created_s=self.created_s.get(i),
                    wait=False,
                    tenant=self.chain.ns.tenant_id,
                    live=functools.partial(self.live, self.chain.keys[i]),
                    populated_only=self.populated_only,  # see BlockPool._populated
                )
                is not None
                for t in above
            ):
                self.promoted.add(i)
        except Exception:  # a promotion is an optimisation: it must not fail the read
            log.exception("promoting a block into a memory tier failed")

    def run(self, buf: torch.Tensor, idx: Sequence[int], base: int) -> None:
        """Blocks ``idx`` of a restore, at block positions ``i - base`` of ``buf``."""
        groups: dict[int, list[int]] = {}
        for i in idx:  # by source tier (one, for a run read from one tier)
            groups.setdefault(self.src[i - self.start], []).append(i)
        B = self.chain.ns.block_tokens
        for k, ids in groups.items():
            above = [t for j, t in self.pools if j < k]
            if not above:
                continue
            try:
                held = [True] * len(ids)
                for t in above:
                    got = t.put_run(
                        [self.chain.keys[i] for i in ids],
                        buf,
                        [i - base for i in ids],
                        B,
                        [self.created_s.get(i) for i in ids],
                        wait=False,
                        tenant=self.chain.ns.tenant_id,
                        live=self.live,
                        populated_only=self.populated_only,  # see BlockPool._populated
                    )
                    held = [h and g for h, g in zip(held, got)]
                self.promoted.update(i for i, h in zip(ids, held) if h)
            except Exception:  # a promotion is an optimisation: it must not fail the read
                log.exception("promoting blocks into a memory tier failed")

    def _above(self, i: int) -> list[BlockPool]:
        k = self.src[i - self.start]
        return [t for j, t in self.pools if j < k]


def promoter(
    tiers: Sequence[Tier],
    chain: BlockChain,
    src: Sequence[int],
    start: int,
    created_s: dict[int, float],
    promoted: set[int],
    live: Callable[[BlockKey], bool],
    populated_only: bool = True,
) -> Promoter | None:
    """The restore's promoter into the CPU memory tiers, or None when there are none. ``populated_only``:
    into populated slots only (``BlockPool._populated``)."""
    pools = [(j, t) for j, t in enumerate(tiers) if isinstance(t, BlockPool) and t.device.type == "cpu"]
    if not pools:
        return None
    return Promoter(pools, chain, src, start, created_s, promoted, live, populated_only)


def spread(
    tiers: Sequence[Tier],
    writes: WriteBehind,
    chain: BlockChain,
    src: Sequence[int],
    dest: torch.Tensor | Sink,
    created_s: dict[int, float],
    start: int = 0,
    promoted: set[int] | frozenset[int] = frozenset(),
    memory_only: bool = False,
    *,
    live: Callable[[BlockKey], bool],
    populated_only: bool = True,
) -> None:
    """After a restore: blocks read from a slower tier are written into the faster ones (memory tiers
    now, so the next request hits there; record tiers behind, unless ``memory_only``); slower tiers
    refresh the blocks served from above and get back those they lost. ``live``: the restore's liveness
    (``Generations.liveness``), checked as a memory tier publishes a block: one purged since is not put back."""
    B = chain.ns.block_tokens
    wants: dict[Tier, list[int]] = {}
    for j, tier in enumerate(tiers):
        below = [start + i for i, k in enumerate(src) if k > j]  # read from a slower tier
        above = [start + i for i, k in enumerate(src) if k < j]
        if isinstance(tier, BlockPool):
            if tier.device.type == "cpu":
                below = [i for i in below if i not in promoted]  # those were put as they came in
            on = dest.device if isinstance(dest, torch.Tensor) else torch.device("cpu")
            if below and (tier.device == on or tier.device.type == "cpu"):
                for i, block in blocks_on(tier.device, dest, below, B):
                    tier.put(
                        chain.keys[i],
                        block,
                        created_s=created_s.get(i),
                        tenant=chain.ns.tenant_id,
                        live=functools.partial(live, chain.keys[i]),
                        populated_only=populated_only,  # see BlockPool._populated
                    )
            continue
        wanted = (
            [i for i, w in zip(below, tier.needs(chain, below)) if w] if below and not memory_only else []
        )
        wanted = sorted(set(wanted) | set(tier.served_above(chain, above)))
        if wanted and not memory_only:
            wants[tier] = wanted
    if wants:
        if isinstance(dest, torch.Tensor):
            kv = dest

            def restored(i: int) -> torch.Tensor:
                return kv[:, :, i * B : (i + 1) * B]

        else:
            restored = dest.block
        writes.write_back(chain, wants, restored, created_s)
