"""The connector's worker side: restore hit blocks into vLLM's paged KV, hand computed ones to the store.

    register_kv_caches   the layers' caches in the KV group's order; the backend's layout is learned
                         from its own cache-write kernel (``layout.probe``), or the connector stays off
    start_load_kv        per request: ``store.restore`` of the chain's blocks from the first one vLLM
                         does not hold to the hit's end (verified on read), then a scatter of blocks ``first..`` into the request's vLLM blocks. A
                         block that did not restore (failed verification, a read error, expired
                         meanwhile, a scatter that raised) and every block after it are reported by
                         ``get_block_ids_with_load_errors``: vLLM recomputes them (or fails the request,
                         with ``kv_load_failure_policy`` ``fail``), so wrong KV is never used
    wait_for_save        the ranks agree on which loads failed (``guard.py``); then the sampled
                         self-check's comparisons; then per request the prompt blocks this step completed,
                         unless computed from a block that did not load on some rank, gathered
                         block-major in one pass over the layers and handed to ``store.save_blocks``, which
                         returns at once (memory tiers copy now, disk and remote are written behind)

Loads and saves are whole-step, not layer by layer: on CPU there is nothing to overlap them with, and a
restore is one read of contiguous records per run of blocks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from tierkv.buffers import ReusedBuffers
from tierkv.cpus import refresh as refresh_cpus
from tierkv.integrations.vllm.guard import LoadGuard, RankGroup, RanksDisagree, tp_group
from tierkv.integrations.vllm.layout import PagedLayout, PageShape, UnsupportedLayout, probe
from tierkv.integrations.vllm.loader import Loaded, Loader
from tierkv.integrations.vllm.meta import BlockSpan, TierKVMetadata, TierKVWorkerMetadata
from tierkv.integrations.vllm.metrics import StoreDeltas, TierKVStats, log_totals
from tierkv.integrations.vllm.namespace import kv_namespace, unsupported, with_epoch
from tierkv.integrations.vllm.options import ConnectorOptions, release_store, shared_store
from tierkv.integrations.vllm.paged import PagedCaches, PagedSink
from tierkv.integrations.vllm.selfcheck import SelfChecks
from tierkv.keys import BlockChain, Namespace
from tierkv.layout import KVSpec
from tierkv.tiers.slot_copies import copy_on_caller_only

log = logging.getLogger("vllm.tierkv")

__all__ = ["WorkerSide"]


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.options = options
        self.store: Any = None
        self.layout: PagedLayout | None = None
        self.paged: PagedCaches | None = None  # native copies into and out of the pages, where usable
        self.caches: list[torch.Tensor] = []
        self.epoch = ""
        self.ranks = RankGroup()
        self.guard = LoadGuard()
        self._errors: set[int] = set()
        self.checks = SelfChecks()  # the sampled self-check's copies of restored blocks
        self._reported = False
        # The model thread's load and save buffers, once the caches are known.
        self._buffers: ReusedBuffers | None = None
        self._moved = False  # blocks loaded or saved since the last metrics payload
        self.loader: Loader | None = None  # asynchronous loads (loader.py), once the caches are known
        self._idle_step = False  # this step computes nothing (TierKVMetadata.idle)
        # Why this worker saves nothing any more (a forward raised: see ``save``), or None.
        self.saves_off: str | None = None
        # tier -> [KV bytes read into vLLM's pages, seconds], of the loads served by that tier alone
        self.load_rates: dict[str, list[float]] = {}
        self.stats = {
            "load_blocks": 0,
            "load_failed_blocks": 0,
            "read_blocks": 0,  # blocks the store read (not those vLLM held already)
            "load_s": 0.0,
            "load_nbytes": 0,  # KV bytes put into vLLM's pages
            "save_blocks": 0,
            "save_s": 0.0,
            "unsound_save_blocks": 0,  # not saved: computed from a failed load on some rank, or a failed step
            "check_blocks": 0,  # self-check: restored blocks compared with vLLM's recomputation
            "check_mismatch_blocks": 0,
        }
        self.off = unsupported(vllm_config, kv_cache_config)
        if not self.off:
            try:
                self.ranks = tp_group(vllm_config.parallel_config.tensor_parallel_size)
            except RuntimeError as exc:
                self.off = str(exc)
        if self.off:
            log.warning("tierkv connector is off on this worker: %s", self.off)
            return
        self.base_ns: Namespace = kv_namespace(
            vllm_config, kv_cache_config, revision=options.revision, tp_rank=self.ranks.rank
        )
        self.ns = self.base_ns
        self.spec = KVSpec.of(self.ns)
        self.store = shared_store(options)
        self.deltas = StoreDeltas(self.ranks.rank)

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.off:
            return
        names = self.kv_cache_config.kv_cache_groups[0].layer_names
        try:
            self.caches = [kv_caches[name] for name in names]
            page = PageShape.of(self.caches[0], self.kv_cache_config.num_blocks)
            if any(
                c.shape != self.caches[0].shape
                or c.stride() != self.caches[0].stride()
                or c.dtype != self.spec.dtype
                for c in self.caches
            ):
                raise UnsupportedLayout("the layers' KV caches differ in shape, strides or dtype")
            layer = self.vllm_config.compilation_config.static_forward_context[names[0]]
            impl = layer.impl

            def write(
                key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
            ) -> None:
                impl.do_kv_cache_update(layer, key, value, cache, slots)

            t0 = time.perf_counter()
            self.layout = probe(
                write,
                block_tokens=self.ns.block_tokens,
                num_kv_heads=self.ns.num_kv_heads,
                head_dim=self.ns.head_dim,
                page=page,
                dtype=self.spec.dtype,
                device=self.caches[0].device,
                like=self.caches[0],
            )
            learned_s = time.perf_counter() - t0
            refresh_cpus()  # vLLM has pinned its threads by now: take the CPUs they use
            if self.caches[0].device.type == "cpu":  # every core runs one of the model's OpenMP threads
                copy_on_caller_only()
            paged = PagedCaches(self.layout, self.caches)
            # TIERKV_PAGED_COPY=0: the buffer and torch copies instead (to compare the two)
            self.paged = paged if paged.usable and os.environ.get("TIERKV_PAGED_COPY", "1") != "0" else None
            # The memory tiers now, while vLLM starts (their pages are populated behind), not on the
            # first request's save or load.
            t1 = time.perf_counter()
            try:
                # populated now, while vLLM starts: behind, it would crawl through the first prefills
                self.store.reserve(self.ns, restores_into_cpu=self.paged is not None, populate_now=True)
            except (RuntimeError, MemoryError) as exc:  # then on first use, as before
                log.warning("tierkv: could not reserve the memory tiers now: %s", exc)
            log.info(
                "tierkv connector (worker): %d layers, %s, layout learned from %s in %.3f s, memory tiers "
                "reserved in %.1f s; %s",
                len(names),
                self.ns.revision.rsplit("+", 2)[-2],
                type(impl).__name__,
                learned_s,
                time.perf_counter() - t1,
                "restores and saves copy natively into and out of the pages"
                if self.paged is not None
                else "restores go through a buffer (no native paged copy here)",
            )
        except (UnsupportedLayout, KeyError, AttributeError, TypeError, RuntimeError) as exc:
            self.off = f"{type(exc).__name__}: {exc}"
            self.layout = None
            log.warning("tierkv connector is off on this worker: %s", self.off)

    def report(self) -> TierKVWorkerMetadata | None:
        """Once, if this worker cannot load: the scheduler then stops offering hits."""
        if self.off and not self._reported:
            self._reported = True
            return TierKVWorkerMetadata(disabled=self.off)
        return None

    def _namespace(self, salt: str, base: Namespace | None = None) -> Namespace:
        """``base`` (this engine's namespace unless given) under a request's ``cache_salt``."""
        base = base if base is not None else self.ns
        return base.with_salt(salt) if salt else base

    def _buffer(self, name: str, shape: tuple[int, ...], grow_dim: int) -> torch.Tensor:
        """A reused CPU buffer (``buffers.py``); fresh on a GPU, where the staging ring may still be reading
        the last one."""
        if self._buffers is None:
            self._buffers = ReusedBuffers(self.spec.dtype, self.caches[0].device)
        return self._buffers.get(name, shape, grow_dim)

    # ------------------------------------------------------------------ loads

    def _follow(self, meta: TierKVMetadata) -> None:
        if meta.epoch != self.epoch and self.store is not None:
            self.epoch = meta.epoch
            self.ns = with_epoch(self.base_ns, self.epoch)

    def start_load(self, meta: TierKVMetadata) -> None:
        if self.store is None:  # off: vLLM is told every block it was promised failed (none are, then)
            for span in meta.loads:
                self._errors.update(span.block_ids)
                self.guard.failed(span.block_ids)
            for span in meta.async_loads:
                self._loads().failed(span, self.epoch)
            return
        self._follow(meta)
        self._idle_step = meta.idle
        for span in meta.loads:
            self._took(self._restore(span, self._buffer), taint=True)
        for span in meta.async_loads:
            self._loads().submit(span, self.ns, self.epoch)

    def _loads(self) -> Loader:
        if self.loader is None:
            device = self.caches[0].device if self.caches else torch.device("cpu")
            # (a worker that is off from the start has no spec: its loads all fail without a buffer)
            dtype = self.spec.dtype if hasattr(self, "spec") else torch.float32
            self.loader = Loader(self._restore, device, dtype)
        return self.loader

    def finished_loads(self) -> set[str]:
        """The requests whose asynchronous loads ended since the last call (vLLM asks after every step).
        Their failed blocks go into this step's load errors now, which vLLM takes after this call: a
        request is never reported loaded before its failures are."""
        if self.loader is None:
            return set()
        done = self.loader.collect(self.epoch, idle=self._idle_step)
        for loaded in done:
            self._took(loaded, taint=False)
        return {loaded.span.req_id for loaded in done}

    def _stop_loader(self) -> None:
        if self.loader is not None:
            self.loader.stop()

    def _restore(self, span: BlockSpan, buffer: Any, ns: Namespace | None = None) -> Loaded:
        """Restore ``span`` into its vLLM blocks: as restored straight into the pages (one copy), else into
        a buffer (from ``buffer``) scattered after. Touches no state of the worker's but the store (it runs
        on the loader thread too); ``_took`` counts and reports it."""
        loaded = Loaded(span, 0)
        if self.layout is None or self.store is None:
            return loaded
        t0 = time.perf_counter()
        ids = span.block_ids
        B = self.spec.block_tokens
        chain = BlockChain.of(self._namespace(span.salt, ns), span.token_ids)
        sink = PagedSink(self.paged, self.spec, span.first, ids) if self.paged is not None else None
        out = sink if sink is not None else buffer("load", self.spec.shape(span.end * B), grow_dim=2)
        try:
            hit, kv = self.store.restore(chain.ns, chain.prefix(span.end), out=out, start_block=span.first)
        except Exception:  # the store failed (not a bad block: those end the prefix quietly)
            log.exception("tierkv: restoring %s failed; its blocks are recomputed", span.req_id)
            hit, kv = None, None
        loaded.hit, loaded.read_s = hit, time.perf_counter() - t0  # the rate counts the restore alone
        got = max(0, min(hit.num_blocks if hit is not None else 0, span.end) - span.first)
        if got and kv is not None and sink is None:
            try:
                self.layout.scatter(
                    kv, self.caches, torch.tensor(ids[:got], dtype=torch.long), span.first * B
                )
            except Exception:  # pages may be half written: every block of the span is recomputed
                log.exception(
                    "tierkv: writing %d restored blocks of %s into vLLM's cache failed", got, span.req_id
                )
                got = 0
        if got:
            try:  # a hit extends the retention its request asks, as a save does
                self._retain(chain.prefix(span.first + got), span)
            except Exception:
                log.exception("tierkv: extending the retention of %s failed", span.req_id)
        loaded.got = got
        loaded.kv = kv if sink is None and span.check else None  # kept for the self-check's copy only
        loaded.seconds = time.perf_counter() - t0
        return loaded

    def _took(self, loaded: Loaded, *, taint: bool) -> None:
        """On the model thread: a load's outcome into vLLM's load errors, the counters and, for a
        synchronous load (``taint``), the guard of this step's saves. An asynchronous load needs no taint:
        vLLM computes nothing of its request until it heard of its failures."""
        span, got = loaded.span, loaded.got
        if taint:
            self.guard.loaded(span.block_ids[:got])
        if got and span.check:
            try:
                self._keep_for_check(span, loaded.kv, got, taint=taint)
            except Exception:  # an optional check must never fail the step (a copy that cannot be made)
                log.exception("tierkv self-check: keeping a copy of %s's restored blocks failed", span.req_id)
        if got < len(span.block_ids):
            self._fail(span, got, taint=taint)
        self.stats["load_s"] += loaded.seconds
        self._moved = True
        if not got and loaded.hit is None:  # nothing read (a worker off since it began has no spec)
            return
        hit, B = loaded.hit, self.spec.block_tokens
        if hit is not None:
            self.stats["read_blocks"] += sum(hit.by_tier.values()) // B
        self.stats["load_blocks"] += got
        self.stats["load_nbytes"] += got * self.spec.block_nbytes
        used = [tier for tier, tokens in (hit.by_tier.items() if hit is not None else ()) if tokens]
        if got and hit is not None and len(used) == 1:  # the rate, by the one tier it read (not mixed)
            rate = self.load_rates.setdefault(used[0], [0, 0.0])
            rate[0] += hit.by_tier[used[0]] // B * self.spec.block_nbytes
            rate[1] += loaded.read_s

    def _retain(self, chain: BlockChain, span: BlockSpan) -> None:
        """The retention (and pins) the span's request asked for, on its blocks up to the span's end."""
        if span.control is None or self.store is None:
            return
        B = chain.ns.block_tokens
        for tokens, retention in span.control.prefixes:
            self.store.retain(chain.ns, chain, retention, num_blocks=min(tokens // B, len(chain)))

    def _fail(self, span: BlockSpan, loaded: int, *, taint: bool = True) -> None:
        failed = span.block_ids[loaded:]
        if failed:
            log.info(
                "tierkv: %d of %d blocks of %s did not restore; vLLM recomputes them",
                len(failed),
                len(span.block_ids),
                span.req_id,
            )
        self._errors.update(failed)
        if taint:
            self.guard.failed(failed)
        self.stats["load_failed_blocks"] += len(failed)

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------------ the sampled self-check

    def _keep_for_check(self, span: BlockSpan, kv: torch.Tensor | None, got: int, *, taint: bool) -> None:
        """Keep a copy of what was restored (``kv``, or the pages it was restored into), and have vLLM
        recompute it (reported as a load error, the blocks are recomputed from the first one; they are not
        tainted: what was restored is in them)."""
        if not self.checks.keep(span, kv, got, self.spec, self._gather):
            return
        self._errors.update(span.block_ids[:got])
        # Tainted like a failed load until vLLM recomputed them: what this step's forward computes from
        # them must not be saved before the check has said they were right.
        if taint:
            self.guard.failed(span.block_ids[:got])

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """vLLM blocks as canonical blocks, by the layout's reference gather."""
        assert self.layout is not None
        return self.layout.gather(self.caches, torch.tensor(list(block_ids), dtype=torch.long))

    # ------------------------------------------------------------------ saves

    def save(self, meta: TierKVMetadata, forward_failed: BaseException | None = None) -> None:
        """After the step's forward (``forward_failed``: the exception it raised; vLLM still calls this, in a
        ``finally``)."""
        # Every rank, every step with loads (the same metadata reaches every rank): the union of the
        # ranks' failed loads. A collective, so before any return. (Each rank reports its own failures to
        # vLLM from start_load, which unions the ranks' reports; this union is for the taint only.)
        try:
            self.guard.settle(self.ranks, agree=bool(meta.loads))
        except RanksDisagree as exc:  # the collectives are out of step from now on: off, for good
            log.error("tierkv connector is off on this worker: %s", exc)
            self.off = str(exc)
            self._stop_loader()
            if self.store is not None:
                store, self.store = self.store, None
                release_store(store)
            return
        if self.store is None:
            return
        self._follow(meta)
        for req_id in meta.forget:
            self.checks.forget(req_id)
        if self.layout is None:
            return
        if forward_failed is not None and self.saves_off is None:
            # Its pages hold whatever they held, or some layers' KV: nothing of it is saved, nor anything
            # later (a block it began fills on in the next step). What whole steps saved stays.
            self.saves_off = f"a forward raised ({type(forward_failed).__name__}: {forward_failed})"
            log.error("tierkv: this worker saves nothing from now on: %s", self.saves_off)
        if self.saves_off is not None:
            for span in meta.checks:
                self.checks.forget(span.req_id)  # vLLM's recomputation is not one: nothing to compare
            self.stats["unsound_save_blocks"] += sum(len(span.block_ids) for span in meta.saves)
            return
        for span in meta.checks:
            try:
                self.checks.check(
                    span,
                    tainted=self.guard.tainted,
                    gather=self._gather,
                    spec=self.spec,
                    ns=self._namespace(span.salt),
                    stats=self.stats,
                    store=self.store,
                )
            except Exception:  # an optional check must never fail the step
                log.exception("tierkv self-check of %s failed", span.req_id)
                self.checks.forget(span.req_id)
        sound, unsound = self.guard.split(meta.saves)
        for span in unsound:
            log.info(
                "tierkv: not saving %d blocks of %s: computed from a block whose load failed",
                len(span.block_ids),
                span.req_id,
            )
            self.stats["unsound_save_blocks"] += len(span.block_ids)
        for span in sound:
            self._save(span)

    def _save(self, span: BlockSpan) -> None:
        t0 = time.perf_counter()
        n = len(span.block_ids)
        assert self.layout is not None
        try:  # the gather too (a buffer that cannot be allocated): a failed save is never a failed step
            blocks = self._buffer("save", (n, *self.spec.block_shape), grow_dim=0)
            if self.paged is not None:
                self.paged.gather(span.block_ids, out=blocks)
            else:
                self.layout.gather(self.caches, torch.tensor(span.block_ids, dtype=torch.long), out=blocks)
            chain = BlockChain.of(self._namespace(span.salt), span.token_ids)
            memory_only = span.control is not None and span.control.memory_only
            self.store.save_blocks(chain.ns, chain, blocks, start_block=span.first, memory_only=memory_only)
            self._retain(chain, span)
        except Exception:  # a cache: a failed save is a future miss, never a failed request
            log.exception("tierkv: saving %d blocks of %s failed", n, span.req_id)
            return
        self.stats["save_blocks"] += n
        self.stats["save_s"] += time.perf_counter() - t0
        self._moved = True

    def metrics_payload(self) -> TierKVStats | None:
        """This rank's metrics since the last payload (vLLM asks after every step), or None: built when the
        step moved blocks, else at most once a second."""
        if self.store is None:
            return None
        moved, self._moved = self._moved, False
        try:
            return self.deltas.take(self.store, self.stats, moved)
        except Exception:  # metrics must never fail a step (a store being torn down, an LMDB error)
            log.exception("tierkv: collecting the connector's metrics failed")
            return None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._stop_loader()
        if self.store is not None:
            store, self.store = self.store, None
            log_totals(self.stats, self.load_rates)
            release_store(store)
