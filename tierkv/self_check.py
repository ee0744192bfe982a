"""The engine's sampled self-check: a prompt served after a restore is also computed cold, and the two
next-token logits compared. Verification (checksums, keys, tokens) cannot see KV that was wrong when it
was saved; this measures it. A difference is logged with the namespace and the blocks, counted, and the
whole namespace is purged from the store: the blocks earlier, unchecked requests computed from the wrong
ones are in it too, under keys no one can list (and this request's own, computed after the restore, are
not saved: the caller saves the cold prefill's). The request is answered from the cold prefill either
way. Costs one cold prefill (``CachedModel(self_check_rate=...)``).
"""

from __future__ import annotations

import logging

import torch

from tierkv.keys import BlockChain
from tierkv.store import TieredStore

__all__ = ["CHECK_TOLERANCE", "restore_sound"]

log = logging.getLogger("tierkv.worker")

# The largest |logit difference| between a prefill over a restored prefix and a cold one, as a fraction of
# the cold logits' largest magnitude. A restore gives the cold prefill's logits bit for bit on the same
# device and dtype (tests/test_worker.py); this leaves room for kernels that round differently with the
# query length, and is far below what KV of another context does to the logits.
CHECK_TOLERANCE = 1e-3


def restore_sound(
    store: TieredStore, chain: BlockChain, n: int, restored: torch.Tensor, cold: torch.Tensor
) -> bool:
    """Whether the next-token logits after restoring ``n`` tokens of ``chain`` (``restored``) agree with
    the cold prefill's (``cold``); if not, counted, logged, and the namespace purged."""
    B = chain.ns.block_tokens
    diff = float((cold - restored).abs().max())
    bound = CHECK_TOLERANCE * max(1.0, float(cold.abs().max()))
    store.counters.add("store", "checked_blocks", n // B)
    if diff <= bound:
        return True
    store.counters.add("store", "check_mismatch_blocks", n // B)
    log.error(
        "tierkv self-check: the next-token logits after restoring %d tokens differ from a cold "
        "prefill's by %.3g (bound %.3g): namespace %s (blocks 0..%d, first key %s) is purged",
        n,
        diff,
        bound,
        chain.ns.digest.hex()[:16],
        n // B - 1,
        chain.keys[0].hex()[:16],
    )
    store.purge(namespace=chain.ns.digest.hex())
    return False
