"""Finding and restoring a prompt's longest cached prefix (``TieredStore`` inherits these): each block
from the fastest tier that holds it, memory tiers first, verified by the tier that read it; a run read
from a slower tier is promoted into the host tier as it comes, then ``spread`` writes it where it is
missing. A prefix ends at the first block no tier holds or the first that fails verification.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import torch

from tierkv.errors import ConfigError
from tierkv.keys import BlockChain, Namespace
from tierkv.layout import KVSpec
from tierkv.metrics import Counters
from tierkv.open_calls import while_open
from tierkv.planner import RestorePlanner
from tierkv.spread import promoter, runs_of, spread
from tierkv.tiers import prefault
from tierkv.tiers.base import Tier
from tierkv.tiers.target import Sink, Stagers
from tierkv.write_behind import WriteBehind

__all__ = ["Hit", "StoreRestores", "Tokens"]


@dataclasses.dataclass(frozen=True)
class Hit:
    """How much of a prompt is cached: ``num_tokens`` in all, ``by_tier`` tokens from each tier."""

    num_tokens: int
    by_tier: dict[str, int]
    num_blocks: int = 0
    restore_s: float = 0.0


Tokens = Sequence[int] | np.ndarray | BlockChain  # a prompt's token ids, or its chain if already made


def _chain(ns: Namespace, tokens: Tokens) -> BlockChain:
    if isinstance(tokens, BlockChain):
        if tokens.ns != ns:
            raise ConfigError("the block chain was made for another namespace")
        return tokens
    return BlockChain.of(ns, tokens)


def _model_key(ns: Namespace) -> str:
    """A model's prefill speed is one for all its tenants (the salt changes names, not costs)."""
    return f"{ns.model_id}@{ns.revision}/{ns.dtype}/{ns.num_layers}x{ns.num_kv_heads}x{ns.head_dim}"


