"""What every tier is to the store: one set of calls, so the store is a loop over a list of tiers.

The store keeps its tiers fastest first (GPU pool, host pool, disk, remote). A restore asks each tier
what it holds of a prompt's chain (``probe``), reads each run of blocks from the fastest tier holding it
(``read_into``: the tier verifies what it reads and purges its own bad blocks), then writes what it
restored into the faster tiers. Saves go to the write-behind (``write_behind.py``), which calls ``write``.

Two kinds of tier exist: memory pools (``pool.BlockPool``: slots of raw KV on a device, written by a copy)
and record tiers (disk, remote: self-verifying records, written behind by their own thread). Both are
``Tier``s; ``memory`` says which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tierkv import codec
from tierkv.codec import Unsealed
from tierkv.keys import BlockChain, BlockKey, Namespace, NamespaceDigest
from tierkv.retention import Retention
from tierkv.tenancy import Quota

if TYPE_CHECKING:
    import torch

    from tierkv.tiers.target import Target

__all__ = ["BlockWrite", "Tier"]


@dataclasses.dataclass(frozen=True)
class BlockWrite:
    """One block on its way into a record tier: encoded on that tier's writer thread, not the caller's.

    ``payload`` is the block's bytes on the CPU (a held host slot, or a private copy); it stays valid
    until ``release`` runs, which the tier calls once the record is written or dropped (or the caller,
    when ``write`` returned False). ``live()`` turns False once the block was purged or invalidated (see
    ``write_behind.Generations``): the tier then drops it instead of storing it, checking as late as it
    can (the disk writer: in the transaction that would index it).
    """

    ns: Namespace
    key: BlockKey
    parent: BlockKey
    token_bytes: bytes
    created_s: float
    payload: torch.Tensor
    codec: codec.Codec = codec.Codec.RAW
    release: Callable[[], None] | None = None
    live: Callable[[], bool] | None = None

    @property
    def nbytes(self) -> int:
        """The record's size before compression, in its longest layout (the writer queues' bound: a
        version-2 record's payload sits up to 63 bytes further in)."""
        return codec.payload_at(max(codec.RECORD_VERSIONS), len(self.token_bytes)) + self.payload.numel()

    def encode(self, version: int = 1) -> list[bytes | memoryview]:
        return codec.seal(self.unsealed(version))

    def unsealed(self, version: int = 1) -> Unsealed:
        """The record without its checksums (the disk tier's native writer computes them off the GIL), in
        record ``version`` (``codec.RECORD_VERSIONS``: the disk tier's store says which)."""
        return codec.encode_unsealed(
            ns_digest=self.ns.digest,
            parent_key=self.parent,
            key=self.key,
            token_bytes=self.token_bytes,
            dtype=self.ns.dtype,
            shape=_block_shape(self.ns),
            payload=self.payload.numpy().data,
            created_s=self.created_s,
            codec=self.codec,
            version=version,
        )

    def done(self) -> None:
        if self.release is not None:
            self.release()


def _block_shape(ns: Namespace) -> tuple[int, ...]:
    return (ns.num_layers, 2, ns.block_tokens, ns.num_kv_heads, ns.head_dim)


class Tier:
    """The calls the store makes. Defaults suit a tier without the feature; a tier overrides the rest."""

    name: str = "tier"
    memory: bool = False  # a pool of raw KV slots on a device (see ``pool.BlockPool``)

    def probe(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        """Per block ``idx[j]`` of ``chain``: held here and servable (unexpired). Reads no payload, changes
        nothing (a lookup has no side effects)."""
        raise NotImplementedError

    def read_into(self, chain: BlockChain, first: int, count: int, target: Target) -> int:
        """Read blocks ``first .. first+count-1`` into ``target`` and verify them; returns how many
        leading blocks are exact. A block that fails verification is purged here and ends the run."""
        raise NotImplementedError

    def needs(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        """Per block ``idx[j]``: whether a save should write it here (not held, not already queued)."""
        return [not h for h in self.probe(chain, idx)]

    def write(self, block: BlockWrite) -> bool:
        """Queue a record (record tiers). False (counted) when it was dropped; then the caller still owns
        what ``block.release`` frees."""
        raise NotImplementedError

    # Write-back (record tiers with a bounded queue): a block the queue has no room for now waits dirty in
    # the host tier, and ``on_room``'s callback brings it over later (write_behind.py).
    writes_back = False

    def has_room(self, nbytes: int) -> bool:
        return True

    def on_room(self, refill: Callable[[], object]) -> None:
        """Have ``refill`` called whenever the queue has room again (write-back tiers)."""

    def try_write(self, block: BlockWrite) -> bool | None:
        """``write``, except that a write-back tier with a full queue returns None: nothing counted,
        nothing released (the caller keeps the block, and the release, for later)."""
        return self.write(block)

    def requested(self, chain: BlockChain) -> None:
        """A request for ``chain`` arrived (admission counting); called before the probe of a restore."""

    def extend_retention(self, chain: BlockChain, count: int, retention: Retention) -> None:
        """Blocks ``0..count-1`` were used by a request asking ``retention`` (a tier that keeps blocks by
        their own retention extends theirs: the disk tier)."""

    def set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        """The tenants' quotas by tenant id (``tenancy.Quota``): a tier that evicts by them keeps them."""

    def tenant_usage(self) -> dict[bytes, dict[str, int]]:
        """Per tenant id, what it holds here (``<tier>_nbytes``, and more where the tier counts it)."""
        return {}

    def served_above(self, chain: BlockChain, idx: Sequence[int]) -> list[int]:
        """Blocks ``idx`` were just served by faster tiers: refresh what this tier holds of them (a hit
        keeps a block alive everywhere) and return those it wants written (lost here, or newly admitted)."""
        return []

    def drop(self, ns: NamespaceDigest | None) -> int:
        """Remove every block of namespace ``ns`` (None: of every namespace), a purge; returns how many.
        The store calls it inside a fence (``write_behind.Generations``): blocks still on their way are
        dropped there, so what this removes does not come back."""
        return 0

    def invalidate(self, ns: NamespaceDigest, keys: Sequence[BlockKey]) -> list[bool]:
        """Remove these blocks of namespace ``ns`` (they may be wrong), inside a fence like ``drop``;
        per key whether this tier held it (or had it queued)."""
        return [False] * len(keys)

    def stats(self) -> dict[str, int]:
        return {}

    def describe(self) -> str:
        return self.name

    def flush(self) -> object:
        """Wait until what was written is durable (a no-op for memory)."""

    def close(self) -> None:
        pass
