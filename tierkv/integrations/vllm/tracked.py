"""The connector's scheduler side's record of a request: which requests it can key exactly, what it holds
of each, and what each asked of the cache (its ``kv_transfer_params``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any

from tierkv.errors import ConfigError, PinBudgetError
from tierkv.integrations.vllm.meta import BlockSpan
from tierkv.keys import BlockChain
from tierkv.retention import NO_CONTROL, CacheControl
from tierkv.server.cache_control import CONTROL_FIELDS, control_from_params

log = logging.getLogger("vllm.tierkv")

__all__ = ["REQUEST_FIELDS", "Tracked", "eligible", "request_control", "span_of"]

# What a request must have for the connector to key it with certainty; a vLLM whose requests lack any of
# these turns the connector off (their absence would read as "text only, no adapter").
REQUEST_FIELDS = ("prompt_token_ids", "mm_features", "lora_request", "prompt_embeds", "cache_salt")


@dataclasses.dataclass
class Tracked:
    prompt: list[int]
    salt: str
    chain: BlockChain
    epoch: str = ""  # the connector's at the request's arrival: ``chain``'s namespace is of it
    local_tokens: int = 0  # vLLM's own (block-aligned) hit at the last lookup
    by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    stored_blocks: int = 0  # blocks tierkv held at the last lookup
    load: tuple[int, int] | None = None  # blocks [first, end) to load at the next step
    block_ids: list[int] = dataclasses.field(default_factory=list)
    check: tuple[int, int] | None = None  # a self-checked load's blocks, not yet recomputed by vLLM
    counted: bool = False  # its prompt tokens are in the metrics (once, however often it is rescheduled)
    control: CacheControl = NO_CONTROL  # what its kv_transfer_params asked of the cache
    lookup: concurrent.futures.Future[Any] | None = None  # a lookup still running on the lookup thread
    lookup_since: float = 0.0
    loading: list[int] | None = None  # the vLLM blocks of its asynchronous load, until reported done
    # Blocks [first, end) of vLLM's own hit that tierkv lacks (a request that asked to keep them out of it
    # computed them, or tierkv lost them): saved from vLLM's pages once the request is scheduled.
    resave: tuple[int, int] | None = None
    loading_checked: bool = False  # that load is the sampled self-check's: its blocks come back invalid
    load_failed: bool = False  # some block of its asynchronous load failed: computed, never offered again
    # ... because it was checked (by design: vLLM must recompute what the worker compares): offered again
    # once the check is done, so that a preemption later still finds its hit
    failed_for_check: bool = False


def eligible(request: Any) -> bool:
    """Whether the prompt's token ids name its KV: no images, adapter or prompt embeddings."""
    return (
        request.prompt_token_ids is not None
        and not request.mm_features
        and request.lora_request is None
        and request.prompt_embeds is None
    )


def span_of(
    req_id: str, r: Tracked, first: int, end: int, B: int, deps: list[int] | None = None, check: bool = False
) -> BlockSpan:
    """Blocks ``first..end`` of request ``r``, in its vLLM blocks, with its cache control."""
    return BlockSpan(
        req_id, r.prompt[: end * B], r.salt, first, r.block_ids[first:end], deps or [], check, r.control
    )


def request_control(request: Any, r: Tracked, store: Any) -> CacheControl:
    """The cache control in the request's ``kv_transfer_params`` (the one field vLLM's server passes
    through): the fields ``tierkv serve`` takes at the top level of a request (docs/cache-control.md).
    vLLM has no way to refuse a request from here: a value the connector does not know, or a pin past the
    budget, is logged, and the request is served without it; but one that asked to keep its prompt off
    disk (``in_memory``, ``no_store``) saves nothing, whatever else in it failed."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not CONTROL_FIELDS & set(params):
        return NO_CONTROL
    try:
        control = control_from_params(params, len(r.prompt))
        if store is not None and any(x.ttl_s or x.pin_s for _, x in control.prefixes):
            store.check_retention()
        tokens, pin_s = control.pin
        if pin_s and store is not None:
            store.check_pin(r.chain.ns, r.chain, pin_s, num_blocks=tokens // r.chain.ns.block_tokens)
    except Exception as exc:  # noqa: BLE001 - vLLM's engine treats any exception here as fatal, for
        # every request it runs (a value not understood; the store's index unreadable: LMDB, EIO)
        why = (
            str(exc)
            if isinstance(exc, (ConfigError, PinBudgetError, ValueError))
            else f"the store could not be read ({type(exc).__name__}: {exc})"
        )
        private = _keeps_off_disk(params)
        log.warning(
            "tierkv: request %s: its cache control is ignored%s: %s",
            request.request_id,
            " (it asked to keep its prompt off disk: nothing of it is saved)" if private else "",
            why,
        )
        return NO_STORE if private else NO_CONTROL
    return control


# A request whose control failed but that asked to keep its prompt off disk: nothing of it is saved.
NO_STORE = CacheControl((), False, True, None)


def _keeps_off_disk(params: dict[str, Any]) -> bool:
    """Whether ``params`` ask, in any form, that the prompt not reach the disk (read without the schema:
    for a control that failed it)."""
    ext = params.get("tierkv")
    return params.get("prompt_cache_retention") == "in_memory" or (
        isinstance(ext, dict) and ext.get("no_store") not in (None, False)
    )
