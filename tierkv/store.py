"""TieredStore: the public API. Save KV blocks write-behind, find and restore the longest cached prefix.

The store is a loop over its tiers, fastest first (GPU pool, host pool, disk, remote: see
``tiers/base.py`` for what each answers). A prefix is served block by block from the fastest tier holding
each block; it ends at the first block no tier holds, or the first that fails verification (the tier
purges it and counts it, and the caller recomputes from there). Wrong KV is never served. What a restore
read from a slower tier is then written into the faster ones, and a slower tier that lost a block served
from above gets it back. Saves go to the write-behind (``write_behind.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierkv import codec
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError
from tierkv.keys import BlockChain, Namespace
from tierkv.layout import KVSpec
from tierkv.metrics import COUNTER_NAMES, Counters
from tierkv.planner import RestorePlanner
from tierkv.retention import Retention
from tierkv.spread import promoter, runs_of, spread
from tierkv.store_tenants import QUOTA_REFRESH_S, TenantQuotas
from tierkv.tiers import prefault
from tierkv.tiers.base import Tier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk.writer import FLUSH_TIMEOUT_S
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.pool import BlockPool
from tierkv.tiers.target import Sink, Stagers
from tierkv.write_behind import WriteBehind

if TYPE_CHECKING:
    from tierkv.removal import Forgotten

__all__ = ["Hit", "TieredStore", "Tokens"]


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


class TieredStore(TenantQuotas):
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        codec_: codec.Codec = codec.Codec.RAW,
        clock: Callable[[], float] = time.time,
        counters: Counters | None = None,
        staging: bool | None = None,
        staging_nbytes: int = 512 << 20,
        staging_wait_s: float = 0.005,
    ) -> None:
        """``tiers`` fastest first (``StoreConfig.build`` makes them). The staging options are the
        write-behind's (see ``write_behind.WriteBehind``)."""
        self.tiers: list[Tier] = list(tiers)
        self.clock = clock
        self.counters = counters or Counters()
        self.writes = WriteBehind(
            self.tiers,
            codec_=codec_,
            clock=clock,
            counters=self.counters,
            staging=staging,
            staging_nbytes=staging_nbytes,
            staging_wait_s=staging_wait_s,
        )
        self._stagers = Stagers()  # chunk buffers of restores into a GPU or a sink
        self.planner = RestorePlanner()  # restore or recompute, from measured read and prefill speeds
        self._lost_at_flush = 0  # blocks the record tiers had lost at the last flush
        self._quotas_read_s = -QUOTA_REFRESH_S  # when the disk tier's stored quotas were last adopted

    @classmethod
    def open(cls, path: str | Any | None, **options: Any) -> TieredStore:
        """Open (or create) a store at ``path`` (None: memory only); ``options`` are ``StoreConfig.of``'s
        (``host_bytes``, ``disk_bytes``, ``ttl_s``, ``remote``, ``gpu_bytes``, ...)."""
        return cls.from_config(StoreConfig.of(path, **options))

    @classmethod
    def from_config(cls, config: StoreConfig) -> TieredStore:
        counters = Counters()
        return cls(
            config.build(counters),
            codec_=config.codec,
            clock=config.clock,
            counters=counters,
            staging=config.staging,
        )

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name`` (``tier_names``), None if the store has none."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def tier_names(self) -> list[str]:
        """The tiers' names, fastest first (the ``tier`` label of metrics, the keys of ``Hit.by_tier``)."""
        return [t.name for t in self.tiers]

    def add_gpu_tier(self, capacity_nbytes: int, device: torch.device | str) -> None:
        """Add a GPU tier in front (a server does this once the model is loaded, before serving); it keeps
        the retention of the first memory tier."""
        if any(isinstance(t, GpuTier) for t in self.tiers):
            raise ConfigError("this store already has a GPU tier")
        first = next((t for t in self.tiers if isinstance(t, BlockPool)), None)
        ages = {"ttl_s": first.ttl_s, "max_age_s": first.max_age_s} if first is not None else {}
        self.tiers.insert(
            0, GpuTier(capacity_nbytes, device=device, counters=self.counters, clock=self.clock, **ages)
        )

    # ---------------------------------------------------------------- save

    def _check_kv(self, ns: Namespace, kv: torch.Tensor, min_tokens: int) -> None:
        spec = KVSpec.of(ns)
        if (
            kv.dim() != 5
            or kv.shape[0] != spec.num_layers
            or kv.shape[1] != 2
            or tuple(kv.shape[3:]) != (spec.num_kv_heads, spec.head_dim)
        ):
            raise ConfigError(
                f"kv must be {list(spec.shape(min_tokens))} (layers, 2, tokens, kv heads, head dim), "
                f"got {list(kv.shape)}"
            )
        if kv.dtype != spec.dtype:
            raise ConfigError(f"kv dtype {kv.dtype} differs from the namespace's {ns.dtype}")
        if kv.shape[2] < min_tokens:
            raise ConfigError(f"kv holds {kv.shape[2]} tokens, fewer than the {min_tokens} asked for")

    def save(
        self,
        ns: Namespace,
        token_ids: Tokens,
        kv: torch.Tensor,
        *,
        start_block: int = 0,
        kv_start: int = 0,
        memory_only: bool = False,
    ) -> int:
        """Keep the full blocks of ``token_ids`` (KV ``[layers, 2, tokens, kv_heads, head_dim]``, any device).

        Returns at once: the memory tiers' copies are made now (or, through the staging ring, queued), the
        disk write happens behind (a dropped save is counted, never an error). Blocks before
        ``start_block`` are known cached and skipped. ``kv`` may start at token ``kv_start``
        (<= ``start_block * block_tokens``) instead of 0. ``memory_only``: kept in the memory tiers only,
        never written to disk or remote (``Retention.memory_only``). Returns the number of blocks handed on.
        """
        chain = _chain(ns, token_ids)
        if not 0 <= kv_start <= start_block * ns.block_tokens:
            raise ConfigError(f"kv_start {kv_start} must be in 0..start_block * block_tokens")
        self._check_kv(ns, kv, chain.num_tokens - kv_start)
        B = ns.block_tokens
        blocks = [kv[:, :, i * B - kv_start : (i + 1) * B - kv_start] for i in range(start_block, len(chain))]
        if ns.tenant_id is not None:
            self._adopt_quotas()
        return self.writes.save(chain, start_block, blocks, memory_only=memory_only)

    def save_blocks(
        self,
        ns: Namespace,
        token_ids: Tokens,
        blocks: torch.Tensor,
        *,
        start_block: int = 0,
        memory_only: bool = False,
    ) -> int:
        """Like ``save`` for blocks ``start_block..`` given block-major, ``[N, layers, 2, block_tokens,
        kv_heads, head_dim]`` (as ``kernels.gather_blocks`` makes them: each block one contiguous piece)."""
        chain = _chain(ns, token_ids)
        spec = KVSpec.of(ns)
        if blocks.dim() != 6 or tuple(blocks.shape[1:]) != spec.block_shape or blocks.dtype != spec.dtype:
            raise ConfigError(
                f"blocks must be [N, {', '.join(map(str, spec.block_shape))}] of {ns.dtype}, "
                f"got {list(blocks.shape)} of {blocks.dtype}"
            )
        if start_block + blocks.shape[0] != len(chain):
            raise ConfigError(
                f"{blocks.shape[0]} blocks from block {start_block} do not end at the prompt's "
                f"last full block ({len(chain)})"
            )
        if ns.tenant_id is not None:
            self._adopt_quotas()
        return self.writes.save(
            chain, start_block, list(blocks.unbind(0)), stacked=blocks, memory_only=memory_only
        )

    # ---------------------------------------------------------------- retention (cache control)

    def check_pin(
        self, ns: Namespace, token_ids: Tokens, pin_s: float, *, num_blocks: int | None = None
    ) -> None:
        """Raise ``PinBudgetError`` (nothing pinned) unless the first ``num_blocks`` blocks of the prompt
        (all its full blocks by default) fit in the disk tier's pin budget for ``pin_s``; call it before
        the work whose blocks ``retain`` is to pin. ConfigError without a disk tier."""
        chain = _chain(ns, token_ids)
        count = len(chain) if num_blocks is None else min(num_blocks, len(chain))
        if pin_s <= 0 or count == 0:
            return
        disk = self._durable()
        record_nbytes = (
            codec.payload_at(disk.record_version, chain.block_token_nbytes) + KVSpec.of(ns).block_nbytes
        )
        disk.check_pin(chain, count, record_nbytes)

    def check_retention(self) -> None:
        """ConfigError unless the disk tier can keep blocks by retention and pins (a store of format 2 or
        later: ``tierkv gc --upgrade`` upgrades a format-1 one); without a disk tier, nothing is kept by
        them."""
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        if disk is not None:
            disk.check_retention()

    def retain(
        self, ns: Namespace, token_ids: Tokens, retention: Retention, *, num_blocks: int | None = None
    ) -> None:
        """The first ``num_blocks`` blocks of the prompt (all its full blocks by default) were used by a
        request asking ``retention``: each tier that keeps blocks by retention extends theirs (never
        shortens), those still on their way included. Check a pin with ``check_pin`` first."""
        chain = _chain(ns, token_ids)
        count = len(chain) if num_blocks is None else min(num_blocks, len(chain))
        if count > 0 and (retention.ttl_s or retention.pin_s):
            for tier in self.tiers:
                tier.extend_retention(chain, count, retention)

    # ---------------------------------------------------------------- lookup and restore

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

    def lookup(self, ns: Namespace, token_ids: Tokens) -> Hit:
        """How many leading tokens are cached, and where. Reads no payload, changes nothing."""
        chain = _chain(ns, token_ids)
        src = self._sources(chain.prefix(self.writes.gens.usable(chain)))  # not what a purge is removing
        by_tier = {t.name: sum(k == j for k in src) * ns.block_tokens for j, t in enumerate(self.tiers)}
        return Hit(len(src) * ns.block_tokens, by_tier, len(src))

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
        for tier in self.tiers:
            if start_block:  # the blocks the caller holds were just used too: keep them alive here
                tier.served_above(chain, range(start_block))
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
                target.background = target.behind
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

    def prefetch(self, ns: Namespace, token_ids: Tokens, *, chunk_nbytes: int = 64 << 20) -> tuple[Hit, Hit]:
        """Bring the prompt's longest cached prefix into the CPU memory tier from the slower ones, computing
        nothing (``prefetch.prefetch``). Returns where it was before and where it is after."""
        from tierkv.prefetch import prefetch

        return prefetch(self, _chain(ns, token_ids), chunk_nbytes)

    def observe_prefill(self, ns: Namespace, tokens: int, seconds: float) -> None:
        """The caller computed ``tokens`` of a prompt of ``ns``'s model in ``seconds``: with the tiers' read
        bandwidth (measured by restores) it lets ``restore`` compute the rest of a prefix instead of
        reading it from a disk or remote tier where that is faster (``planner.RestorePlanner``; counted
        as ``store.recomputed_blocks``, a part of ``miss_blocks``). Report real durations (on a GPU,
        after a synchronize) of at least a block's tokens: the first report counts at once. ``lookup``
        does not apply the decision (it says what is cached)."""
        self.planner.observe_prefill(_model_key(ns), tokens, seconds)

    # ---------------------------------------------------------------- maintenance (the admin API's calls)

    @property
    def durable(self) -> bool:
        """Whether the store has a durable tier (gc, purge and the disk report need one)."""
        return any(isinstance(t, DiskTier) for t in self.tiers)

    def _durable(self) -> DiskTier:
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        if disk is None:
            raise ConfigError("this store has no disk tier")
        return disk

    def gc(self, **options: Any) -> dict[str, Any]:
        """One gc pass over the disk tier (``maintenance.run_gc``'s options); ConfigError without one."""
        from tierkv.maintenance import run_gc

        return run_gc(self._durable(), **options)

    def purge(self, namespace: str | None = None, *, purge_all: bool = False) -> dict[str, Any]:
        """Drop one namespace (a digest prefix) or everything from every tier, then run a gc pass over the
        disk (its report is returned). A barrier: see ``removal.purge``."""
        from tierkv.removal import purge

        return purge(self, namespace, purge_all=purge_all)

    def export_chunks(
        self, namespaces: Sequence[str] = (), models: Sequence[str] = (), secret: bytes | None = None
    ) -> Iterator[bytes | memoryview]:
        """The disk tier's verified records of these namespaces (digest prefixes) and models (all without
        either) as an archive, in chunks (``tierkv.archive``), signed with a key derived from ``secret``
        if given. The selection is taken now (cheap; ConfigError on a prefix that names no namespace), its
        order and reads as the chunks are drawn; blocks still dirty in the host tier are not in it."""
        from tierkv.archive.export import archive_chunks, select

        disk = self._durable()
        return archive_chunks(disk, select(disk, namespaces, models), secret=secret)

    def invalidate(self, ns: Namespace, token_ids: Tokens, blocks: Iterable[int]) -> int:
        """Remove blocks ``blocks`` (indices into the prompt's full blocks) from every tier, their saves
        on their way included: a caller learnt a copy may be wrong. Returns how many of them some tier
        held (or had queued). See ``removal.invalidate``."""
        from tierkv.removal import invalidate

        return invalidate(self, _chain(ns, token_ids), blocks)

    def forget(self, ns: Namespace, token_ids: Tokens, *, shared: bool = False) -> Forgotten:
        """Remove the prompt's blocks from every tier, their saves on their way included: only those no
        other stored prompt extends, or all with ``shared`` (``removal.forget``)."""
        from tierkv.removal import forget

        return forget(self, _chain(ns, token_ids), shared=shared)

    def report(self) -> dict[str, Any]:
        """``tierkv stats``' report of the disk tier, plus what only this process knows under ``live``."""
        from tierkv.inspect import store_stats

        out = store_stats(self._durable())
        out["live"] = self.stats()
        return out

    def reserve(self, ns: Namespace, *, restores_into_cpu: bool = False, populate_now: bool = False) -> None:
        """Allocate (and pre-fault) the memory tiers for ``ns``'s blocks now, not on the first request;
        ``restores_into_cpu``: also the chunk buffers of restores from a record tier into anything but a
        CPU tensor with contiguous slabs (an engine's CPU pages, through a ``Sink``); ``populate_now``:
        the memory tiers' pages faulted in before this returns, not behind (``BlockPool.reserve``)."""
        for tier in self.tiers:
            if isinstance(tier, BlockPool):
                tier.reserve(KVSpec.of(ns).block_nbytes, populate_now=populate_now)
        if restores_into_cpu and any(not t.memory for t in self.tiers):
            self._stagers.reserve(KVSpec.of(ns))

    def describe(self) -> list[str]:
        """One phrase per tier, fastest first, for a start-up log line."""
        return [t.describe() for t in self.tiers]

    # ---------------------------------------------------------------- lifecycle

    def flush(self) -> int:
        """Wait until every saved block is durable on disk (the host tier's dirty blocks included).
        Returns how many blocks the record tiers lost since the last flush: dropped (their queue full
        and no host tier to wait in, a full disk) or evicted from the host tier before they were written."""
        self.writes.flush()  # first out of the staging ring, into the tiers' queues
        self.writes.drain(FLUSH_TIMEOUT_S)  # then what waited dirty in the host tier for room
        for tier in self.tiers:
            tier.flush()
        snap = self.counters.snapshot()
        lost = sum(
            snap.get(t.name, {}).get("dropped_saves", 0)
            + snap.get(t.name, {}).get("writeback_lost_blocks", 0)
            for t in self.tiers
            if not getattr(t, "memory", False)
        )
        lost, self._lost_at_flush = lost - self._lost_at_flush, lost
        return lost

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier name (``tier_names``), ``store`` and ``staging``; every tier with a size also
        has ``used_nbytes`` and ``capacity_nbytes`` (0: no budget)."""
        snap = self.counters.snapshot()
        for name in (*self.tier_names, "store"):
            snap.setdefault(name, dict.fromkeys(COUNTER_NAMES, 0))
        for tier in self.tiers:
            snap[tier.name].update(tier.stats())
        backlog = self.writes.backlog_blocks()
        for tier in self.tiers:
            if "write_queue_nbytes" in snap[tier.name]:  # a tier with a write queue: its write-back too
                snap[tier.name]["writeback_blocks"] = backlog.get(tier.name, 0)
        return snap

    def close(self) -> None:
        self.writes.close()
        self._stagers.close()
        for tier in reversed(self.tiers):
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
