"""The connector's sampled self-check: a sampled load is restored and also recomputed by vLLM (reported to
it as failed), and the recomputation compared with the restored copy. Verification (checksums, keys,
tokens) cannot see KV that was wrong when it was saved; this measures it. On a difference the store held
wrong KV: it is logged and counted, and the whole namespace is purged (blocks other requests computed from
it before, unchecked, are in it too, under keys no one can list)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierkv.integrations.vllm.meta import BlockSpan
from tierkv.keys import BlockChain, Namespace
from tierkv.layout import KVSpec

log = logging.getLogger("vllm.tierkv")

__all__ = ["CHECK_TOLERANCE", "MAX_CHECK_NBYTES", "SelfChecks", "kv_difference"]

# The self-check's copies of restored blocks wait here until vLLM recomputed them; beyond this, loads
# are not sampled.
MAX_CHECK_NBYTES = 256 << 20
# Largest relative difference (per block and layer, L2) between a restored block and vLLM's recomputation
# that counts as the same KV: float rounding of another batch shape is far below, a block computed from
# another context far above (layer 0 alone may agree: its KV depends on the token only).
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}

# vLLM blocks -> their KV as canonical blocks ``[n, layers, 2, B, H, D]`` (the layout's reference gather)
Gather = Callable[[Sequence[int]], torch.Tensor]


def kv_difference(restored: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """Per block, the largest relative L2 difference over its layers (``[n, layers, 2, B, H, D]`` each)."""
    a, b = restored.to(torch.float32).flatten(2), recomputed.to(torch.float32).flatten(2)
    return ((a - b).norm(dim=2) / b.norm(dim=2).clamp_min(1e-30)).amax(dim=1)


class SelfChecks:
    def __init__(self) -> None:
        self.kept: dict[str, tuple[int, torch.Tensor]] = {}  # req_id -> (first block, restored blocks)

    def keep(self, span: BlockSpan, kv: torch.Tensor | None, got: int, spec: KVSpec, gather: Gather) -> bool:
        """Keep a CPU copy of the ``got`` blocks restored for ``span`` (``kv``, the buffer they were
        restored into, or None: the pages, read back by ``gather``); False over ``MAX_CHECK_NBYTES``."""
        if sum(t.numel() * t.element_size() for _, t in self.kept.values()) + got * spec.block_nbytes > (
            MAX_CHECK_NBYTES
        ):
            return False
        B = spec.block_tokens
        if kv is None:
            blocks = gather(span.block_ids[:got]).to("cpu", copy=True)
        else:
            rows = kv[:, :, span.first * B : (span.first + got) * B]  # [layers, 2, got * B, H, D]
            blocks = rows.unflatten(2, (got, B)).permute(2, 0, 1, 3, 4, 5).to("cpu", copy=True).contiguous()
        self.kept[span.req_id] = (span.first, blocks)
        return True

    def forget(self, req_id: str) -> None:
        self.kept.pop(req_id, None)

    def check(
        self,
        span: BlockSpan,
        *,
        tainted: set[int],
        gather: Gather,
        spec: KVSpec,
        ns: Namespace,
        stats: dict[str, Any],
        store: Any,
    ) -> None:
        """Compare the blocks of ``span`` (vLLM's recomputation this step) with the copy kept for its
        request; ``tainted``: vLLM blocks computed from a failed load (nothing computed from them is
        compared). ``ns``: the request's namespace, purged on a difference."""
        kept = self.kept.get(span.req_id)
        if kept is None:
            return
        first, restored = kept
        lo, hi = max(span.first, first), min(span.end, first + restored.shape[0])
        if hi >= first + restored.shape[0] or not tainted.isdisjoint(span.deps):
            del self.kept[span.req_id]  # the last comparison (or none is possible): the copy goes
        if lo >= hi or not tainted.isdisjoint(span.deps):
            return
        recomputed = gather(span.block_ids[lo - span.first : hi - span.first]).cpu()
        diff = kv_difference(restored[lo - first : hi - first], recomputed)
        tolerance = CHECK_TOLERANCE.get(spec.dtype, 1e-1)
        stats["check_blocks"] += hi - lo
        bad = [lo + j for j, d in enumerate(diff.tolist()) if not d <= tolerance]
        if not bad:
            return
        stats["check_mismatch_blocks"] += hi - bad[0]
        self.kept.pop(span.req_id, None)
        chain = BlockChain.of(ns, span.token_ids)
        log.error(
            "tierkv self-check: block %d of %s (namespace %s, key %s) differs from vLLM's recomputation "
            "(relative difference %.3g > %.3g); the namespace is purged from the store",
            bad[0],
            span.req_id,
            chain.ns.digest.hex()[:16],
            chain.keys[bad[0]].hex()[:16],
            float(diff[bad[0] - lo]),
            tolerance,
        )
        store.purge(namespace=chain.ns.digest.hex())
