"""What vLLM's own prefix cache holds, as the connector's scheduler side sees it.

vLLM computes what its prefix cache holds without asking the connector, and keeps there what the
connector reported as failed loads (under ``kv_load_failure_policy`` ``recompute``). So:

- ``uncache``: blocks that did not load, and each request's blocks after one, leave vLLM's prefix cache
  as soon as they are reported. vLLM does so itself only under ``fail``; under ``recompute`` it keeps them
  for the rewound request to rewrite in place, and a request admitted before that request got to them
  (its chunks capped, say) was served from blocks that hold no KV of theirs, its tokens sent to the user.
- ``keep``: the blocks of a prompt that vLLM serves from its own cache, which it never asks the connector
  for, are kept recent in the store (each tier's LRU, the disk's sliding TTL), as a restore keeps what it
  reads, and given the retention or pin the request asks; else the prefix used most would be the first
  to leave tierkv, and miss after a restart.
- ``Resaves``: what tierkv lacks of such a prefix (an earlier request's ``no_store``, blocks tierkv lost)
  is saved from vLLM's pages by the next request that uses it and saves normally.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from tierkv.integrations.vllm.lookups import Recently
from tierkv.integrations.vllm.namespace import with_epoch
from tierkv.keys import BlockChain, Namespace
from tierkv.retention import CacheControl

log = logging.getLogger("vllm.tierkv")

__all__ = ["RESAVE_EVERY_S", "Resaves", "keep", "uncache"]

RESAVE_EVERY_S = 60.0  # a prefix saved from vLLM's pages is not copied again for this long
MAX_RESAVED_KEYS = 4096  # prefixes remembered for RESAVE_EVERY_S (least recent forgotten first)


def uncache(manager: Any, invalid: set[int], tracked: Sequence[list[int]]) -> None:
    """Evict ``invalid`` and every request's blocks after the first of them from ``manager``'s (vLLM's
    ``KVCacheManager``) prefix cache; vLLM calls the connector before it schedules the next step.
    ``tracked``: the block lists of the requests the connector knows, where vLLM's own are unreadable."""
    try:  # every request's blocks, tracked by the connector or not (vLLM 0.32's cache manager)
        lists: Sequence[list[int]] = [
            [block.block_id for block in blocks]
            for single in manager.coordinator.single_type_managers
            for blocks in single.req_to_blocks.values()
        ]
    except AttributeError:  # another vLLM
        lists = tracked
    evict = set(invalid)
    for ids in lists:
        first = next((i for i, block_id in enumerate(ids) if block_id in invalid), None)
        if first is not None:
            evict.update(ids[first:])
    try:
        manager.evict_blocks(evict)
    except Exception:  # noqa: BLE001 - said loudly: vLLM may serve those blocks to a later request
        log.exception(
            "tierkv: taking %d blocks that did not load out of vLLM's prefix cache failed", len(evict)
        )


def keep(
    store: Any,
    rank_base_ns: Sequence[Namespace],
    chain: BlockChain,
    prompt: list[int],
    salt: str,
    epoch: str,
    control: CacheControl,
    held: int,
) -> None:
    """Blocks ``0..held-1`` of a prompt (``chain``, in rank 0's namespace) that vLLM serves itself, refreshed
    and given ``control``'s retention in each rank's namespace (``rank_base_ns``, in ``epoch``, the one the
    request arrived in: after a reset what it names is left as it is). On a thread of its own."""
    B = chain.ns.block_tokens
    for base in rank_base_ns:
        ns = with_epoch(base, epoch)
        ns = ns.with_salt(salt) if salt else ns
        rank_chain = chain if ns == chain.ns else BlockChain.of(ns, prompt[: held * B])
        store.refresh(ns, rank_chain, held)
        # (the worker gives the control to what it loads or saves; these it never sees)
        for tokens, retention in control.prefixes:
            store.retain(ns, rank_chain, retention, num_blocks=min(tokens // B, held))


class Resaves:
    """Which blocks of vLLM's own hit, where tierkv lacks them (a request's ``resave``, from this step's
    lookup), a request saves this step: only blocks of the prompt that vLLM counted computed before the
    step; at most ``blocks_per_step`` (the rest at the next steps); none of a prefix another request saved
    this way less than ``RESAVE_EVERY_S`` ago (many requests admitted at once, or a store that cannot keep
    it, would each copy it again)."""

    def __init__(self, blocks_per_step: int) -> None:
        self.blocks_per_step = blocks_per_step
        self._recent = Recently(RESAVE_EVERY_S, MAX_RESAVED_KEYS)

    def take(self, r: Any, computed: int) -> tuple[int, int] | None:
        """Blocks ``[lo, hi)`` for request ``r`` (the scheduler side's record) this step, whose ``resave``
        keeps what is left; ``computed``: the tokens vLLM counts computed before the step."""
        B = r.chain.ns.block_tokens
        lo, hi = r.resave or (0, 0)
        r.resave = None
        caps = [hi, len(r.block_ids), computed // B, len(r.prompt) // B]
        if r.control.save_tokens is not None:
            caps.append(r.control.save_tokens // B)
        hi = min(caps)
        if hi <= lo:
            return None
        if hi - lo > self.blocks_per_step:
            r.resave, hi = (lo + self.blocks_per_step, hi), lo + self.blocks_per_step
        key, now = r.chain.keys[hi - 1], time.monotonic()
        if self._recent.fresh(key, now):
            r.resave = None
            return None
        self._recent.mark(key, now)
        return lo, hi
