"""The order a disk writer's batch is appended in (``writer.py``): each prompt's blocks together."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.tiers.disk.writer import Put

__all__ = ["by_chain"]


def by_chain(puts: list[Put]) -> list[Put]:
    """The batch with each block right after its parent where the parent is in the batch too, the chains
    in the order their first blocks came. A server saving many prompts at once queues their blocks
    interleaved; appended as queued, a prompt's blocks would lie apart, and its restore would read one
    lone record at a time instead of runs that coalesce and read ahead. Parents stay before children
    (the index's ``after`` rule), and a prefix shared by two prompts continues only the first. An
    import's batch (puts that must not evict) keeps its order: most recently used first, for the budget."""
    if any(not p.evict for p in puts):
        return puts
    chains: list[list[Put]] = []
    tails: dict[bytes, int] = {}  # a chain's last key -> the chain
    for p in puts:
        at = tails.pop(p.parent, None) if p.parent is not None else None
        if at is None:
            at = len(chains)
            chains.append([])
        chains[at].append(p)
        tails[p.key] = at
    return puts if len(chains) == 1 else [p for chain in chains for p in chain]