class StoreRestores:
    # ``TieredStore``'s state, used here
    tiers: list[Tier]
    counters: Counters
    writes: WriteBehind
    planner: RestorePlanner
    _stagers: Stagers

    @property
    def tier_names(self) -> list[str]:
        raise NotImplementedError

    def _check_kv(self, ns: Namespace, kv: torch.Tensor, min_tokens: int) -> None:
        raise NotImplementedError

    def _sources(self, chain: BlockChain, start: int = 0) -> list[int]:
        """Per block ``start + j`` of the cached run from ``start``, the index of the fastest tier holding
        it (the run ends at the first block no tier holds)."""
        src: dict[int, int] = {}
        todo = list(range(start, len(chain)))
        for k, tier in enumerate(self.tiers):
            if not todo:
                break
            for i, has in zip(todo, tier.probe(chain, todo)):
                if has:
                    src[i] = k
            todo = [i for i in todo if i not in src]
        n = next((i for i in range(start, len(chain)) if i not in src), len(chain))
        return [src[i] for i in range(start, n)]

    @while_open
    def lookup(self, ns: Namespace, token_ids: Tokens) -> Hit:
        """How many leading tokens are cached, and where. Reads no payload, changes nothing."""
        chain = _chain(ns, token_ids)
        src = self._sources(chain.prefix(self.writes.gens.usable(chain)))  # not what a purge is removing
        by_tier = {t.name: sum(k == j for k in src) * ns.block_tokens for j, t in enumerate(self.tiers)}
        return Hit(len(src) * ns.block_tokens, by_tier, len(src))

    @while_open
    def refresh(self, ns: Namespace, token_ids: Tokens, num_blocks: int) -> None:
        """Blocks ``0..num_blocks-1`` were just used from the engine's own cache: kept recent in every tier,
        as a restore keeps what it reads (each tier's LRU, the disk's sliding TTL). Without it the prefix
        used most, which the engine holds and never asks for, would be the first to leave. Reads no
        payload; a block a tier lacks stays missing there."""
        chain = _chain(ns, token_ids).prefix(num_blocks)
        for tier in self.tiers:
            tier.served_above(chain, range(len(chain)))

    def load(
        self, ns: Namespace, token_ids: Tokens, out: torch.Tensor | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """The KV of the longest verified cached prefix: ``(num_tokens, kv[:, :, :num_tokens])``.

        ``out`` (``[layers, 2, >= tokens, kv_heads, head_dim]``, any device) is filled in place if given,
        saving an allocation; past the returned prefix its content is unspecified (a block that failed
        verification may have been read into it). Returns ``(0, None)`` on a miss.
        """
        hit, kv = self.restore(ns, token_ids, out)
        return hit.num_tokens, kv

    @while_open
    def restore(
        self,
        ns: Namespace,
        token_ids: Tokens,
        out: torch.Tensor | Sink | None = None,
        *,
        start_block: int = 0,
        memory_only: bool = False,
        plan: bool = True,
    ) -> tuple[Hit, torch.Tensor | None]:
        """Like ``load``, with the ``Hit`` (tokens per tier, restore time).

        ``out`` may be a ``Sink`` (an engine's pages, ``tiers.target``): the blocks are handed to it as they
        are restored, and no tensor is returned.

        ``start_block`` > 0: the caller holds blocks ``0..start_block-1`` already (an engine's own prefix
        cache); they are neither probed nor read, and ``out``'s rows for them are left as they are. The
        hit then still counts from token 0 (``num_blocks`` = ``start_block`` + the blocks read;
        ``by_tier`` only the blocks read), and is a miss when not even block ``start_block`` is cached.
        ``memory_only``: what was restored is written back to the memory tiers only (a request keeping
        its prompt out of the disk, ``Retention.memory_only``). ``plan=False``: read every cached block,
        even where the planner judges computing it faster, and promote into the memory tiers' slots even
        where their pages are still to be populated (a prefetch, off any request's path: a request's
        restore leaves those to the populator, ``BlockPool._populated``).
        """
        t0 = time.perf_counter()
        chain = _chain(ns, token_ids)
        B = ns.block_tokens
        by_tier = dict.fromkeys(self.tier_names, 0)
        if isinstance(out, torch.Tensor):
            self._check_kv(ns, out, 0)
            chain = chain.prefix(out.shape[2] // B)
        elif out is not None:
            if out.spec != KVSpec.of(ns):
                raise ConfigError(f"the sink holds {out.spec}, not the namespace's {KVSpec.of(ns)}")
            chain = chain.prefix(out.num_blocks)
        if not 0 <= start_block <= len(chain):
            raise ConfigError(f"start_block {start_block} must be in 0..{len(chain)} (the prompt's blocks)")
        if start_block and out is None:
            raise ConfigError(
                "restore with start_block needs out (the caller's rows for the blocks it holds)"
            )
        if start_block:  # the blocks the caller holds were just used too: keep them alive here
            self.refresh(ns, chain, start_block)
        if len(chain) == start_block:
            return Hit(0, by_tier), None
        for tier in self.tiers:
            tier.requested(chain)
        with self.writes.gens.reading(chain) as usable, prefault.foreground():
            # A purge or invalidation in progress waits for this restore; the blocks it names are misses.
            # A host tier being populated behind waits too (its populator yields to restores).
            return self._restore(
                chain, start_block, max(usable, start_block), out, by_tier, t0, memory_only, plan
            )

    def _restore(
        self,
        chain: BlockChain,
        start_block: int,
        usable: int,
        out: torch.Tensor | Sink | None,
        by_tier: dict[str, int],
        t0: float,
        memory_only: bool = False,
        plan: bool = True,
    ) -> tuple[Hit, torch.Tensor | None]:
        ns = chain.ns
        spec = KVSpec.of(ns)
        B = ns.block_tokens
        src = self._sources(chain.prefix(usable), start_block)
        if src and plan:  # restore or recompute: reading a slow tier's run may cost more than computing it
            keep = self.planner.cut(
                _model_key(ns),
                [self.tiers[k].name for k in src],
                spec.block_nbytes,
                B,
                memory={t.name for t in self.tiers if t.memory},
            )
            if keep < len(src):
                self.counters.add("store", "recomputed_blocks", len(src) - keep)
                src = src[:keep]
        if not src:
            self.counters.add("store", "miss_blocks", len(chain) - start_block)
            return Hit(0, by_tier), None
        n = start_block + len(src)
        dest = out if out is not None else torch.empty(spec.shape(n * B), dtype=spec.dtype)
        promoted: set[int] = set()
        runs = [(k, first + start_block, end + start_block) for k, first, end in runs_of(src)]
        # Memory tiers first: they hold the slots they read until the restore is over, so the blocks
        # promoted into them from the slower tiers cannot evict what this restore still has to read.
        order = sorted(runs, key=lambda run: not self.tiers[run[0]].memory)
        with self._stagers.target(dest, spec) as target:
            live = self.writes.gens.liveness(ns.digest)  # of this restore's generation
            promote = promoter(
                self.tiers, chain, src, start_block, target.created_s, promoted, live, populated_only=plan
            )
            if promote is not None:
                target.on_verified, target.on_verified_run = promote, promote.run
            for k, first, end in order:
                if first >= n:
                    continue  # past a block that did not restore: the prefix ends there
                t_read = time.perf_counter()
                got = self.tiers[k].read_into(chain, first, end - first, target)
                self.planner.observe_read(
                    self.tiers[k].name, got * spec.block_nbytes, time.perf_counter() - t_read
                )
                if got < end - first:
                    n = first + got
        for k, first, end in runs:
            by_tier[self.tiers[k].name] += max(0, min(end, n) - first) * B
        if n == start_block:  # the first block read failed verification
            self.counters.add("store", "miss_blocks", len(chain) - start_block)
            return Hit(0, by_tier), None
        spread(
            self.tiers,
            self.writes,
            chain,
            src[: n - start_block],
            dest,
            target.created_s,
            start_block,
            promoted,
            memory_only,
            live=live,
            populated_only=plan,
        )
        self.counters.add("store", "miss_blocks", len(chain) - n)
        for name, tokens in by_tier.items():
            if tokens:
                self.counters.add(name, "hit_blocks", tokens // B)
                self.counters.add(name, "hit_tokens", tokens)
        kv = dest[:, :, : n * B] if isinstance(dest, torch.Tensor) and n else None
        return Hit(n * B, by_tier, n, time.perf_counter() - t0), kv
