"""TieredStore: the public API. Save KV blocks write-behind, find and restore the longest cached prefix.

The store is a loop over its tiers, fastest first (GPU pool, host pool, disk, remote: see
``tiers/base.py`` for what each answers). A prefix is served block by block from the fastest tier holding
each block; it ends at the first block no tier holds, or the first that fails verification (the tier
purges it and counts it, and the caller recomputes from there). Wrong KV is never served. What a restore
read from a slower tier is then written into the faster ones, and a slower tier that lost a block served
from above gets it back (``restores.py``). Saves go to the write-behind (``write_behind.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tierkv import codec
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError
from tierkv.keys import Namespace
from tierkv.layout import KVSpec
from tierkv.metrics import COUNTER_NAMES, Counters
from tierkv.open_calls import OpenCalls, while_open
from tierkv.planner import RestorePlanner
from tierkv.restores import Hit, StoreRestores, Tokens, _chain, _model_key
from tierkv.retention import Retention
from tierkv.store_tenants import QUOTA_REFRESH_S, TenantQuotas
from tierkv.tiers.base import Tier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk.writer import FLUSH_TIMEOUT_S
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.pool import BlockPool
from tierkv.tiers.target import Stagers
from tierkv.write_behind import WriteBehind

if TYPE_CHECKING:
    from tierkv.removal import Forgotten

__all__ = ["Hit", "TieredStore", "Tokens"]


class TieredStore(StoreRestores, TenantQuotas):
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
        # (last: a store whose construction failed is nobody's to close at exit)
        self._open_calls = OpenCalls(self, durable=any(not getattr(t, "memory", False) for t in self.tiers))

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
            shape = ", ".join(str(n) if i != 2 else "T" for i, n in enumerate(spec.shape(min_tokens)))
            raise ConfigError(
                f"kv must be [{shape}] (layers, 2, tokens, kv heads, head dim; T >= {min_tokens}), "
                f"got {list(kv.shape)}"
            )
        if kv.dtype != spec.dtype:
            raise ConfigError(f"kv dtype {kv.dtype} differs from the namespace's {ns.dtype}")
        if kv.shape[2] < min_tokens:
            raise ConfigError(f"kv holds {kv.shape[2]} tokens, fewer than the {min_tokens} asked for")

    @while_open
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

    @while_open
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

    @while_open
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

    @while_open
    def check_retention(self) -> None:
        """ConfigError unless the disk tier can keep blocks by retention and pins (a store of format 2 or
        later: ``tierkv gc --upgrade`` upgrades a format-1 one); without a disk tier, nothing is kept by
        them."""
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        if disk is not None:
            disk.check_retention()

    @while_open
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

    # ---------------------------------------------------------------- lookup and restore: restores.py

    @while_open
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

    @while_open
    def gc(self, **options: Any) -> dict[str, Any]:
        """One gc pass over the disk tier (``maintenance.run_gc``'s options); ConfigError without one."""
        from tierkv.maintenance import run_gc

        return run_gc(self._durable(), **options)

    @while_open
    def purge(self, namespace: str | None = None, *, purge_all: bool = False) -> dict[str, Any]:
        """Drop one namespace (a digest prefix) or everything from every tier, then run a gc pass over the
        disk (its report is returned). A barrier: see ``removal.purge``."""
        from tierkv.removal import purge

        return purge(self, namespace, purge_all=purge_all)

    @while_open
    def export_chunks(
        self, namespaces: Sequence[str] = (), models: Sequence[str] = (), secret: bytes | None = None
    ) -> Iterator[bytes | memoryview]:
        """The disk tier's verified records of these namespaces (digest prefixes) and models (all without
        either) as an archive, in chunks (``tierkv.archive``), signed with a key derived from ``secret``
        if given. The selection is taken now (cheap; ConfigError on a prefix that names no namespace), its
        order and reads as the chunks are drawn; blocks still dirty in the host tier are not in it."""
        from tierkv.archive.export import archive_chunks, select

        disk = self._durable()
        chunks = archive_chunks(disk, select(disk, namespaces, models), secret=secret)

        def drawn() -> Iterator[bytes | memoryview]:  # a call in flight until drawn: close waits for it
            self._open_calls.hold()
            try:
                yield from chunks
            finally:
                self._open_calls.release()

        return drawn()

    @while_open
    def invalidate(self, ns: Namespace, token_ids: Tokens, blocks: Iterable[int]) -> int:
        """Remove blocks ``blocks`` (indices into the prompt's full blocks) from every tier, their saves
        on their way included: a caller learnt a copy may be wrong. Returns how many of them some tier
        held (or had queued). See ``removal.invalidate``."""
        from tierkv.removal import invalidate

        return invalidate(self, _chain(ns, token_ids), blocks)

    @while_open
    def forget(self, ns: Namespace, token_ids: Tokens, *, shared: bool = False) -> Forgotten:
        """Remove the prompt's blocks from every tier, their saves on their way included: only those no
        other stored prompt extends, or all with ``shared`` (``removal.forget``)."""
        from tierkv.removal import forget

        return forget(self, _chain(ns, token_ids), shared=shared)

    def report(self) -> dict[str, Any]:
        """``tierkv stats``' report of the disk tier, plus what only this process knows under ``live``."""
        from tierkv.store_report import store_stats

        out = store_stats(self._durable())
        out["live"] = self.stats()
        return out

    @while_open
    def reserve(self, ns: Namespace, *, restores_into_cpu: bool = False, populate_now: bool = False) -> None:
        """Allocate (and pre-fault) the memory tiers for ``ns``'s blocks now, not on the first request, and
        read the disk tier's index ahead (``DiskTier.read_ahead``);
        ``restores_into_cpu``: also the chunk buffers of restores from a record tier into anything but a
        CPU tensor with contiguous slabs (an engine's CPU pages, through a ``Sink``); ``populate_now``:
        the memory tiers' pages faulted in before this returns, not behind (``BlockPool.reserve``)."""
        for tier in self.tiers:
            if isinstance(tier, BlockPool):
                tier.reserve(KVSpec.of(ns).block_nbytes, populate_now=populate_now)
            elif isinstance(tier, DiskTier):
                tier.read_ahead()  # its index, so that the first lookups do not read it a page at a time
        if restores_into_cpu and any(not t.memory for t in self.tiers):
            self._stagers.reserve(KVSpec.of(ns))

    def describe(self) -> list[str]:
        """One phrase per tier, fastest first, for a start-up log line."""
        return [t.describe() for t in self.tiers]

    # ---------------------------------------------------------------- lifecycle

    @while_open
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
        """Flush what was saved to disk and close every tier, once the calls in flight on other threads have
        returned (later ones raise ``StoreClosedError``). A second close waits for the first to end."""
        if not self._open_calls.close():
            return
        failed: list[BaseException] = []
        steps = [self.writes.close, self._stagers.close, *(t.close for t in reversed(self.tiers))]
        for step in steps:  # (each whatever an earlier one raised: a tier left open holds its files)
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - raised below, after every step ran
                failed.append(exc)
        self._open_calls.closed_all()
        if failed:
            raise failed[0]

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
