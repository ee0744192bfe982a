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

import dataclasses
import logging
import uuid
from typing import Any

from tierkv.integrations.vllm.meta import BlockSpan, TierKVMetadata, TierKVWorkerMetadata
from tierkv.integrations.vllm.namespace import kv_namespace, unsupported, with_epoch
from tierkv.integrations.vllm.options import ConnectorOptions, release_store, shared_store
from tierkv.keys import BlockChain, Namespace

log = logging.getLogger("vllm.tierkv")

__all__ = ["SchedulerSide"]

# tierkv tier name -> vLLM's CacheHitSource value (its metrics split external hits by tier)
HIT_SOURCES = {"gpu": "device", "host": "host", "disk": "disk", "remote": "external_unspecified"}


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    salt: str
    chain: BlockChain
    local_tokens: int = 0  # vLLM's own (block-aligned) hit at the last lookup
    by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    stored_blocks: int = 0  # blocks tierkv held at the last lookup
    load: tuple[int, int] | None = None  # blocks [first, end) to load at the next step
    block_ids: list[int] = dataclasses.field(default_factory=list)


def _eligible(request: Any) -> bool:
    return (
        request.prompt_token_ids is not None
        and not getattr(request, "mm_features", None)
        and getattr(request, "lora_request", None) is None
        and getattr(request, "prompt_embeds", None) is None
    )


class SchedulerSide:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions, *, load: bool, save: bool
    ) -> None:
        self.load_enabled = load
        self.save_enabled = save
        self.store: Any = None
        self.off = unsupported(vllm_config, kv_cache_config)
        self._reqs: dict[str, _Request] = {}
        if self.off:
            log.warning("tierkv connector is off for this engine: %s", self.off)
            return
        self.base_ns: Namespace = kv_namespace(
            vllm_config, kv_cache_config, revision=options.revision, tp_rank=0
        )
        self.epoch = ""
        self.ns = self.base_ns
        self.block_tokens = self.ns.block_tokens
        self.store = shared_store(options)
        log.info(
            "tierkv connector (scheduler): %s, blocks of %d tokens, %s",
            self.ns.model_id,
            self.block_tokens,
            "load and save" if load and save else "load only" if load else "save only",
        )

    # ------------------------------------------------------------------ lookups

    def _request(self, request: Any) -> _Request | None:
        r = self._reqs.get(request.request_id)
        if r is None and _eligible(request):
            salt = request.cache_salt or ""
            ns = self.ns.with_salt(salt) if salt else self.ns
            prompt = list(request.prompt_token_ids)
            r = _Request(prompt, salt, BlockChain.of(ns, prompt))
            self._reqs[request.request_id] = r
        return r

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.store is None or not self.load_enabled:
            if self.store is not None:
                self._request(request)  # still tracked: its blocks are saved
            return 0, False
        r = self._request(request)
        if r is None:
            return 0, False
        hit = self.store.lookup(r.chain.ns, r.chain)
        r.local_tokens, r.stored_blocks, r.by_tier = num_computed_tokens, hit.num_blocks, hit.by_tier
        B = self.block_tokens
        usable = min(hit.num_blocks, (request.num_tokens - 1) // B)  # at least one token left to compute
        new = usable * B - num_computed_tokens
        return (new, False) if new > 0 else (0, False)

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

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None or num_external_tokens <= 0:
            return
        B = self.block_tokens
        first = r.local_tokens // B
        end = min(first + -(-num_external_tokens // B), r.stored_blocks)
        r.load = (first, end) if end > first else None

    # ------------------------------------------------------------------ each step

    def build_meta(self, scheduler_output: Any) -> TierKVMetadata:
        meta = TierKVMetadata(epoch=self.epoch)
        if self.store is None:
            return meta
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

    def _plan(self, meta: TierKVMetadata, req_id: str, r: _Request, computed: int, scheduled: int) -> None:
        B = self.block_tokens
        if r.load is not None:
            first, end = r.load
            r.load = None
            if end <= len(r.block_ids):
                meta.loads.append(
                    BlockSpan(req_id, r.prompt[: end * B], r.salt, first, r.block_ids[first:end])
                )
        if self.save_enabled and scheduled:
            # Prompt blocks this step completes; those before ``computed`` were computed, loaded or
            # prefix-cached before. (The write-behind skips blocks a tier already holds.)
            first, end = computed // B, min(len(r.prompt), computed + scheduled) // B
            if end > first and end <= len(r.block_ids):
                meta.saves.append(
                    BlockSpan(req_id, r.prompt[: end * B], r.salt, first, r.block_ids[first:end])
                )

    def update_connector_output(self, connector_output: Any) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, TierKVWorkerMetadata) and report.disabled and self.load_enabled:
            log.warning(
                "tierkv: a worker cannot use this KV layout (%s); no more hits are offered", report.disabled
            )
            self.load_enabled = False

    def reset(self) -> bool:
        """vLLM resets its external cache (an API call, or after updating weights in place): from now on
        this engine saves and finds blocks in a namespace of its own (``namespace.with_epoch``)."""
        if self.store is not None:
            self.epoch = uuid.uuid4().hex[:16]
            self.ns = with_epoch(self.base_ns, self.epoch)
            self._reqs.clear()  # their chains were made in the old namespace
            log.info("tierkv: cache reset; this engine now uses namespace epoch %s", self.epoch)
        return True

    def request_finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)

    def close(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            release_store(store)
