"""The connector's scheduler side: how much of a prompt tierkv holds, and each step's loads and saves.

    get_num_new_matched_tokens   look the prompt's chain up (every tier, no payload read, no side effect);
                                 offer the whole blocks beyond vLLM's own prefix-cache hit, keeping the
                                 last token to compute (its logits are the first output)
    update_state_after_alloc     vLLM took the offer: remember which blocks to load
    build_connector_meta         per scheduled request: the blocks to load into its vLLM blocks before the
                                 forward, and the prompt blocks this step completes, to save after it

Requests this cannot key exactly are left alone: multimodal inputs (their placeholder tokens do not name
the image), LoRA adapters and prompt embeddings.
"""

from __future__ import annotations

import functools
import logging
import random
import uuid
from typing import Any

from tierkv.integrations.vllm.held import Resaves, keep, uncache
from tierkv.integrations.vllm.lookups import LATER, Lookups
from tierkv.integrations.vllm.meta import BlockSpan, TierKVMetadata, TierKVWorkerMetadata
from tierkv.integrations.vllm.metrics import TierKVStats
from tierkv.integrations.vllm.namespace import kv_namespace, unsupported, with_epoch
from tierkv.integrations.vllm.options import ConnectorOptions, release_store, shared_store
from tierkv.integrations.vllm.tracked import REQUEST_FIELDS, Tracked, eligible, request_control, span_of
from tierkv.keys import BlockChain, Namespace
from tierkv.tenancy import RESERVED
from tierkv.units import env_flag

log = logging.getLogger("vllm.tierkv")

__all__ = ["SchedulerSide"]

# tierkv tier name -> vLLM's CacheHitSource value (its metrics split external hits by tier)
HIT_SOURCES = {"gpu": "device", "host": "host", "disk": "disk", "remote": "external_unspecified"}
SOURCE_TIERS = {v: k for k, v in HIT_SOURCES.items()}


