"""Removing blocks from every tier of a store, as a barrier: a purge (a namespace, or everything), an
invalidation (chosen blocks a caller learnt may be wrong) and a deletion by prompt (``forget``).

Both raise a fence in the write-behind's generations (``write_behind.Generations``): saves begun before it
are dropped wherever they are (the staging ring, a writer's queue, the disk writer's indexing
transaction), restores begun before it are waited for, and the blocks it names are misses meanwhile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tierkv.errors import ConfigError
from tierkv.keys import BlockChain, NamespaceDigest
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.pool import BlockPool

if TYPE_CHECKING:
    from tierkv.store import TieredStore

__all__ = ["Forgotten", "forget", "invalidate", "purge"]


@dataclasses.dataclass(frozen=True)
class Forgotten:
    """What ``forget`` did: of the prompt's ``blocks`` full blocks, ``removed`` were held by some tier (or
    on their way) and are gone; the first ``kept_shared`` were left because other prompts extend them."""

    blocks: int
    removed: int
    kept_shared: int


def forget(store: TieredStore, chain: BlockChain, *, shared: bool = False) -> Forgotten:
    """Remove the prompt's blocks from every tier, their saves on their way included (a barrier, like
    ``invalidate``): only those no other stored prompt extends, or all of them with ``shared``. What other
    prompts extend is known from the disk tier's index (without one, nothing counts as shared); a
    continuation held only in memory is not seen."""
    disk = next((t for t in store.tiers if isinstance(t, DiskTier)), None)
    if disk is not None and not shared and not disk.retention_enabled():
        raise ConfigError(
            "this cache directory is format 1: which stored prompts extend which is not known until "
            "`tierkv gc --upgrade`; delete with shared=true to remove the whole prompt meanwhile"
        )
    keep = 0 if shared or disk is None else _shared_blocks(disk, chain)
    removed = invalidate(store, chain, range(keep, len(chain)))
    return Forgotten(len(chain), removed, keep)


def purge(store: TieredStore, namespace: str | None, *, purge_all: bool = False) -> dict[str, Any]:
    """Drop one namespace (a digest prefix) or everything from every tier, then run a gc pass over the
    disk (expiry, budget; its report is returned). The memory tiers keep no namespace index: they are
    cleared whole.

    A barrier: no block saved before the call is in any tier when it returns, those still on their way
    included (in the staging ring, queued or being written: dropped where they are, see
    ``write_behind.Generations``), and a restore begun before it is waited for. Meanwhile the blocks
    it names are misses. A crash in the middle leaves some of them on disk, whole: purging again
    finishes the job. (Another process's saves of the namespace still on their way are its own: a
    ``tierkv gc`` purge beside a live server does not reach them.)"""
    from tierkv.maintenance import resolve_namespace

    disk = store._durable()
    if namespace and purge_all:
        raise ConfigError("namespace and all exclude each other")
    if namespace is None and not purge_all:  # nothing named: a gc pass, the memory tiers emptied
        out = store.gc()
        for tier in store.tiers:
            if isinstance(tier, BlockPool):
                tier.clear()
        return out
    digest = None
    if namespace is not None:
        digest = NamespaceDigest(resolve_namespace(disk, namespace, store.writes.gens.seen()))
    with store.writes.gens.fence(digest):
        with store.writes.gate:  # a block found live before the fence is in the pools by now
            for tier in store.tiers:
                if isinstance(tier, BlockPool):
                    tier.drop(digest)
        out = store.gc(namespace=digest, purge_all=purge_all)
        for tier in store.tiers:
            if not isinstance(tier, (BlockPool, DiskTier)):
                tier.drop(digest)
    return out


def _shared_blocks(disk: DiskTier, chain: BlockChain) -> int:
    """How many leading blocks of ``chain`` a stored block of another prompt extends (those a deletion
    by prompt keeps): the end of the longest prefix with a stored continuation other than this chain's
    own (the disk index's ``children`` rows)."""
    n = len(chain)
    with disk.index.read() as txn:
        for i in range(n - 1, -1, -1):
            own = bytes(chain.keys[i + 1]) if i + 1 < n else None
            if any(child != own for child in disk.index.children(txn, bytes(chain.keys[i]))):
                return i + 1
    return 0


def invalidate(store: TieredStore, chain: BlockChain, blocks: Iterable[int]) -> int:
    """Remove blocks ``blocks`` (indices into the prompt's full blocks) from every tier: a caller
    learnt a copy may be wrong (a connector told a save was bad, a sampled check that found a restored
    block different from the recomputed one). Held host slots, disk records and remote keys go, and
    their saves still on their way are dropped; a restore begun before is waited for. Later blocks
    are left: saving these again reconnects them, so a caller that suspects what was computed from these
    purges the namespace instead (keys of descendants cannot be listed). Returns how many of them some
    tier held (or had queued); saving them again afterwards stores the new KV."""
    idx = sorted(set(blocks))
    if idx and not 0 <= idx[0] <= idx[-1] < len(chain):
        raise ConfigError(f"block indices must be in 0..{len(chain) - 1} (the prompt's full blocks)")
    if not idx:
        return 0
    keys = [chain.keys[i] for i in idx]
    held = [False] * len(keys)
    with store.writes.gens.fence(chain.ns.digest, keys):
        for tier in store.tiers:
            if isinstance(tier, BlockPool):
                with store.writes.gate:
                    got = tier.invalidate(chain.ns.digest, keys)
            else:
                got = tier.invalidate(chain.ns.digest, keys)
            held = [a or b for a, b in zip(held, got)]
    return sum(held)