class SchedulerSide:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        options: ConnectorOptions,
        *,
        load: bool,
        save: bool,
        self_check: bool = True,
    ) -> None:
        """``self_check``: whether vLLM recomputes failed loads (its ``kv_load_failure_policy``), which the
        sampled self-check needs."""
        self.load_enabled = load
        self.save_enabled = save
        self.store: Any = None
        self.epoch = ""
        self._reqs: dict[str, Tracked] = {}
        self._warned_reserved = False
        self.kv_cache_manager: Any = None  # vLLM's, once bound (TierKVConnector.bind_kv_cache_manager)
        self.resaves = Resaves(1)  # (a step's worth of blocks, once the block size is known)
        self.lookups = Lookups(
            self._look_up,
            options.lookup_wait_s,
            lambda outcome: self._metrics.count("tierkv_connector_lookups", (outcome,), 1),
        )
        self.front = options.front
        self._metrics = TierKVStats()
        self._forget: list[str] = []
        # requests given an asynchronous load this step, with the blocks vLLM expects it to fill
        self._async: list[tuple[str, list[int]]] = []
        self.load_async = False
        self.check_rate = options.self_check_rate if self_check else 0.0
        self._sample = random.Random()
        self.off = unsupported(vllm_config, kv_cache_config)
        if self.off:
            log.warning("tierkv connector is off for this engine: %s", self.off)
            return
        async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # Asynchronous loads: vLLM holds the request back (WAITING_FOR_REMOTE_KVS) until every worker
        # reported its load finished, failed blocks included, and only then computes it.
        if options.load_async is None:
            self.load_async = env_flag("TIERKV_LOAD_ASYNC", async_scheduling)
        else:
            self.load_async = options.load_async
        if load and async_scheduling and not self.load_async:
            # vLLM 0.32 plans step N+1 before it hears that a synchronous load of step N failed, and sends
            # that step's tokens, computed over the unloaded block, to the user (tests/vllm/
            # test_vllm_scheduler_unit.py shows it). Saves stay on: nothing wrong is saved either way.
            log.warning(
                "tierkv connector: no loads under asynchronous scheduling with load_async off (a load that "
                "fails would reach the user as tokens computed from a block that did not load); drop "
                '"load_async": false or run vLLM with --no-async-scheduling. Blocks are still saved.'
            )
            self.load_enabled = load = False
        self.base_ns: Namespace = kv_namespace(
            vllm_config, kv_cache_config, revision=options.revision, tp_rank=0
        )
        self.ns = self.base_ns
        # Every rank's namespace (each saves its own shard), for the blocks vLLM serves itself (_look_up).
        self.rank_base_ns = [self.base_ns] + [
            kv_namespace(vllm_config, kv_cache_config, revision=options.revision, tp_rank=rank)
            for rank in range(1, vllm_config.parallel_config.tensor_parallel_size)
        ]
        self.block_tokens = self.ns.block_tokens
        batched = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 8192
        self.resaves = Resaves(max(1, int(batched) // self.block_tokens))  # what a step computes
        self.store = shared_store(options)
        log.info(
            "tierkv connector (scheduler): %s, blocks of %d tokens, %s%s, self-check of %.3g of loads",
            self.ns.model_id,
            self.block_tokens,
            "load and save" if load and save else "load only" if load else "save only",
            " (loads asynchronous)" if load and self.load_async else "",
            self.check_rate,
        )

    # ------------------------------------------------------------------ lookups

    def _request(self, request: Any) -> Tracked | None:
        r = self._reqs.get(request.request_id)
        if self.off:
            return r  # a load promised before the connector turned off is still planned
        if r is None:
            missing = [f for f in REQUEST_FIELDS if not hasattr(request, f)]
            if missing:  # another vLLM: what it would say about images or adapters is unknown
                self.turn_off(f"vLLM's requests have no {', '.join(missing)}")
                return None
        if r is None and eligible(request):
            salt = request.cache_salt or ""
            if salt.startswith(RESERVED) and not self.front:
                # The space of a tenant of ``tierkv serve --api-keys`` on the same directory: no client
                # of a bare vLLM may name it (its hits would tell that tenant's prompts). Not cached.
                if not self._warned_reserved:
                    self._warned_reserved = True
                    log.warning(
                        "tierkv: requests whose cache_salt starts with %r are neither loaded nor saved "
                        "(reserved for tenants of API keys; logged once)",
                        RESERVED,
                    )
                return None
            ns = self.ns.with_salt(salt) if salt else self.ns
            prompt = list(request.prompt_token_ids)
            r = Tracked(prompt, salt, BlockChain.of(ns, prompt), self.epoch)
            r.control = request_control(request, r, self.store)
            self._reqs[request.request_id] = r
        return r

    def _look_up(self, r: Tracked) -> Any:
        """The store's hit for ``r``, on the lookup thread. The blocks of it vLLM holds itself (its own
        prefix hit), which it will not ask for, are then kept recent in the store, every rank's, as a
        restore keeps what it reads (else the prefix used most would age out of tierkv first, its LRU and
        the disk's TTL, and miss after a restart), and given the pin or retention the request asks: after
        the answer, which it need not delay."""
        hit = self.store.lookup(r.chain.ns, r.chain)
        held = min(r.local_tokens // self.block_tokens, hit.num_blocks)
        if held:
            # (a plain refresh is one a second per prefix: its last held block names it; a pin or retention
            # is given each time it is asked)
            self.lookups.after(
                r.chain.keys[held - 1],
                functools.partial(
                    keep, self.store, self.rank_base_ns, r.chain, r.prompt, r.salt, r.epoch, r.control, held
                ),
                control=bool(r.control.prefixes),
            )
        return hit

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.store is None or not self.load_enabled:
            if self.store is not None and (r := self._request(request)) is not None:
                r.local_tokens, r.resave = num_computed_tokens, None  # still tracked: its blocks are saved
            return 0, False
        r = self._request(request)
        if r is not None:
            r.resave = None  # (set below from this lookup's answer only: never one of an earlier step)
        if r is None or r.load_failed:  # (vLLM asks again after a failed asynchronous load)
            return 0, False
        r.local_tokens, r.by_tier = num_computed_tokens, {}
        hit = self.lookups.soon(r)
        if hit is LATER:
            return None, False  # vLLM skips the request this step and asks again at the next
        if hit is None:
            return 0, False
        r.stored_blocks, r.by_tier = hit.num_blocks, hit.by_tier
        B, n = self.block_tokens, request.num_tokens
        local_blocks = (
            min(num_computed_tokens, len(r.prompt)) // B
        )  # (a resumed request's hit: its output too)
        r.resave = (hit.num_blocks, local_blocks) if hit.num_blocks < local_blocks else None
        if hit.num_blocks * B >= n:
            # The whole prompt is cached, in whole blocks: load them all and leave vLLM its last token
            # (it computes at least one; vLLM takes a hit that ends mid-block). Its KV, loaded too, is
            # then computed again in place.
            new = n - 1 - num_computed_tokens
        else:
            new = min(hit.num_blocks, (n - 1) // B) * B - num_computed_tokens
        return (new, self.load_async) if new > 0 else (0, False)

    def hit_sources(self, request: Any, num_tokens: int) -> dict[str, int]:
        """``num_tokens`` loaded, split by the tier that held them (in proportion to the lookup's split)."""
        r = self._reqs.get(request.request_id)
        held = {
            HIT_SOURCES.get(t, "external_unspecified"): n for t, n in (r.by_tier if r else {}).items() if n
        }
        total = sum(held.values())
        if not num_tokens or not total:
            return {"external_unspecified": num_tokens} if num_tokens else {}
        out: dict[str, int] = {}
        for source, n in held.items():
            out[source] = out.get(source, 0) + num_tokens * n // total
        slowest = list(held)[-1]
        out[slowest] += num_tokens - sum(out.values())
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the request's, of its one KV group) with ``num_external_tokens``
        to load. A synchronous load is planned at the request's next scheduled step; an asynchronous one
        (vLLM now holds the request back) goes out in this step's metadata."""
        r = self._reqs.get(request.request_id)
        if r is not None and not r.counted:
            self._count_prompt(request, r, max(num_external_tokens, 0))
        if r is None or num_external_tokens <= 0:
            return
        B = self.block_tokens
        first = r.local_tokens // B
        end = min(first + -(-num_external_tokens // B), r.stored_blocks)
        r.load = (first, end) if end > first else None
        if self.load_async:  # what num_new_matched_tokens answered for a hit, so vLLM waits for the load
            r.block_ids = list(block_ids)
            # (and the blocks vLLM expects loaded: reported failed should no load be planned after all)
            self._async.append(
                (request.request_id, r.block_ids[first : first + -(-num_external_tokens // B)])
            )

    def _count_prompt(self, request: Any, r: Tracked, external: int) -> None:
        """The metrics' prompt tokens by source, when vLLM first schedules the request: vLLM's own prefix
        cache, each tierkv tier (the lookup's split of what will be loaded), and the rest computed."""
        r.counted = True
        by_source = {"vllm": r.local_tokens}
        by_tier = {SOURCE_TIERS.get(s, "remote"): n for s, n in self.hit_sources(request, external).items()}
        for tier, n in by_tier.items():
            by_source[tier] = by_source.get(tier, 0) + n
        by_source["computed"] = max(0, len(r.prompt) - r.local_tokens - external)
        for source, n in by_source.items():
            if n:
                self._metrics.count("tierkv_prompt_tokens", (source,), n)

    def metrics_payload(self) -> TierKVStats | None:
        """What the scheduler counted since the last call (vLLM asks after every step), or None."""
        if self._metrics.is_empty():
            return None
        out, self._metrics = self._metrics, TierKVStats()
        return out

    # ------------------------------------------------------------------ each step

    def build_meta(self, scheduler_output: Any) -> TierKVMetadata:
        meta = TierKVMetadata(epoch=self.epoch)
        if self.store is None:
            return meta
        meta.idle = not scheduler_output.total_num_scheduled_tokens
        meta.forget, self._forget = self._forget, []
        for req_id, expected in self._async:  # allocated this step; vLLM computes them once loaded
            r = self._reqs.get(req_id)
            span = self._plan_load(meta.async_loads, req_id, r) if r is not None else None
            if span is None:  # (not expected) vLLM waits for a report all the same: one of all its blocks
                meta.async_loads.append(BlockSpan(req_id, [], "", 0, expected))  # failed (no tokens to load)
            elif r is not None:
                r.loading, r.loading_checked = list(span.block_ids), span.check
        self._async.clear()
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is not None:
                r.block_ids = list(new.block_ids[0])
                self._plan(meta, new.req_id, r, new.num_computed_tokens, steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._reqs.get(req_id)
            if r is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and back: the whole list
                r.block_ids = list(added[0]) if added else []
            elif added:
                r.block_ids.extend(added[0])
            self._plan(meta, req_id, r, cached.num_computed_tokens[i], steps.get(req_id, 0))
        return meta

    def _plan(self, meta: TierKVMetadata, req_id: str, r: Tracked, computed: int, scheduled: int) -> None:
        B = self.block_tokens
        if r.load is not None:
            self._plan_load(meta.loads, req_id, r)
        if not scheduled:
            return
        if not self.save_enabled or r.control.no_store:
            r.resave = None
        if r.resave is not None and (got := self.resaves.take(r, computed)):  # vLLM's hit tierkv lacks
            span = span_of(req_id, r, *got, B, deps=r.block_ids[: got[1]])  # computed before this step:
            span.cached = True  # its own blocks among its deps (guard.py)
            meta.saves.append(span)
        # Prompt blocks this step completes; those before ``computed`` were computed, loaded or
        # prefix-cached before. (The write-behind skips blocks a tier already holds.)
        first, end = computed // B, min(len(r.prompt), computed + scheduled) // B
        if end <= first or end > len(r.block_ids):
            return
        if r.check is not None:  # vLLM recomputes a self-checked load: compare what overlaps this step
            lo, hi = max(first, r.check[0]), min(end, r.check[1])
            if lo < hi:
                meta.checks.append(
                    BlockSpan(req_id, r.prompt[: hi * B], r.salt, lo, r.block_ids[lo:hi], r.block_ids[:lo])
                )
                r.check = None if hi >= r.check[1] else (hi, r.check[1])
                if r.check is None and r.failed_for_check:  # compared: its hit may be offered again
                    r.load_failed = r.failed_for_check = False
        if r.control.save_tokens is not None:  # only the prefixes the request marked
            end = min(end, r.control.save_tokens // B)
        if self.save_enabled and not r.control.no_store and end > first:
            meta.saves.append(span_of(req_id, r, first, end, B, deps=r.block_ids[:first]))

    def _plan_load(self, loads: list[BlockSpan], req_id: str, r: Tracked) -> BlockSpan | None:
        """The request's planned load into ``loads``; the span, or None when there is none."""
        if r.load is None:
            return None
        first, end = r.load
        r.load = None
        end = min(end, len(r.block_ids))  # (never fewer: vLLM allocated them; but never a dropped load)
        if end <= first:
            return None
        check = self.check_rate > 0 and r.check is None and self._sample.random() < self.check_rate
        span = span_of(req_id, r, first, end, self.block_tokens, check=check)
        loads.append(span)
        if check:
            r.check = (first, end)
        return span

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        if invalid and self.kv_cache_manager is not None:
            uncache(self.kv_cache_manager, set(invalid), [r.block_ids for r in self._reqs.values()])
        done = getattr(connector_output, "finished_recving", None) or set()
        for req_id, r in self._reqs.items():  # asynchronous loads: what failed is computed, not offered again
            if r.loading is not None:
                if not invalid.isdisjoint(r.loading):
                    r.load_failed, r.failed_for_check = True, r.loading_checked
                if req_id in done:
                    r.loading = None
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, TierKVWorkerMetadata) and report.disabled and self.load_enabled:
            log.warning(
                "tierkv: a worker cannot use this KV layout (%s); no more hits are offered", report.disabled
            )
            self.load_enabled = False

    def turn_off(self, why: str) -> None:
        """No more lookups, loads or saves from now on (what was planned for this step still runs)."""
        if self.store is not None:
            log.warning("tierkv connector is off for this engine: %s", why)
            self.off = why
            self.load_enabled = self.save_enabled = False
            self.check_rate = 0.0
            # Requests vLLM was promised a load for keep it (vLLM counts those tokens as computed): they
            # go when they finish.

    def reset(self) -> bool:
        """vLLM resets its external cache (an API call, or after updating weights in place): from now on
        this engine saves and finds blocks in a namespace of its own (``namespace.with_epoch``)."""
        if self.store is not None:
            self.epoch = uuid.uuid4().hex[:16]
            self.ns = with_epoch(self.base_ns, self.epoch)
            # Their chains were made in the old namespace; the workers' self-check copies of them go too
            # (request_finished would no longer find them to say so).
            self._forget.extend(req_id for req_id, r in self._reqs.items() if r.check is not None)
            self._reqs.clear()
            log.info("tierkv: cache reset; this engine now uses namespace epoch %s", self.epoch)
        return True

    def request_finished(self, request: Any) -> None:
        r = self._reqs.pop(request.request_id, None)
        if r is not None and r.check is not None:
            self._forget.append(request.request_id)

    def close(self) -> None:
        self.lookups.close()  # (before the store it reads goes)
        if self.store is not None:
            store, self.store = self.store, None
            release_store(store)
